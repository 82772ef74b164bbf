"""Render docs/bench/*.json (written by `tokentop bench ... --out`) as markdown tables.

    python tools/bench_tables.py > docs/benchmarks-tables.md
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "docs" / "bench"


def load(name):
    p = ROOT / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def f(x, nd=1):
    return "—" if x is None else f"{x:.{nd}f}"


def single(d):
    out = [f"`{d['command']}` ({d['started']}, {d['runs']} runs, medians)\n",
           "| model | prefill tok/s (500-token prompt) | llama.cpp | ratio (goal) | decode tok/s (128 tokens) | llama.cpp | ratio (goal) | peak RSS MB | llama.cpp | ratio |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["results"]:
        if "error" in r:
            out.append(f"| {r['model']} | error: {r['error']} |")
            continue
        l, g = r.get("llama_cpp") or {}, r.get("goals") or {}
        out.append(f"| {r['model']} | {f(r['prefill_tok_s_median'])} | {f(l.get('prefill_tok_s_median'))} | "
                   f"{f(r.get('prefill_ratio'), 2)} ({g.get('prefill_ratio', '—')}) | {f(r['decode_tok_s_median'])} | "
                   f"{f(l.get('decode_tok_s_median'))} | {f(r.get('decode_ratio'), 2)} ({g.get('decode_ratio', '—')}) | "
                   f"{f(r['peak_rss_mb'], 0)} | {f(l.get('peak_rss_mb'), 0)} | {f(r.get('rss_ratio'), 2)} |")
    return "\n".join(out)


def batching(d):
    out = [f"`{d['command']}` ({d['started']}, {d['runs']} run(s), {d['output_tokens']} output tokens each)\n",
           "| N concurrent | batched aggregate tok/s | one after another tok/s | batched / sequential |",
           "|---|---|---|---|"]
    for t in d["batching"]:
        out.append(f"| {t['n']} | {f(t['batched_tok_s'])} | {f(t['sequential_tok_s'])} | {f(t['ratio'], 2)} |")
    out += ["", f"Aggregate at N=8 over one stream: **{d['aggregate_n8_over_n1']}×**.", "",
            "| N | paged tok/s | contiguous tok/s | paged / contiguous |", "|---|---|---|---|"]
    for k in d["paged_vs_contiguous"]:
        out.append(f"| {k['n']} | {f(k['paged_tok_s'])} | {f(k['contiguous_tok_s'])} | {f(k['paged_over_contiguous'], 3)} |")
    out.append(f"\nGoals: {d['goals']}")
    return "\n".join(out)


def routing(d):
    devs = ", ".join(f"{x['name']}{' (simulated)' if x['simulated'] else ''} "
                     f"{f(x['profile_prefill_tps'], 0)}/{f(x['profile_decode_tps'], 0)} tok/s" for x in d["devices"])
    out = [f"`{d['command']}` ({d['started']}, {d['runs']} run(s)); workers: {devs}; "
           f"{d['prompt_tokens']}-token prompts sharing {d['shared_prefix_tokens']} tokens, "
           f"{d['output_tokens']} output tokens, {d['interval_ms']} ms apart, 4 active per worker\n",
           "| requests | policy | completion s | throughput tok/s | TTFT p50 / p95 s | e2e p50 / p95 s | requests per worker |",
           "|---|---|---|---|---|---|---|"]
    for t in d["table"]:
        out.append(f"| {t['requests']} | {t['policy']} | {f(t['completion_s'], 2)} | {f(t['throughput_tok_s'])} | "
                   f"{f(t['ttft_p50'], 2)} / {f(t['ttft_p95'], 2)} | {f(t['e2e_p50'], 2)} / {f(t['e2e_p95'], 2)} | "
                   f"{t['requests_per_worker']} |")
    goals = d["goals"] if "cost" in {t["policy"] for t in d["table"]} else "—"
    out.append(f"\nGoals: {goals}")
    return "\n".join(out)


def trace(d):
    return (f"`{d['command']}` ({d['started']}, {d['runs']} runs interleaved)\n\n"
            "| tracing off tok/s | tracing on tok/s | on / off | disabled scope | scopes per step | disabled cost / step |\n"
            "|---|---|---|---|---|---|\n"
            f"| {f(d['tracing_off_tok_s'])} | {f(d['tracing_on_tok_s'])} | {d['on_over_off']} | "
            f"{d['disabled_scope_ns']} ns | {d['scopes_per_step']} | {d['disabled_cost_fraction_of_step'] * 100:.3f}% |\n\n"
            f"Goals: {d['goals']}")


def dashboard(d):
    return (f"`{d['command']}` ({d['started']}, {d['runs']} runs)\n\n"
            "| headless tok/s | dashboard open tok/s | dashboard / headless |\n|---|---|---|\n"
            f"| {f(d['headless_tok_s'])} | {f(d['dashboard_tok_s'])} | {d['dashboard_over_headless']} |\n\n"
            f"Goals: {d['goals']}")


def main():
    parts = []
    for name, render in (("single-0.5b", single), ("single-1.5b", single), ("batching", batching),
                         ("routing", routing), ("routing-all-policies", routing), ("trace", trace), ("dashboard", dashboard)):
        d = load(name)
        if d:
            parts.append(f"### {name}\n\n{render(d)}\n")
    sys.stdout.write("\n".join(parts))


if __name__ == "__main__":
    main()
