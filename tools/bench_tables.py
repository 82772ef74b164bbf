"""Render docs/bench/*.json (written by `tokentop bench ... --out`) as markdown tables."""
import argparse
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


MODES = ("independent", "incremental", "at-completion", "after-prefill")
SEEDS_8 = {"independent": "baseline", "incremental": "— (not measured)", "at-completion": "−47.5% / −25.8%",
           "after-prefill": "−82.9% / −32.4%"}


def prefix(d):
    wc = d["warm_vs_cold"]
    out = [f"`{d['command']}` ({d['started']}, {d['runs']} run(s), {d['output_tokens']} output tokens; "
           f"CPU {d['machine']['cpu_model']})\n",
           "| 1. warm vs cold | restored | cold TTFT s | warm TTFT s | TTFT change (goal warm ≤ 5% of cold) | seeds (M2 GPU) |",
           "|---|---|---|---|---|---|",
           f"| ~900-token document | {wc['restored_tokens']} of {wc['prompt_tokens']} | {f(wc['cold_ttft_s'], 3)} | "
           f"{f(wc['warm_ttft_s'], 3)} | {wc['ttft_change']}% ({'met' if wc['goal_warm_le_5pct_of_cold'] else 'missed'}) "
           f"| 880 of 904, −96.2% |", ""]
    for title, rows in (("2. identical requests, 532-token prompt", d["identical"]),
                        ("3. shared 800-token document, different questions", d["partial_prefix"])):
        out += [f"| {title} | N | mean TTFT s | TTFT change | per-run change (median) | slowest s | slowest change "
                "| restored per request" + (" | seeds at N=8: TTFT / slowest change |" if title.startswith("2") else " |"),
                "|---|---|---|---|---|---|---|---|" + ("---|" if title.startswith("2") else "")]
        for row in rows:
            for m in MODES:
                r = row[m]
                restored = sorted(set(r["restored_tokens"]))
                paired = r.get("mean_ttft_change_paired")
                line = (f"| {m} | {row['n']} | {f(r['mean_ttft_s'], 2)} | {r['mean_ttft_change']}% | "
                        f"{'—' if paired is None else f'{paired}%'} | "
                        f"{f(r['slowest_s'], 2)} | {r['slowest_change']}% | {restored} |")
                if title.startswith("2"):
                    line += f" {SEEDS_8[m] if row['n'] == 8 else ''} |"
                out.append(line)
        out.append("")
    cy, eq = d["cyclic"], d["equality"]
    out += [f"4. cyclic: {cy['documents']} documents of {cy['document_tokens']} tokens, {cy['cycles']} cycles, "
            f"{cy['cache_pages']}-page cache: hit rate {cy['hit_rate']:.1%}, {cy['evictions']} evictions, "
            f"{cy['errors']} errors (seeds: 0 restored).",
            f"5. greedy tokens cache on vs off (--deterministic): identical served together "
            f"{eq['identical_together']}, one by one {eq['identical_one_by_one']}; restored "
            f"{eq['restored_tokens_together']} / {eq['restored_tokens_one_by_one']} tokens."]
    return "\n".join(out)


# The seed article's sampling benchmark (Qwen2.5 7B target, 0.5B draft, Apple M2, creative
# prompt at temperature 0.7, 256 tokens, EOS ignored, no bonus token): median E2E latency.
SEEDS_SPEC = {"target only": "20.971 s", "mentored D=0.75 k=8": "18.820 s (93.4%, 34 rounds)",
              "mentored D=0.5 k=8": "22.900 s (63.5%, 46 rounds)", "mentored D=1 k=8": "18.508 s (100%, 32 rounds)"}


def spec(d):
    out = [f"`{d['command']}` ({d['started']}, {d['runs']} run(s), creative: {d['workloads']['creative']}, "
           f"{d['max_tokens']} tokens; CPU {d['machine']['cpu_model']})\n",
           "decode tok/s = (output − 1) / (e2e − TTFT): the draft model's catch-up on the prompt counts "
           "against speculation. Acceptance = accepted / drafted tokens; length = tokens per verify round.\n",
           "| model | configuration | code tok/s | × target | acc | length | rounds | creative tok/s | × target "
           "| acc | length | rounds | seeds (7B/0.5B on M2, creative) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        for name, row in d[model].items():
            c, r = row["code"], row["creative"]
            seeds = SEEDS_SPEC.get(name, "") if model.endswith("1.5b") else ""
            out.append(f"| {model} | {name} | {f(c['decode_tok_s'])} | {f(c['vs_target_only'], 2)} | "
                       f"{f(c['acceptance'], 2)} | {f(c['mean_accepted_length'], 2)} | {f(c['rounds_per_request'], 0)} | "
                       f"{f(r['decode_tok_s'])} | {f(r['vs_target_only'], 2)} | {f(r['acceptance'], 2)} | "
                       f"{f(r['mean_accepted_length'], 2)} | {f(r['rounds_per_request'], 0)} | {seeds} |")
    b = d["burst"]
    out += ["", f"Burst of {b['requests']} concurrent requests ({b['max_tokens']} tokens, {b['policy']}): "
            f"off {f(b['off_tok_s'])} tok/s, draft {f(b['draft_tok_s'])} ({f(b['draft_vs_off'], 2)}×), "
            f"ngram {f(b['ngram_tok_s'])} ({f(b['ngram_vs_off'], 2)}×).", "", f"Goals: {d['goals']}"]
    return "\n".join(out)


def main():
    argparse.ArgumentParser(description=__doc__).parse_args()
    parts = []
    for name, render in (("single-0.5b", single), ("single-1.5b", single), ("batching", batching),
                         ("routing", routing), ("routing-all-policies", routing), ("trace", trace), ("dashboard", dashboard),
                         ("prefix", prefix), ("spec", spec)):
        d = load(name)
        if d:
            parts.append(f"### {name}\n\n{render(d)}\n")
    sys.stdout.write("\n".join(parts))


if __name__ == "__main__":
    main()
