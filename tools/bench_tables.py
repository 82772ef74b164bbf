"""Rewrite docs/benchmarks.md (from the kept reports in docs/bench/) and docs/kernels.md (from the text held here)."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BENCH = DOCS / "bench"
PAGE = DOCS / "benchmarks.md"
KERNELS_PAGE = DOCS / "kernels.md"

USAGE = """\
docs/benchmarks.md: one section per benchmark: what it measures, the command, the latest figures
per CPU class (one report per benchmark and class: docs/bench/BENCH-CLASS.json) and what bounds
them. docs/kernels.md: the measurements behind the kernels' forms and the defaults, which no
report backs. The hand-written text lives here, the figures come from the reports only.
  python tools/bench_tables.py            rewrite both pages
  python tools/bench_tables.py --check    exit 1 if either page differs from what this gives
  python tools/bench_tables.py --bundle docs/bench/compare-seeds-CLASS.json --run EXPERIMENT LABEL REPORT COMMAND ...
                                          one kept report of several `tokentop compare` reports
"""

# --- CPU classes -----------------------------------------------------------------------------
# A report records the CPU's model name, cpuid family/model and ISA flags (engine/cpuinfo.py).
# The VMs name every CPU "AMD EPYC", so the class comes from family/model, or, in reports that do
# not record it, from the ISA: among these CPUs AVX-512 with AVX-VNNI is Zen 5 only, AVX-512
# without it Zen 4, AVX2 alone Zen 3.
FAMILY_CLASS = {"25/1": "Zen 3", "25/17": "Zen 4", "26/2": "Zen 5",
                "6/143": "Sapphire Rapids", "6/207": "Emerald Rapids"}
CLASS_ORDER = ("Zen 3", "Zen 4", "Zen 5", "Sapphire Rapids", "Emerald Rapids", "CPU not recorded")


def class_order(cls: str) -> int:
    return CLASS_ORDER.index(cls) if cls in CLASS_ORDER else len(CLASS_ORDER)


def cpu_class(machine: dict) -> str:
    cls = _cpu(machine)
    # the AVX2 kernels on an AVX-512 CPU (TOKENTOP_KERNEL_ISA=avx2): their own class
    if str(machine.get("quantized_kernels") or "").startswith("avx2") and "avx512f" in (machine.get("isa") or ()):
        return f"{cls}, AVX2 kernels"
    return cls


def _cpu(machine: dict) -> str:
    if machine.get("cpu_family_model") in FAMILY_CLASS:
        return FAMILY_CLASS[machine["cpu_family_model"]]
    if machine.get("cpu_model") and not machine["cpu_model"].startswith("AMD"):
        return machine["cpu_model"]
    isa = set(machine.get("isa") or ())
    if not isa:
        return "CPU not recorded"
    if "avx512f" in isa:
        return "Zen 5" if "avx_vnni" in isa else "Zen 4"
    return "Zen 3"


def isa_summary(isa: list[str]) -> str:
    isa = set(isa)
    if not isa:
        return "—"
    base = ("AVX-512 F/BW/VL/VNNI" + ("/BF16" if "avx512_bf16" in isa else "")) if "avx512f" in isa else "AVX2/FMA"
    extra = [name for flag, name in (("avx_vnni", "AVX-VNNI"), ("amx_tile", "AMX")) if flag in isa]
    return base + "".join(f" + {e}" for e in extra) + ("" if "avx512f" in isa else " only")


# --- reports ---------------------------------------------------------------------------------
class Report:
    def __init__(self, path: Path):
        self.path = path
        self.rel = path.relative_to(DOCS).as_posix()           # bench/single-zen5.json
        self.data = json.loads(path.read_text())
        # a GPU check holds its benches' reports: their machine is the GPU machine's host
        self.machine = self.data.get("machine") or self.data.get("sections", {}).get("single", {}).get("machine") or {}
        self.cls = cpu_class(self.machine)

    def __getitem__(self, key):
        return self.data[key]

    @property
    def link(self) -> str:
        return f"[{self.path.name}]({self.rel})"

    @property
    def command(self) -> str:
        """The command that wrote the report, without its --out (a path of that machine)."""
        return re.sub(r" --out \S+", "", self.data["command"])


def reports(pattern: str) -> list[Report]:
    """The reports matching pattern, in CLASS_ORDER."""
    found = [Report(p) for p in sorted(BENCH.glob(pattern))]
    return sorted(found, key=lambda r: class_order(r.cls))


def newest_per_class(found: list[Report]) -> list[Report]:
    best: dict[str, Report] = {}
    for r in found:
        if r.cls not in best or r["started"] > best[r.cls]["started"]:
            best[r.cls] = r
    return sorted(best.values(), key=lambda r: class_order(r.cls))


def f(x, nd=1) -> str:
    return "—" if x is None else f"{x:,.{nd}f}"


def x(ratio, nd=2) -> str:
    return "—" if ratio is None else f"{ratio:.{nd}f}×"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def commands(found: list[Report]) -> str:
    """The commands, once each, with the reports they wrote."""
    by_command: dict[str, list[Report]] = {}
    for r in found:
        by_command.setdefault(r.command, []).append(r)
    return "\n".join(f"* {', '.join(r.link for r in rs)}: `{cmd}`" for cmd, rs in by_command.items()) + "\n"


def section(title: str, measures: str, found: list[Report], body: str, bounds: str = "") -> str:
    return f"## {title}\n\n{measures}\n\n{commands(found)}\n{body}\n" + (f"\n{bounds}\n" if bounds else "")


def unmeasured(title: str, measures: str, command: str) -> str:
    """The section of a benchmark with no kept report: what it measures and how to run it."""
    return f"## {title}\n\n{measures}\n\n* no report kept: `{command}`\n"


def num(v) -> str:
    """A figure of a report whose fields are not known in advance: ints whole, floats to two
    decimals (three significant figures below 0.01)."""
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:,.2f}" if abs(v) >= 0.01 or v == 0 else f"{v:.3g}"


def goals(report: Report) -> str:
    """A report's goals (name -> met): all met, or which were missed."""
    g = report.data.get("goals") or {}
    missed = [name for name, ok in g.items() if not ok]
    if not missed:
        return "—" if not g else "met" if len(g) == 1 else f"all {len(g)} met"
    return f"**missed**: {', '.join(missed)} ({len(g) - len(missed)} of {len(g)} met)"


# --- sections --------------------------------------------------------------------------------
MODEL_SHORT = {"qwen2.5-coder-0.5b": "0.5B", "qwen2.5-coder-1.5b": "1.5B"}


def single_rows(r: Report) -> dict[str, dict]:
    return {row["model"]: row for row in r["results"]}


def read_share(roofline: dict) -> str:
    """The decode's read against the machine's read ceiling: the median of the runs' own shares
    (each against the ceiling measured around it) where the report has them."""
    paired = (roofline.get("paired") or {}).get("read_share")
    if paired is not None:
        return f"{100 * paired:.0f}% (runs {', '.join(f'{100 * v:.0f}' for v in roofline['paired']['read_share_runs'])})"
    return f"{100 * roofline['read_share']:.0f}%" if roofline.get("read_share") is not None else "—"


def sec_single() -> str:
    found = reports("single-*.json")
    rows = []
    for r in found:
        for row in r["results"]:
            ref = row.get("llama_cpp") or {}
            rows.append([r.cls, MODEL_SHORT.get(row["model"], row["model"]),
                         f(row["prefill_tok_s_median"], 0), f(ref.get("prefill_tok_s_median"), 0),
                         f"**{x(row.get('prefill_ratio'))}**",
                         f(row["decode_tok_s_median"]), f(ref.get("decode_tok_s_median")),
                         f"**{x(row.get('decode_ratio'))}**",
                         f(row["peak_rss_mb"], 0), f(ref.get("peak_rss_mb"), 0), x(row.get("rss_ratio")),
                         read_share(row.get("roofline") or {})])
    body = table(["CPU", "model", "prefill tok/s", "llama.cpp", "ratio", "decode tok/s", "llama.cpp", "ratio",
                  "peak RSS MB", "llama.cpp", "ratio", "decode read share"], rows)
    return section("single: one stream against llama.cpp", TEXT["single"], found, body, BOUNDS["single"])


def sec_batching() -> str:
    found = newest_per_class(reports("batching-*.json"))
    sizes = sorted({t["n"] for r in found for t in r["batching"]})
    rows = []
    for r in found:
        by_n = {t["n"]: t for t in r["batching"]}
        kv = {k["n"]: k["paged_over_contiguous"] for k in r["paged_vs_contiguous"]}
        eight = by_n.get(8, {})
        rows.append([r.cls, *(f(by_n[n]["batched_tok_s"]) if n in by_n else "—" for n in sizes),
                     f"**{x(r['aggregate_n8_over_n1'])}**", x(eight.get("ratio")),
                     f"{x(kv.get(1), 3)}, {x(kv.get(8), 3)}"])
    body = table(["CPU", *(f"N = {n} tok/s" for n in sizes), "N8 / N1", "batched / sequential, N = 8",
                  "paged / contiguous, N = 1, 8"], rows)
    return section("batching: N streams in one engine", TEXT["batching"], found, body, BOUNDS["batching"])


def sec_llama_server() -> str:
    found = reports("batching-llama-server-*.json")
    rows = []
    for r in found:
        s = r["llama_server"]
        by_n = {t["n"]: t for t in s["table"]}
        rows.append([r.cls, f(by_n[1]["tokentop_tok_s"]), f(by_n[1]["llama_server_tok_s"]), x(by_n[1]["tokentop_over_llama_server"]),
                     f(by_n[8]["tokentop_tok_s"]), f(by_n[8]["llama_server_tok_s"]),
                     f"**{x(by_n[8]['tokentop_over_llama_server'])}**",
                     x(s["tokentop_n8_over_n1"]), x(s["llama_server_n8_over_n1"])])
    body = table(["CPU", "tokentop N = 1 tok/s", "llama-server", "ratio", "tokentop N = 8 tok/s", "llama-server -np 8",
                  "ratio", "tokentop N8 / N1", "llama-server N8 / N1"], rows)
    return section("batching against llama-server", TEXT["llama_server"], found, body, BOUNDS["llama_server"])


def routing_table(r: dict) -> str:
    rows = [[str(t["requests"]), t["policy"], f(t["completion_s"], 2), f(t["throughput_tok_s"]),
             f"{f(t['ttft_p50'], 2)} / {f(t['ttft_p95'], 2)}", f"{f(t['e2e_p50'], 2)} / {f(t['e2e_p95'], 2)}",
             ", ".join(f"{k}: {v}" for per_run in t["requests_per_worker"] for k, v in sorted(per_run.items()))]
            for t in r["table"]]
    return table(["requests", "policy", "completion s", "tok/s", "TTFT p50 / p95 s", "e2e p50 / p95 s",
                  "requests per worker"], rows)


def workers(r: dict) -> str:
    return "; ".join(f"worker {d['index']} {d['name']}{' (simulated)' if d['simulated'] else ''}: "
                     f"{f(d['profile_prefill_tps'], 0)} / {f(d['profile_decode_tps'])} tok/s prefill / decode"
                     for d in r["devices"])


def sec_routing() -> str:
    found = reports("routing-*.json")
    body = "\n\n".join(f"{r.cls}: {workers(r.data)}.\n\n{routing_table(r.data)}" for r in found)
    return section("routing: a burst over unequal workers", TEXT["routing"], found, body, BOUNDS["routing"])


MODES = ("independent", "incremental", "at-completion", "after-prefill")


def seed_text(r, key: str, fmt: str, sep: str = " ") -> str:
    """mini-vllm-rs's published figures for the same workload, as the report keeps them ("seeds")."""
    seed = r.data.get("seeds", {}).get(key)
    return f"{sep}mini-vllm-rs, published (M2 GPU): {fmt.format(**seed)}." if seed else ""


def sec_prefix() -> str:
    found = reports("prefix-*.json")
    parts = []
    for r in found:
        wc = r["warm_vs_cold"]
        parts.append(f"{r.cls}. Warm against cold (~900-token document): {wc['restored_tokens']} of "
                     f"{wc['prompt_tokens']} tokens restored, TTFT {f(wc['cold_ttft_s'], 3)} → "
                     f"{f(wc['warm_ttft_s'], 3)} s (**{wc['ttft_change']}%**)."
                     + seed_text(r, "warm_vs_cold", "{restored}, {ttft_change}"))
        for title, rows in (("identical requests, 532-token prompt", r["identical"]),
                            ("8 questions on one shared 800-token document", r["partial_prefix"])):
            out = []
            for row in rows:
                for m in MODES:
                    t = row[m]
                    out.append([str(row["n"]), m, f(t["mean_ttft_s"], 2), f"{t['mean_ttft_change']}%",
                                f(t["slowest_s"], 2), f"{t['slowest_change']}%",
                                ", ".join(map(str, sorted(set(t["restored_tokens"]))))])
            parts.append(f"{title.capitalize()}, against `independent` (no cache):\n\n" + table(
                ["N", "mode", "mean TTFT s", "change", "slowest s", "change", "tokens restored"], out))
            if rows is r["identical"]:
                parts[-1] += seed_text(r, "identical_8", "N = 8, mean TTFT at-completion {at_completion_mean_ttft_change}, "
                                       "after-prefill {after_prefill_mean_ttft_change}; slowest "
                                       "{at_completion_slowest_change}, {after_prefill_slowest_change}", "\n\n")
        cy, eq = r["cyclic"], r["equality"]
        parts.append(f"Cyclic working set ({cy['documents']} documents of {cy['document_tokens']} tokens through a "
                     f"{cy['cache_pages']}-page cache, {cy['cycles']} cycles): hit rate {cy['hit_rate']:.0%}, "
                     f"{cy['evictions']} evictions, {cy['errors']} errors. Greedy tokens with the cache on and off "
                     f"(`--deterministic`): {'identical' if eq['identical_together'] else '**different**'} served together, "
                     f"{'identical' if eq['identical_one_by_one'] else '**different**'} one by one.")
    return section("prefix: prefix caching", TEXT["prefix"], found, "\n\n".join(parts), BOUNDS["prefix"])


def sec_spec() -> str:
    found = reports("spec-*.json")
    parts = []
    for r in found:
        rows = []
        for model in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
            for name, row in r[model].items():
                c, k = row["code"], row["creative"]
                rows.append([MODEL_SHORT[model], name, f(c["decode_tok_s"]), x(c["vs_target_only"]),
                             f(c["acceptance"], 2), f(c["mean_accepted_length"], 2),
                             f(k["decode_tok_s"]), x(k["vs_target_only"]), f(k["acceptance"], 2),
                             f(k["mean_accepted_length"], 2)])
        b = r["burst"]
        parts.append(f"{r.cls}; code: {r['workloads']['code']}, creative: {r['workloads']['creative']}, "
                     f"{r['max_tokens']} tokens.\n\n" + table(
                         ["target", "speculation", "code tok/s", "× target", "acceptance", "length",
                          "creative tok/s", "× target", "acceptance", "length"], rows) +
                     f"\n\nBurst of {b['requests']} concurrent requests ({b['max_tokens']} tokens, {b['policy']}): "
                     f"off {f(b['off_tok_s'])} tok/s, draft model {f(b['draft_tok_s'])} ({x(b['draft_vs_off'])}), "
                     f"n-gram {f(b['ngram_tok_s'])} ({x(b['ngram_vs_off'])}).")
        if rb := r.data.get("repeated_burst"):
            parts[-1] += (f"\n\nThe burst's {rb['tasks']} tasks fired twice on the 0.5B (greedy): the second time, "
                          f"suffix decoding ran {x(rb['second_pass_suffix_vs_off'])} the speed of the same firing "
                          f"without speculation (the first time {x(rb['first_pass_suffix_vs_off'])}).")
    return section("spec: speculative decoding", TEXT["spec"], found, "\n\n".join(parts), BOUNDS["spec"])


# --- mini-vllm-rs's experiments: ours beside the published figures ------------------------------
# Pujun Lun's mini-vllm-rs articles; the figures as printed there (their machine: an Apple M2).
PUBLISHED_SOURCE = ("mini-vllm-rs (Pujun Lun), as published: single flight from \"Why My Prefix Cache Missed "
                    "Identical Requests\" (4-bit Qwen2.5 0.5B, M2 Metal); routing from \"When LLM Inference on "
                    "CPU Beats Waiting for the GPU\" (Qwen2.5 0.5B, M2 CPU + Metal, means of 3 runs); speculation "
                    "from \"What I Gave Up to Make Speculative Decoding Faster\" (Qwen2.5 7B target, 0.5B draft, "
                    "greedy); batching from \"Why Continuous Batching Made My LLM Inference Engine Slower\" "
                    "(4-bit Qwen2.5 7B, M2 Metal, 512 tokens a request)")
PUBLISHED = {
    # N: mean TTFT ms, release at completion -> after prefill (128 tokens, identical requests)
    "single_flight": {2: (1357.5, 584.7), 4: (1757.9, 617.1), 8: (1984.4, 646.7)},
    # requests: completion s forced-GPU -> mixed routing, requests to the CPU, throughput change %
    "routing": {8: (11.47, 10.35, 1, None), 48: (68.43, 60.88, 6, 12.4)},
    # prompt: adaptive draft count's decode throughput against target-only (greedy), acceptance
    "spec": {"spec_code_edit": ("+38.3%", "98.5%"), "spec_creative": ("−36.8%", None)},
    # N: aggregate tok/s unbatched, batched GEMM, batched row-wise GEMV (N = 2's GEMM: 8.7 against 16.8 unbatched)
    "batching": {2: (16.15, 8.7, 16.25), 3: (17.41, 13.05, 17.52), 4: (17.22, 16.55, 18.07), 5: (17.44, 19.92, 18.06)},
}


def braced(commands: list[str]) -> str:
    """The commands, those differing in one word each as one with that word's values in braces."""
    groups: list[tuple[list[list[str]], int | None]] = []      # (commands split, the index they differ at)
    for words in (c.split(" ") for c in dict.fromkeys(commands)):
        for n, (members, at) in enumerate(groups):
            first = members[0]
            differ = [i for i in range(len(first)) if first[i] != words[i]] if len(first) == len(words) else []
            if len(differ) == 1 and at in (None, differ[0]):
                members.append(words)
                groups[n] = (members, differ[0])
                break
        else:
            groups.append(([words], None))
    out = []
    for members, i in groups:
        if i is None:
            out.append(" ".join(members[0]))
            continue
        values = [m[i] for m in members]
        head = os.path.commonprefix(values)
        head = head[:max(head.rfind(c) for c in "/_.=") + 1]          # the braces hold whole names
        tail = os.path.commonprefix([v[len(head):][::-1] for v in values])[::-1]
        tail = tail[min([tail.find(c) for c in "/_." if c in tail] or [len(tail)]):]
        inner = [v[len(head):len(v) - len(tail)] for v in values]
        out.append(" ".join(members[0][:i] + [head + "{" + ",".join(inner) + "}" + tail] + members[0][i + 1:]))
    return "`; `".join(out)


def side(run: dict, name: str) -> dict:
    return run["report"][name]


def mean_ttft_ms(s: dict) -> float:
    values = [r["ttft"] for r in s["requests"] if r["ttft"] is not None]
    return 1000 * sum(values) / len(values)


def decode_tok_s(s: dict) -> float:
    """Median over the side's requests of (output − 1) / (e2e − TTFT), as bench spec measures it."""
    rates = sorted((r["output_tokens"] - 1) / (r["e2e"] - r["ttft"]) for r in s["requests"] if r["e2e"] and r["ttft"])
    mid = len(rates) // 2
    return rates[mid] if len(rates) % 2 else (rates[mid - 1] + rates[mid]) / 2


def pct(new: float, old: float) -> str:
    return f"{100 * (new - old) / old:+.1f}%".replace("-", "−")


def to_worker(s: dict, index: int) -> int:
    return s["summary"]["requests_per_worker"].get(str(index), 0)


def seeds_single_flight(runs: list[dict]) -> str:
    rows = []
    for run in runs:
        n = run["report"]["requests"]
        a, b = mean_ttft_ms(side(run, "a")), mean_ttft_ms(side(run, "b"))
        pa, pb = PUBLISHED["single_flight"].get(n, (None, None))
        rows.append([str(n), f(a, 0), f(b, 0), f"**{pct(b, a)}**", f(pa), f(pb), pct(pb, pa) if pa else "—"])
    return table(["N", "at-completion TTFT ms", "after-prefill", "change", "published", "after-prefill", "change"], rows)


def seeds_routing(runs: list[dict]) -> str:
    rows = []
    for run in runs:
        rep = run["report"]
        n, a, b = rep["requests"], side(run, "a")["summary"], side(run, "b")["summary"]
        cpu = next(w["index"] for w in rep["workers"] if not w["simulated"])
        pa, pb, pcpu, ptput = PUBLISHED["routing"].get(n, (None,) * 4)
        rows.append([str(n), f(a["completion_s"], 2), f(b["completion_s"], 2),
                     f"**{pct(b['completion_s'], a['completion_s'])}**",
                     pct(b["aggregate_tok_s"], a["aggregate_tok_s"]), str(to_worker(side(run, "b"), cpu)),
                     f(pa, 2), f(pb, 2), pct(pb, pa) if pa else "—", f"+{ptput}%" if ptput else "—",
                     "—" if pcpu is None else str(pcpu)])
    return table(["requests", "forced GPU s", "cost s", "change", "tok/s", "to CPU", "published", "mixed s",
                  "change", "tok/s", "to CPU"], rows)


def seeds_spec(runs: list[dict]) -> str:
    by_burst: dict[str, dict[str, dict]] = {}
    for run in runs:
        by_burst.setdefault(Path(run["report"]["burst"]).stem, {})[side(run, "b")["settings"]["speculate"]] = run
    rows = []
    for burst, modes in by_burst.items():
        off = [decode_tok_s(side(r, "a")) for r in modes.values()]
        cells = ["–".join(dict.fromkeys((f(min(off)), f(max(off)))))]
        for mode in ("ngram", "draft"):
            r = modes.get(mode)
            cells.append("—" if r is None else
                         f"{f(decode_tok_s(side(r, 'b')))} (**{pct(decode_tok_s(side(r, 'b')), decode_tok_s(side(r, 'a')))}**)")
        published, acceptance = PUBLISHED["spec"].get(burst, ("—", None))
        rows.append([f"`{burst}`", *cells, published + (f", {acceptance} accepted" if acceptance else "")])
    return table(["burst", "off decode tok/s", "n-gram (vs its off)", "draft, adaptive:cost", "published, adaptive"],
                 rows)


def seeds_rounds(runs: list[dict]) -> str:
    """`compare --rounds N` runs: B/A of aggregate tok/s and ITL, the median of the rounds' own."""
    rows = []
    for run in runs:
        rep = run["report"]
        rounds = rep["rounds"]
        tput = [v for v in rounds["b_over_a_runs"]["aggregate_tok_s"] if v is not None]
        outputs = rep["outputs"]
        same = ("identical" if outputs["identical"] else
                f"{len(outputs['differing'])} differ") if outputs["compared"] else "sampled"
        acceptance = side(run, "b")["summary"].get("acceptance_rate")
        rows.append([f"`{Path(rep['burst']).stem}`", side(run, "a")["label"], side(run, "b")["label"],
                     str(rounds["count"]),
                     f"**{x(rep['b_over_a']['aggregate_tok_s'], 3)}** ({min(tput):.3f}–{max(tput):.3f})",
                     x(rep["b_over_a"].get("itl_mean_p50"), 3),
                     "—" if acceptance is None else f"{acceptance:.0%}", same])
    return table(["burst", "A", "B", "rounds", "B/A aggregate tok/s (rounds' range)", "B/A ITL p50",
                  "B's acceptance", "greedy outputs"], rows)


def seeds_batching(r: Report | None) -> str:
    if r is None:
        return "Batching: no report of this class kept (`tokentop bench batching --sizes 1,2,3,4,5,6,7,8`)."
    by_n = {t["n"]: t for t in r["batching"]}
    one = by_n.get(1, {}).get("batched_tok_s")
    rows = []
    for n in sorted(set(by_n) | set(PUBLISHED["batching"])):
        t, p = by_n.get(n, {}).get("batched_tok_s"), PUBLISHED["batching"].get(n, (None,) * 3)
        rows.append([str(n), f(t), x(t / one) if t and one else "—", *(f(v, 2) for v in p)])
    return (f"Batching ({r.link}: N concurrent 128-token greedy streams of the 0.5B in one engine, aggregate "
            "tok/s; published: the 7B, 512 tokens, N = 2's GEMM against 16.8 unbatched in its own run):\n\n" +
            table(["N", "tok/s", "× N = 1", "published unbatched", "batched GEMM", "row-wise GEMV"], rows))


def sec_seeds() -> str:
    found = newest_per_class(reports("compare-seeds-*.json"))
    parts = []
    for r in found:
        ex = r["experiments"]
        batching = next((b for b in newest_per_class(reports("batching-*.json")) if b.cls == r.cls), None)
        parts.append(f"{r.cls}, {r.link}; " + "; ".join(
            f"{name.replace('_', ' ')}: `{braced([run['command'] for run in runs])}`" for name, runs in ex.items()) + ".")
        for name, render_runs in (("single_flight", seeds_single_flight), ("routing", seeds_routing),
                                  ("spec", seeds_spec), ("rounds", seeds_rounds)):
            if name in ex:
                parts.append(f"{TEXT['seeds_' + name]}\n\n{render_runs(ex[name])}")
        if batching is not None or set(ex) != {"rounds"}:
            parts.append(seeds_batching(batching))
    title = "compare: mini-vllm-rs's experiments, ours beside the published"
    if not found:
        return unmeasured(title, TEXT["seeds"], "tokentop compare BURST --a ... --b ... (bundled by "
                          "python tools/bench_tables.py --bundle docs/bench/compare-seeds-CLASS.json --run ...)")
    body = "\n\n".join(parts) + f"\n\nPublished: {PUBLISHED_SOURCE}."
    return f"## {title}\n\n{TEXT['seeds']}\n\n{body}\n\n{BOUNDS['seeds']}\n"


def sec_serve() -> str:
    found = reports("serve-*.json")
    rows = []
    for r in found:
        for name, side in (("in process (`submit`)", r["in_process"]), ("HTTP (`/v1/completions`, SSE)", r["http"])):
            rows.append([r.cls, name, f(side["throughput_tok_s"]), f(side["ttft_p50_s"], 2), f(side["ttft_p95_s"], 2)])
    overhead = "; ".join(f"{r.cls} {r['http_throughput_overhead_pct']}%" for r in found)
    body = table(["CPU", "client", "tok/s", "TTFT p50 s", "TTFT p95 s"], rows) + \
        f"\n\nThroughput lost over HTTP: {overhead}."
    return section("serve: the HTTP API against in process", TEXT["serve"], found, body, BOUNDS["serve"])


def frame_cell(r: Report, view: str) -> str:
    """One frame's cost from the report's `frame` (reports before it have none), bold when over
    its goal."""
    frame = r.data.get("frame")
    if not frame:
        return "—"
    ms = frame[f"{view}_frame_ms"]
    over = frame.get("goal_ms") is not None and ms > frame["goal_ms"]
    return f"**{f(ms, 2)}**" if over else f(ms, 2)


def sec_dashboard() -> str:
    found = reports("dashboard-*.json")
    body = table(["CPU", "headless tok/s", "dashboard open tok/s", "dashboard / headless",
                  "frame ms: table / timeline (live)", "chart ms"],
                 [[r.cls, f(r["headless_tok_s"]), f(r["dashboard_tok_s"]), x(r["dashboard_over_headless"], 3),
                   f"{frame_cell(r, 'table')} / {frame_cell(r, 'timeline')} ({r['frame']['live_requests']})"
                   if r.data.get("frame") else "—",
                   f(r["chart"]["redraw_ms"], 1) if r.data.get("chart") else "—"] for r in found])
    return section("dashboard: the cost of watching", TEXT["dashboard"], found, body, BOUNDS["dashboard"])


def ratio_range(r, key: str) -> str:
    """A median ratio, with the lowest and highest round's where the report has them."""
    low_high = r.data.get(key + "_range")
    return x(r[key], 3) + (f" ({low_high[0]:.3f}–{low_high[1]:.3f})" if low_high else "")


def sec_trace() -> str:
    found = reports("trace-*.json")
    levels = [r for r in found if "light_tok_s" in r.data]     # off, the light ring, full detail
    on_off = [r for r in found if "tracing_on_tok_s" in r.data]   # reports from before the levels
    parts = []
    if levels:
        parts.append(table(["CPU", "off tok/s", "light tok/s", "full tok/s", "light / off", "full / off",
                            "light's records a step", "goals"],
                           [[r.cls, f(r["no_recording_tok_s"]), f(r["light_tok_s"]), f(r["full_tok_s"]),
                             ratio_range(r, "light_over_none"), ratio_range(r, "full_over_none"),
                             f"{r['light_step_records_us']:.1f} µs, {r['light_step_records_fraction_of_step'] * 100:.2f}%"
                             if "light_step_records_us" in r.data else "—", goals(r)] for r in levels]))
    if on_off:
        parts.append(("Tracing off and on, before the detail levels:\n\n" if levels else "") + table(
            ["CPU", "tracing off tok/s", "on tok/s", "on / off", "disabled scope", "scopes a step",
             "disabled cost a step"],
            [[r.cls, f(r["tracing_off_tok_s"]), f(r["tracing_on_tok_s"]), x(r["on_over_off"], 3),
              f"{r['disabled_scope_ns']:.0f} ns", str(r["scopes_per_step"]),
              f"{r['disabled_cost_fraction_of_step'] * 100:.3f}%"] for r in on_off]))
    return section("trace: the cost of tracing", TEXT["trace"], found, "\n\n".join(parts), BOUNDS["trace"])


def sec_router() -> str:
    title = "router: the cost of one routing decision"
    found = reports("router-*.json")
    if not found:
        return unmeasured(title, TEXT["router"], "tokentop bench router --out docs/bench/router-CLASS.json")
    parts = []
    for r in found:
        rows = [[str(row["workers"]), row["policy"], *(f(row[part]["median_us"]) for part in ("loads", "reuse", "choose")),
                 f"**{f(row['total']['median_us'])}** / {f(row['total']['p99_us'])}",
                 "yes" if row["meets_goal"] else "**no**"] for row in r["rows"]]
        parts.append(f"{r.cls}: {r['rows'][0]['queued']:,} requests queued, {r['published_keys_per_worker']:,} "
                     f"published keys a worker, {r['prompt_tokens']}-token prompt; the least disturbed run "
                     f"of {r['runs']}, {r['decisions_per_run']} decisions each (1-minute load "
                     f"{r['cpu_load_1min']:.1f}).\n\n" + table(
                         ["workers", "policy", "loads µs", "reuse µs", "choose µs", "total µs, median / p99",
                          f"median ≤ {r['goal_ms_per_decision']:g} ms"], rows))
    return section(title, TEXT["router"], found, "\n\n".join(parts))


def sec_record() -> str:
    title = "record: the size of a recording"
    found = reports("record-*.json")
    if not found:
        return unmeasured(title, TEXT["record"], "tokentop bench record --out docs/bench/record-CLASS.json")
    body = table(["CPU", "recorded s", "requests (finished)", "frames", "bytes a frame", "bytes a minute",
                  "uncompressed a minute", "goal"],
                 [[r.cls, f(r["seconds"], 0), f"{r['requests']} ({r['requests_finished']})", f"{r['frames']:,}",
                   f"{r['bytes_per_frame']:,}", f"**{r['bytes_per_minute']:,}**", f"{r['uncompressed_bytes_per_minute']:,}",
                   goals(r)] for r in found])
    return section(title, TEXT["record"], found, body)


def since(event: dict, key: str) -> str:
    """Seconds from a soak's disruption to a later moment of it; — if that moment never came."""
    return "—" if event.get(key) is None or event.get("at_s") is None else f(event[key] - event["at_s"])


def most_grown(rss: dict) -> str:
    """The process whose memory grew most after its warm-up, by how much."""
    judged = {re.sub(r" \(pid \d+\)$", "", name): g["growth_pct"] for name, g in rss.get("processes", {}).items()
              if g.get("judged") and g.get("growth_pct") is not None}
    if not judged:
        return "not judged"
    name = max(judged, key=judged.get)
    return f"{judged[name]:+.2f}% ({name})"


def soak_row(r: Report) -> list[str]:
    c, e = r["requests"]["client"], r["requests"]["engine"]
    kill, restart = r["events"].get("worker_kill", {}), r["events"].get("remote_restart", {})
    kv = r["verdicts"].get("kv_pages", {})
    held = sum(max(w["pages_held"], w["pages_used"]) for w in kv.get("workers", {}).values())
    remote = kv.get("remote_server_pages_used")
    return [r.cls, num(r["minutes"]), f"{c['submitted']:,}",
            " / ".join(f"{c[k]:,}" for k in ("finished", "aborted", "failed", "disconnected")),
            f"{c['failed_by_disruption']} / {c['failed_unexpected']}",
            f"{c['lost']}, {c['doubled'] + c['streamed_after_finish']} / {e['unfinished']}, {e['finished_twice']}",
            most_grown(r["verdicts"].get("rss", {})),
            f"{held}, remote {'—' if remote is None else remote}",
            since(kill, "ready_again_at_s"), since(restart, "readmitted_at_s"),
            goals(r) + (f"; **{r['error']}**" if r.data.get("error") else "")]


def sec_soak() -> str:
    title = "soak: mixed load, a worker killed, the remote restarted"
    found = reports("soak-*.json")
    if not found:
        return unmeasured(title, TEXT["soak"], "tokentop bench soak --minutes N --out docs/bench/soak-CLASS.json")
    body = table(["CPU", "minutes", "requests", "finished / aborted / failed / disconnected",
                  "failed: by a disruption / else", "lost, doubled: clients / engine", "RSS growth, most",
                  "KV pages held at idle", "respawn s", "remote re-admitted s", "goals"],
                 [soak_row(r) for r in found])
    return section(title, TEXT["soak"], found, body)


REPORT_FRAME = {"scenario", "command", "machine", "started", "seconds", "goals", "error"}


def numeric_fields(node, prefix: str = "") -> list[tuple[str, float]]:
    """(dotted name, value) of every number in a report of unknown shape, in its order."""
    out = []
    for key, value in node.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += numeric_fields(value, name + ".")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((name, value))
    return out


def sec_rows() -> str:
    title = "rows: a decode step by its row count"
    found = newest_per_class(reports("rows-*.json"))
    if not found:
        return unmeasured(title, TEXT["rows"], "tokentop bench rows --models qwen2.5-coder-0.5b,qwen2.5-coder-1.5b "
                                               "--out docs/bench/rows-CLASS.json")
    results = [(r, res) for r in found for res in r["results"] if "rows" in res]
    sizes = sorted({row["rows"] for _, res in results for row in res["rows"]})
    rows = []
    for r, res in results:
        by_n = {row["rows"]: row for row in res["rows"]}
        rows.append([r.cls, MODEL_SHORT.get(res["model"], res["model"]),
                     *(x(by_n[n]["vs_1_row"]) if n in by_n else "—" for n in sizes),
                     *(f"{100 * by_n[n]['read_share']:.0f}%" if by_n.get(n, {}).get("read_share") is not None
                       else "—" for n in (sizes[0], sizes[-1])),
                     f"{100 * by_n[sizes[-1]]['compute_share']:.0f}%"
                     if by_n.get(sizes[-1], {}).get("compute_share") is not None else "—"])
    body = table(["CPU", "model", *(f"{n} row{'s' if n > 1 else ''}" for n in sizes), f"read share, {sizes[0]} row",
                  f"read share, {sizes[-1]} rows", f"matmul-peak share, {sizes[-1]} rows"], rows)
    return section(title, TEXT["rows"], found, body, BOUNDS["rows"])


def sec_first_start() -> str:
    title = "first start: from the command to the first token"
    found = reports("first-start-*.json")
    if not found:
        return unmeasured(title, TEXT["first_start"], "tokentop bench first-start --out docs/bench/first-start-CLASS.json")
    values = [dict(numeric_fields({k: v for k, v in r.data.items() if k not in REPORT_FRAME})) for r in found]
    names = list(dict.fromkeys(name for v in values for name in v))
    body = table(["field", *(r.cls for r in found)],
                 [[f"`{name}`", *(num(v[name]) if name in v else "—" for v in values)] for name in names]
                 + [["goals", *(goals(r) for r in found)]])
    return section(title, TEXT["first_start"], found, body)


def gpu_argv(r: Report) -> str:
    argv = list(r["argv"])
    if "--out" in argv:
        i = argv.index("--out")
        del argv[i:i + 2]
    return "python3 " + " ".join(argv)


def sec_gpu() -> str:
    found = [Report(p) for p in sorted((BENCH / "gpu").glob("*.json"))]
    gpus = {g["name"] for r in found for g in r["sections"]["env"]["gpus"]}
    fidelity, speed = [], []
    for r in found:
        s = r["sections"]
        model = MODEL_SHORT[s["fidelity"]["model"]]
        for dtype, v in s["fidelity"]["dtypes"].items():
            near = v["mismatches"] - v["bad"]
            fidelity.append([model, dtype, f"{v['steps'] - v['mismatches']} / {v['steps']}"
                             + (f" ({near} more at a near-tie)" if near else ""), f(v["first_logit_diff"], 3),
                             "faithful" if v["faithful"] else "**not faithful**"])
        # one bench single (older reports), or one with CUDA graphs on and one with them off
        runs = ([("—", s["single"])] if "results" in s["single"] else
                [(mode, s["single"][f"graphs_{mode}"]) for mode in ("on", "off") if f"graphs_{mode}" in s["single"]])
        for graphs, data in runs:
            res = data["results"][0]
            if "error" not in res:
                speed.append([model, graphs, f(res["prefill_tok_s_median"], 0), f(res["decode_tok_s_median"])])
    body = ["Greedy ids teacher-forced against transformers' fp32 reference (as tests/test_fidelity.py), "
            "by activation dtype:\n",
            table(["model", "activations", "steps matching", "first-logit diff", "verdict"], fidelity), "",
            table(["model", "CUDA graphs", "prefill tok/s (500 tokens)", "decode tok/s, one stream"], speed)]
    for r in found:
        s = r["sections"]
        if "batching" in s and s["batching"].get("status") == "ok":
            b = s["batching"]
            kv = {k["n"]: k["paged_over_contiguous"] for k in b["paged_vs_contiguous"]}
            body.append("\n" + table(["N", "aggregate tok/s"], [[str(t["n"]), f(t["batched_tok_s"], 0)] for t in b["batching"]])
                        + f"\n\nN = 32 over one stream: **{x(b['aggregate_n32_over_n1'])}**; paged / contiguous K/V "
                          f"{x(kv[1])} at N = 1, {x(kv[8])} at N = 8.")
        if "step" in s and s["step"].get("status") == "ok":
            steps = ([("", s["step"])] if "wall_ms" in s["step"] else
                     [(f", CUDA graphs {mode}", s["step"][f"graphs_{mode}"]) for mode in ("off", "on")
                      if "wall_ms" in s["step"].get(f"graphs_{mode}", {})])
            for label, st in steps:
                gpu = (f", of which the GPU is busy {f(st['gpu_ms'], 2)} ms over {st['kernels']} kernel launches"
                       if "gpu_ms" in st else "")
                body.append(f"One decode step of one sequence ({st['context']}-token context{label}): {f(st['wall_ms'])} "
                            f"ms of wall time{gpu}.")
        if "graphs" in s and s["graphs"].get("status") == "ok":
            g = s["graphs"]
            rows = [[str(n), f(g["on"]["tok_s"][str(n)], 0), f(g["off"]["tok_s"][str(n)], 0),
                     x(g["on"]["tok_s"][str(n)] / g["off"]["tok_s"][str(n)])] for n in g["sizes"]]
            body.append(f"\nDecode through the engine, N concurrent requests of {g['output_tokens']} tokens:\n\n"
                        + table(["N", "CUDA graphs on, tok/s", "off, tok/s", "on / off"], rows))
        if "cpu_threads" in s and s["cpu_threads"].get("status") == "ok":
            c = s["cpu_threads"]
            rows = [[t, f(r["prefill_tok_s"], 0), f(r["decode_tok_s"]), f(r["n8_tok_s"], 0)]
                    for t, r in c["threads"].items()]
            body.append(f"\nThe GPU machine's CPU worker by --threads ({c['prompt_tokens']}-token prefill, "
                        f"{c['decode_tokens']}-token one-stream decode, 8 requests of {c['n8_tokens_each']} tokens):\n\n"
                        + table(["threads", "prefill tok/s", "decode tok/s", "N = 8 tok/s"], rows))
        if "routing" in s and s["routing"].get("status") == "ok":
            body.append(f"Routing over the machine's CPU and the GPU ({len(s['routing']['devices'])} workers): "
                        f"{workers(s['routing'])}.\n\n{routing_table(s['routing'])}")
    cmds = "\n".join(f"* {r.link}: `{gpu_argv(r)}`" for r in found)
    text = TEXT["gpu"] + f"\n\n{cmds}\n"
    return f"## GPU: {', '.join(sorted(gpus))}\n\n{text}\n" + "\n".join(body) + f"\n\n{BOUNDS['gpu']}\n"


# what the commonest refusals end with: what to do, the same for many causes
REMEDIES = ("; re-download or re-assemble the model file", ": pass a .gguf model file, e.g. one converted with llama.cpp")
REFUSALS_SHOWN = 3


def without_remedy(message: str) -> str:
    for remedy in REMEDIES:
        message = message.removesuffix(remedy)
    return message


def fuzz_table(run: dict) -> str:
    """One run: per fuzz test its examples and outcomes, and the run's commonest refusals with
    how often each test met them."""
    tests = run["report"]
    total: Counter = Counter()
    for t in tests.values():
        total.update(t["refusals"])
    rows = [["examples", *(f"{t['examples']:,}" for t in tests.values())],
            ["outcomes", *(", ".join(f"{k} {v:,}" for k, v in t["outcomes"].items()) for t in tests.values())],
            ["kinds of refusal", *(str(len(t["refusals"])) for t in tests.values())]]
    rows += [[without_remedy(message).replace("|", "\\|"), *(f"{t['refusals'].get(message, 0):,}" for t in tests.values())]
             for message, _ in total.most_common(REFUSALS_SHOWN)]
    return table(["", *(name.split(":")[0] for name in tests)], rows)


def sec_fuzz() -> str:
    found = reports("fuzz-*.json")
    parts = [f"{r.cls}, {run['name']} ({r.link}): `{run['command']}`\n\n{fuzz_table(run)}"
             for r in found for run in r["runs"]]
    return "## fuzz: corrupted model files and hostile requests\n\n" + TEXT["fuzz"] + "\n\n" + \
        "\n\n".join(parts) + "\n\n" + TEXT["openapi_fuzz"] + "\n"


def sec_reports() -> str:
    found = [Report(p) for p in sorted(BENCH.rglob("*.json"))]
    rows = []
    for r in found:
        m = r.machine
        cls = f"GPU machine's host ({m.get('cpu_model') or '—'})" if "sections" in r.data else r.cls
        rows.append([r.link, cls, m.get("cpu_family_model") or "—", isa_summary(m.get("isa") or [])])
    return ("## The reports\n\n" + TEXT["reports"] + "\n\n" +
            table(["report", "CPU class", "cpuid family/model", "ISA"], rows) + "\n")


def headline() -> str:
    """The README's table: tokentop against llama.cpp and llama-server on one CPU class."""
    cls = HEADLINE_CPU
    single = next(r for r in reports("single-*.json") if r.cls == cls)
    server = next(r for r in reports("batching-llama-server-*.json") if r.cls == cls)
    rows = []
    for model, row in single_rows(single).items():
        ref = row["llama_cpp"]
        name = MODEL_SHORT[model]
        rows += [[f"{name} prefill, 500-token prompt", f"{f(row['prefill_tok_s_median'], 0)} tok/s",
                  f"{f(ref['prefill_tok_s_median'], 0)} tok/s", f"**{x(row['prefill_ratio'])}**"],
                 [f"{name} decode, one stream", f"{f(row['decode_tok_s_median'])} tok/s",
                  f"{f(ref['decode_tok_s_median'])} tok/s", f"**{x(row['decode_ratio'])}**"],
                 [f"{name} peak RSS", f"{f(row['peak_rss_mb'], 0)} MB", f"{f(ref['peak_rss_mb'], 0)} MB",
                  x(row["rss_ratio"])]]
    eight = next(t for t in server["llama_server"]["table"] if t["n"] == 8)
    rows.append(["0.5B, 8 concurrent requests over HTTP", f"{f(eight['tokentop_tok_s'])} tok/s",
                 f"{f(eight['llama_server_tok_s'])} tok/s (`-np 8`)", f"**{x(eight['tokentop_over_llama_server'])}**"])
    m = single.machine
    return (f"{cls} (AMD EPYC, cpuid {m['cpu_family_model']}, {isa_summary(m['isa'])}), 2 cores, 2 threads; "
            f"llama.cpp / llama-server measured side by side in the same run, same GGUF file:\n\n" +
            table(["", "tokentop", "llama.cpp", "ratio"], rows))


HEADLINE_CPU = "Zen 5"


def join(parts: list[str]) -> str:
    return "\n".join(p.rstrip("\n") + "\n" for p in parts)


def render() -> str:
    """docs/benchmarks.md."""
    return join([TEXT["intro"], "## Headline\n\n" + headline() + "\n", sec_single(), sec_batching(),
                 sec_llama_server(), sec_routing(), sec_router(), sec_prefix(), sec_spec(), sec_seeds(), sec_serve(),
                 sec_dashboard(), sec_trace(), sec_record(), sec_soak(), sec_first_start(), sec_rows(), sec_gpu(), sec_fuzz(),
                 sec_reports()])


def render_kernels() -> str:
    """docs/kernels.md: text only, no report backs it."""
    return join([TEXT["kernels_intro"], TEXT["kernels"], TEXT["defaults"]])


def pages() -> dict[Path, str]:
    return {PAGE: render(), KERNELS_PAGE: render_kernels()}


# --- the hand-written text -------------------------------------------------------------------
TEXT = {
    "intro": """\
# Benchmarks

<!-- Generated by `python tools/bench_tables.py` from the reports in docs/bench/: edit the tool, not this page. -->

The figures come from the reports in `docs/bench/`, each written by the command shown with it;
what chose the kernels' forms and the defaults (no report backs it): [kernels.md](kernels.md).
The CPUs are 2-core shared VMs (torch 2.13.0+cpu, 2 threads): AMD EPYC Zen 3 (cpuid family 25
model 1, AVX2 only), Zen 4 (25/17, AVX-512 without AVX-VNNI), Zen 5 (26/2, AVX-512 with
AVX-VNNI), and Intel Emerald Rapids (6/207, AVX-512 with VNNI; AMX where the VM shows it, which
the kernels do not use); each benchmark keeps its latest report per class.

Comparisons run their sides interleaved (fresh processes) and quote the median of the pairs'
ratios: memory bandwidth swings up to 1.5× over minutes, absolute rates ±10–20%.
llama.cpp: llama-cpp-python 0.3.36 and its llama-server, built with the GGML flags of the
machine's ISA, 2 threads, same GGUF file.""",
    "single": """\
Prefill tok/s of a 500-token prompt, decode tok/s of 128 greedy tokens (medians) and peak RSS, per
model; `--llama-cpp` runs llama.cpp on the same protocol in its own process, alternating run by
run; ratios are the medians of the pairs' (tokentop / llama.cpp; RSS: lower is better).""",
    "batching": """\
N concurrent requests (24-token prompts, 128 greedy tokens, the 0.5B) in one engine, in process:
aggregate tok/s, N = 8 over one stream, the burst against the same requests one after another
(where measured), and paged against contiguous K/V (512-token context, ABBA). Each CPU's newest
run, with or without `--llama-server`.""",
    "llama_server": """\
The same burst through both servers over HTTP, one client for both: N concurrent non-streaming
`/v1/completions` (token-id prompts, temperature 0, `ignore_eos`, 128 tokens, checked from
`usage`). tokentop: `tokentop serve`, worker in its own process, `--threads 2 --max-active 8`;
llama.cpp: `llama-server -m MODEL.gguf -np 8 -c 8192 -t 2`.""",
    "routing": """\
A burst of 8 and 48 requests 50 ms apart (516-token prompts sharing 512, 128 output tokens, at
most 4 active per worker) over unequal workers: `forced-fastest` sends all to the fastest worker,
`cost` routes by the workers' measured rates and queues. Workers: a real CPU worker and a simulated
GPU (`sim:gpu0`, a timed wait at mini-vllm-rs's published Metal rates).""",
    "prefix": """\
Prefix caching, 0.5B (512 tokens a step, chunked prefill, ≤ 8 running): warm against cold; bursts
of identical prompts and of questions on one document under the four sharing modes, interleaved
run by run; a cyclic working set larger than the cache; greedy output with the cache on and off.""",
    "spec": """\
Speculative decoding on the CPU, one request at a time: decode tok/s = (output − 1) / (e2e − TTFT),
so a draft model's catch-up on the prompt counts; acceptance = accepted / drafted, length = tokens
a verify step. `draft`: the 0.5B drafts; `mentored`: its distribution within a total-variation
budget D; `ngram`: proposals from the context.""",
    "seeds": """\
mini-vllm-rs's experiments as burst files (sample_prompts/README.md), each run by `tokentop
compare` under two settings (a fresh engine a side, the 0.5B on one CPU worker unless said),
bundled with their commands (`tools/bench_tables.py --bundle`); theirs as published.""",
    "seeds_single_flight": """\
Single flight: N identical 529-token greedy requests at once, 128 tokens; mean TTFT, followers
released when the leader completes against after its prefill.""",
    "seeds_routing": """\
Routing: the CPU worker and `sim:gpu0` (mini-vllm-rs's Metal rates), both warmed with the 512-token
note (`--warm`), 520-token prompts 50 ms apart, 128 tokens, ≤ 4 active per worker; every request
to the GPU (`worker=1`) against `router-policy=cost`; completion of the burst, aggregate tok/s.""",
    "seeds_spec": """\
Speculation, the 1.5B as target: decode tok/s = (output − 1) / (e2e − TTFT), median over the
burst's requests, each mode against an off side of its own run; `spec_code_edit` greedy (as
theirs), `spec_creative` three requests at once sampled at 0.7 (theirs: greedy, one request).""",
    "seeds_rounds": """\
Alternated A/B (`--rounds N`): A B, B A, ..., a fresh engine a run (`--warm`: fired once first,
not measured); B/A is the median of the rounds' own ratios (rounds spread ±20%); greedy
outputs compared each round.""",
    "serve": """\
8 concurrent streams of 64 tokens (0.5B) through one engine, measured by the client: in process
(`engine.submit`, async iteration) against `tokentop serve`'s HTTP API (streamed over loopback),
runs alternating.""",
    "dashboard": """\
The same 8-request burst (64 tokens) headless and with the dashboard open (200×60, headless
Textual; timeline and charts shown since chart ms), runs alternating; one frame (snapshot to
screen) with 200 requests live on a simulated worker, median ms, table / timeline; goal ≤ 25 ms
(bold: over); one history chart redrawn (4 series × 900 points, 100×30), median ms.""",
    "trace": """\
A 4-request burst with no recording, the light ring (default) and full detail (per-layer scopes),
rounds A B C C B A from each of the six orders; ratios to off: the rounds' median (lowest–highest).
Goals: light ≤ 1%, full ≤ 10% off.""",
    "router": """\
One routing decision as `Engine.submit` makes it under the facade's lock: each worker's load (a
running account), the reusable prefix per worker (the prompt's pages against its published keys),
`Router.choose`; N simulated workers, never started, 1,000 requests queued; median and p99 µs of
each part. Goal: ≤ 1 ms at 256 workers.""",
    "record": """\
A `--record` file's growth: a 16-request burst on two simulated workers, 5 frames a second for a
minute; bytes per frame and per minute, as written (gzip) and uncompressed. Goal: ≤ 1 MB a minute.""",
    "soak": """\
N minutes of mixed load (HTTP streams and whole answers, some left early; bursts in process, some
aborted) over two local worker processes and a remote `tokentop serve`, simulated; a local worker
SIGKILLed at a third, the remote restarted at two thirds. Once idle: requests by outcome, lost and
doubled (both ledgers), the most RSS grew after warm-up, KV pages held, seconds from each
disruption to serving again. Goals: RSS within 5%, nothing held, lost or doubled, both back.""",
    "rows": """\
A decode step's time by its rows (N requests decoding together), against one row: one row is
bound by the weights' read (its share of the read bandwidth measured in the same run), many rows
by the arithmetic (the share of a float32 matmul peak measured in the same run).""",
    "first_start": """\
A first start: the seconds to each stage the report records (model assembled, worker ready, first
token, kernels switched in for the torch matmuls), every number under its own name.""",
    "fuzz": """\
The suite's seeded fuzzers. `tests/test_gguf_fuzz.py` (Hypothesis) corrupts the headers of tiny
random models and of the real 0.5B: each loads or is refused in one line naming the file, within
10 s and 1 GiB; a tiny model that loads runs a step. Per run: outcomes, the 3 commonest refusals
(particulars blanked, the remedy left off: "re-download or re-assemble the model file" and the
like).""",
    "openapi_fuzz": """\
`tests/test_openapi_fuzz.py` (schemathesis, every operation of the served schema): seed 37, 30
examples each (the default), 887 requests; seed 1, 300 examples, 1,697 requests; 0 failures, no
5xx, 0 KV pages in use after each request.""",
    "gpu": """\
`tools/gpu_check.py` on a lent GPU machine (docs/gpu_check.md): fidelity per activation dtype,
bench single and batching, the decode step's launch profile, the kernel choice and routing over
its CPU and GPU; the 1.5B (a file too large to travel whole) ran only fidelity and bench single.""",
    "kernels_intro": """\
# Kernels and defaults

<!-- Generated by `python tools/bench_tables.py`: edit the tool, not this page. -->

The measurements that chose the kernels' forms and the defaults, each with the tool that took it
where one is kept; no report backs them. The benchmarks and their reports:
[benchmarks.md](benchmarks.md).""",
    "kernels": """\
## kernels: why each form

Each form of the kernels and fused ops, what it was measured against, on which CPU (Zen 3 =
cpuid 25/1, Zen 5 = 26/2, Emerald Rapids = 6/207; "AVX2 on Zen 5": the AVX2 build forced by `TOKENTOP_KERNEL_ISA=avx2`),
and the tool that measures it; no report backs them.

* **One call per decode step, one weight row at a time.** All layers of a decode step in one C++
  call against ten op calls a layer from Python: the forward 1.05-1.07× faster. Direct kernels
  reading one output row at a time against four side by side: the 1.5B's linear layers at 1 row
  26.4 → 22.0 ms. The top-32 logit refinement in C++, not numpy: 0.60 → 0.39 ms a step at 8 rows
  (0.5B). Zen 5; `tools/kernel_ab.py MODEL A,B 1,4 4`. Its candidates in C++ too
  (`top_candidates`: chunk maxima read once, in vectors) against torch's chunk maxima and topk: 360 →
  123 µs at 8 rows, 58 → 22 at 1 (Emerald Rapids).
* **Panels built straight from the GGUF blocks.** Tiles of 16 rows' bytes at one block offset,
  transposed by 32-bit words, against unpacking each row and a 16×16 transpose: the 0.5B's linear
  layers at 8 rows 22.5 → 15.0 ms. The panels then win from 5 rows, the direct kernels up to 4
  (AVX2; on AVX-512 see the next entry). Zen 5; `tools/kernel_bench.py MODEL 2`.
* **K-quants packed for the panels.** On AVX-512, Q4_K / Q5_K / Q6_K matrices are packed once at
  load in the panels' tile order, codes at their GGUF width (then 0.59 bytes a Q4_K weight against
  0.56), and calls of 2-32 rows read them there; building the tiles from the blocks at every call
  cost more than reading them. A panel's two tiles take turns in each step, so 8 activation rows
  share one read of the weights. The built panels' float steps, the same bits. The 1.5B's linear layers with the packed copies
  against without (direct kernels up to 4 rows, built panels above): 0.98× at 2 rows, 0.66-0.73×
  at 4, 0.55-0.62× at 8, 0.76-0.82× at 16, 0.90-1.02× at 32; the 0.5B (mostly Q5_0 / Q8_0) 0.79×
  at 4, 0.87× at 8. At 64 and 500 rows, unpacking the copy for the built panels' loop was 1.13×
  slower than building from the blocks, so prefill builds as before. Emerald Rapids;
  `tools/kernel_bench.py MODEL 2 --packed-ab`, the two alternated in one process. With a pointer
  per activation row for the scales and the tile loop rolled, the 8-row dot kept its 16
  accumulators on the stack; both tiles unrolled and each 8-row block's scales, sums and integer
  starts interleaved (one pointer, fixed offsets) made the 1.5B's linear layers at 8 rows
  1.05-1.17× faster (0.5B 1.03×), the same bits; `tools/kernel_ab.py MODEL A,B 1,4,8 6`.
* **K-quants packed for one row.** The packed K-quant dot took the built panels' float step per
  32 weights (cvt, mul, fma, fnma and two broadcasts per output vector and row). Now, as in
  llama.cpp's Q8_K kernels, the activations are quantized per 256, each group's `vpdpbusd` sum is
  multiplied by its scale as an integer (`vpmulld`), the minimums (Q6_K: the offset 32) are one
  `vpdpwssd` per 2 groups against the groups' sums, and a super-block ends in one float step. The
  copy keeps the file's fp16 d / dmin and 12 scale bytes (the GGUF size, was 5.5% more), so
  one-row K-quant calls read it too: the direct kernel is bound by its unpacking (one thread, from
  cache, an 8960×1536 Q4_K matrix: 17 GB/s one row against 47 packed; 8 rows 2.39 → 2.73 G
  `vpdpbusd`/s, of 3.66 at most). Streaming from memory the copies need 2 MiB pages: they are
  carved from 64 MiB slabs aligned to 2 MiB and advised `MADV_HUGEPAGE` (each copy padded to 2 MiB
  instead held the 0.5B 0.24 GB more; advising only each copy's whole 2 MiB ranges ran the 1.5B's
  layers 0.83-0.98× as fast); with transparent huge pages off, one-row calls keep the direct kernel. The 1.5B's linear layers, the previous head (float steps, copies in 4
  KiB pages, one-row K-quants direct) / this dot in 4 KiB pages / in 2 MiB pages: 32.9 / 36.3 /
  33.6 ms at 1 row, 36.5 / 34.9 / 32.4 at 2, 55.4 / 49.8 / 44.0 at 8 (6 rounds alternated). This
  head against the previous (8 rounds, ABBA): the 1.5B 0.99× at 1 row, 1.05× at 2, 1.09× at 4,
  1.23× at 8, 1.14× at 16; the 0.5B 1.03×, 1.08×, 1.19×, 1.26×, 1.13×. One row alternated in one
  process: while the plain read gave 38-41 GB/s the direct kernels read 32.7 and the copy 37.1
  (1.13×); at 27-30 both read about 30 (0.98×). Not the built panels' bits (prefill's);
  batch-invariant within themselves. Zen 4;
  `TOKENTOP_PACKED_PREFETCH=l2 tools/kernel_ab.py MODEL A,B[,C] 1,2,4,8,16 8`.
* **Fewer than 8 rows interleave only their own.** The packed dots read 8 activation rows
  interleaved by 4 bytes; a block of fewer rows (a one-row call: all of it) now interleaves only
  those, so one row reads K bytes of activations, not 8 K. Spread over 8 rows' slots, the 1.5B's
  down projection's (K = 8960, 72 KB) missed L1, and its one-row calls read the weights at
  20.4-21.3 GB/s against 26-27 for the other layers and a 28 GB/s plain read; after, 24.1-24.7.
  The linear layers: the 1.5B 1.045× faster at 1 row, 1.05× at 2, 1.07× at 4, 0.99× at 8 (6
  rounds), the 0.5B 1.045×, 1.045×, 1.01×, 1.01× (10 rounds); the decode step, the two ways
  alternated in one engine (8 rounds): the 1.5B 1.042× at 1 row (each of the 8 within 1.026-1.082), 1.043×
  at 2, 1.035× at 4; the 0.5B 1.078×, 1.090×, 1.017×. The same bits. Emerald Rapids;
  `TOKENTOP_PACKED_PREFETCH=l2 tools/kernel_ab.py MODEL A,B 1,2,4,8 6`.
* **Q4_0, Q5_0 and Q8_0 packed too.** The 32-weight block types in the same tile order, fp16
  scales as in the file (the GGUF size), read by calls of 2-32 rows, with the built panels' bits.
  Q5_0's direct kernel is bound by its bit work rather than by memory, so a one-row call of Q5_0
  matrices alone reads the packed copy too, and so does one of Q8_0 (the 0.5B's head and v):
  with it the 0.5B's linear layers at 1 row were 1.055× faster (10 rounds), its decode step
  1.057× (8 rounds alternated in one engine), on Emerald Rapids. The 0.5B's linear layers with the copies against
  without: 0.96× at 1 row, 0.81× at 2, 0.70× at 4, 0.71× at 8, 0.79× at 16. An AMX form of the packed dots (TDPBSUD on
  the code vectors stored as B tiles, the sums back through memory into the same float steps)
  measured 1.2-2× slower at 2-16 rows, the stores and tile loads costing more than the vpdpbusd
  they replace. Emerald Rapids; `tools/kernel_bench.py MODEL 2 --packed-ab`.
* **AVX2 panel kernel.** 8-row tiles, the float step shared by a tile's rows, against 16-row
  unpacked tiles: the 0.5B's linear layers at 8 rows 78.2 → 28.9 ms; against the direct kernels
  22.8 against 30.2 ms at 5 rows. AVX2 on Zen 5; `tools/kernel_ab.py MODEL A,B 8,64 3`.
* **Prefill: the AVX-512 panel kernel.** 32-row panels, 6 activation rows a block in registers,
  against the 16-row tiles: 556-647 against 200-364 GMAC/s at 512 rows; 3 tiles × 4 rows: no
  faster. Outputs ≥ 32 MiB come from a pool: as fresh mappings, the 1.5B's gate|up spent 13 of 34
  ms a call in page faults. Zen 5; `tools/kernel_bench.py MODEL 2 --prefill`.
* **Prefetch of the next panel, spread thin.** A few of its lines per row block and build step,
  against all over the first row block: the 0.5B's lm_head at 8 rows 0.87×, 0.87× again with a
  share in the build; the whole panel at once 1.2-1.5× slower, none 1.5-2.2×, into L2 1.06-1.15×.
  Zen 5; `tools/kernel_ab.py MODEL A,B 8 6 --op lm-head`.
* **The packed copies' prefetch level, measured per machine.** On Zen 4 the packed kernels'
  prefetches into L1 held the core's L1 miss buffers and the loads of the current panel waited:
  one-row Q5_0 calls read 13.7 GB/s on one thread against 19.4 into L2. The linear layers with
  the prefetches into L2 against L1 (8 rounds, ABBA): the 0.5B 1.12× faster at 1 row, 1.25× at 2,
  1.23× at 4, 1.09× at 8, 0.98× at 16; the 1.5B (its one-row calls are the direct kernels') 1.01×,
  1.24×, 1.28×, 1.04×, 0.98×. Since Zen 5's built panels measured the other way (above), the first
  load of a model on a machine times its 1- and 2-row layers both ways (8 rounds alternated) and
  keeps L2 when the rounds' median ratio is below 0.99 (cached; `TOKENTOP_PACKED_PREFETCH=l1|l2`
  by hand), for calls of up to 8 rows (on Emerald Rapids L2 made the 0.5B's decode step 1.03×
  faster at 1 and 2 rows, 1.04× at 8): at 16 and 32
  rows L2 measured 0.96-1.00×, so those keep L1. The level is a template argument picked once per
  call: picked inside the loops it cost the 1.5B's 8-row calls 3-40%. Zen 4;
  `TOKENTOP_PACKED_PREFETCH=l2 tools/kernel_ab.py MODEL A,B 1,2,4,8,16 8`.
* **Two tiles per broadcast with AVX-VNNI.** `vpdpbusd` issues 1.57 a cycle when two share a
  broadcast operand, 1.31 when not (`tools/dpbusd_rate.cpp`): two tiles at once took the 0.5B's
  linear layers at 8 rows 23.95 → 20.64 ms, the 1.5B's 67.9 → 56.0; the `maddubs` build 27.0 →
  31.1, so it keeps one. AVX2 on Zen 5; `tools/kernel_ab.py MODEL A,B 8,64 4`.
* **Threads take each other's rows.** Packed and direct calls hand out output rows as the threads
  come for them: each thread its static share front to back, a quarter of what is left at a time,
  then the back half of what another has left. Over a one-row 0.5B decode one of two threads was
  busy 12-38% longer than the other in the same kernels, from run to run, and the other spun at
  each call's end (14% of its samples in libgomp). The packed activations are made once per call
  and type, and a packed range prefetches the panel past its end, where the thread's next chunk
  goes on (without, the chunks cost 5-12%). The static split against this, alternated in one
  process: the 0.5B's linear layers 1.04×, 1.07×, 1.05× faster at 1, 2, 8 rows, the 1.5B's 1.01×,
  1.00×, 1.01×; whole decode steps 1.02× at 1 and 8 rows (0.5B), 1.02× and 1.27× (1.5B, a slow
  thread in the static runs). Panels built from the blocks (prefill, AVX2) keep the static split:
  chunked, 64- and 500-row calls ran 1.04× and 1.02× slower, AVX2 8-row calls 1.08×. Zen 4.
* **Scores W keys at a time.** Over fp32 K/V (the default store) the decode attention dots W keys
  with one head at a time and reduces the W sums together (`hsum_lanes`: the same pairs of lanes
  as one `hsum`, so the same bits, 3W - 3 shuffles and adds for W scores), where each score took
  its own reduction, as many operations as its dot. Against that, alternated in one process on 2
  threads: head size 64 (the 0.5B) 1.04-1.14× faster at 1 row, 1.11× and 1.22× at 8 rows over 90
  and 500 positions; head size 128 (the 1.5B) 1.01-1.03×, bound elsewhere. 16-bit stores keep KB
  keys with all heads at once: converted per head, their rows made fp16 1.6-2× and bf16 1.2-1.5×
  slower. Zen 4.
* **Per-thread activation buffers.** The op's activation buffers are the calling thread's, never
  cleared, against zeroed vectors each call: an 8-row call on 32 output rows 7.85 → 7.35 µs
  (K = 896). Zen 5.
* **Q8_0 row lanes.** Without AVX-VNNI, Q8_0 at 7-8 rows puts activation row m in lane m and
  broadcasts each weight row's codes from its blocks, no tile build: the 0.5B's lm_head 1.12×
  faster at 8 rows, 1.05× at 7. Zen 3 (forced on Zen 5: 0.80×); `tools/kernel_ab.py MODEL A,B 7,8 8
  --op lm-head`.
* **Vector width per instruction set.** The fused ops' vector loops are built in 8-float vectors
  for AVX2 and 16-float ones for AVX-512 (`vec_math.h` `TT_BY_WIDTH`). On AVX2 GCC lowers a
  16-float vector's compares, selects and int conversions through memory: a 151936-logit exp-sum
  0.58 ms in 16 lanes against 0.135 in 2 × 8, greedy_pick 2.44 → 0.67 ms at 8 rows, the silu 17 →
  5.8 µs (Zen 3); the decode attention's 16-float blocks ran 5× slower than plain loops (AVX2 on
  Zen 5). On AVX-512 the 8-float form is the slow one: the exp-sum 0.128 ms against 0.044 in 16
  lanes, greedy_pick 633 → 245 µs at 8 rows, the silu product 25 → 11 µs (Emerald Rapids).
  `tools/fused_vector_width.cpp` times both widths on the CPU it runs on.
* **Framework overhead: fused per-layer ops.** Four fused C++ ops a layer against ~40 small torch
  ops: the 0.5B's overhead 4.78 → 1.65 ms a step (`tokentop bench single`'s
  `framework_overhead_ms_per_step`); `torch.compile` of a layer: 15.9 ms a call against 0.31. Zen 5.""",
    "defaults": """\
## Measurements behind defaults

Figures that decided a default, measured by scripts not kept: no report backs them.

* **KV dtype.** `--kv-dtype auto` is fp32 on every device. Teacher-forced over the fidelity
  prompts, fp16 K/V moves Gemma 3 270M off the reference at a step that is not a near-tie (top-2
  gap 0.263 > 0.25), bf16 its logits by up to 2.3; on the Qwen models fp16 changes no argmax
  (`tests/test_fidelity.py`). Neither is faster at ≤ 2,000 positions, and the CPU store is resident
  only where written; `--kv-dtype fp16` doubles the positions that fit. 16-bit rows are read by
  exact branch-free conversions that vectorize: through c10's, the 1.5B decoded over fp16 K/V at
  0.49× fp32's speed at 500 positions, 0.21× at 2,000 (now 0.98×, 0.88×; Zen 5).
* **2 MiB pages for the weights** (`engine/models/huge_pages.py`): the 1.5B decode step 1.022×
  faster (median of 12 alternations against the same file cached in 4 KiB pages, Zen 5).
* **One OpenMP team per core.** A decoder loaded on one thread and stepped on another, or two CPU
  workers on the same cores, give libgomp more threads than CPUs: the 1.5B step 27.5 against 19.0
  ms; two 0.5B workers on 2 cores 92-95 tok/s together against 248-295 with the cores split (Zen 5).
  So one thread drives a worker and CPU workers split the cores.""",
    "reports": """\
CPU class: from cpuid family/model where recorded, else the ISA. A CPU report that records no
kernel build (its `machine.quantized_kernels`) ran an earlier engine: its absolute rates are not
today's.""",
}

BOUNDS = {
    "rows": """\
What bounds them: one row, the weights' read: 26.1 and 28.5 GB/s (0.5B, 1.5B) on Zen 4 against a
plain read of 32.2 and 43.2 beside; 22.9 and 25.3 on Emerald Rapids against 26.6 and 25.3
(the ceiling swings up to 1.5× in an hour). On AVX-512 every matrix type is packed at load
in the panels' tile order and calls of 1-32 rows read the copies: 2 rows cost 0.91-1.08× one row;
from 8 rows the integer dots bound it (1.40-1.54×). The 1.5B's 8-row step on Zen 4 (a
full-detail trace, 57.8 ms; 38.2 at one row): gate|up 20.3 ms (13.2), down 13.1 (10.0), lm_head
7.3 (5.6), attention 3.5 (0.8: fp32 K/V read from memory). The AVX2 kernels (forced on the
same CPU) have no packed copies; their `vpmaddubsw` dots bound every call from 4 rows (60-97 G
multiply-adds a second on 2 cores): 8 rows cost 2.4× (0.5B) and 3.6× (1.5B).""",

    "single": """\
What bounds them: decode reads every weight once a step (0.5B ~0.39 GB, 1.5B ~1.0 GB), bound by
memory: on Zen 5 the 0.5B step reads 32 GB/s against a 41-45 GB/s plain 2-thread read, the
framework around the kernels within the timings' spread (`framework_overhead_ms_per_step`). On
Zen 3 the Q5_0 direct kernel is bound by its bit work (10 GB/s; Q8_0 and Q4_K 17). On Emerald
Rapids each run's read is set against the read ceiling measured just before and just after it
(`roofline.paired`; a share above 100%: the ceiling fell between the readings): the 0.5B reads
88% of it (runs 86-89%), the 1.5B 97% (runs 94-99%, and 70% in a run whose process ran slow,
decode 18.3 tok/s); the workers' live roofline reads within 1.2% of the run it follows
(`live_vs_run`). Against ik_llama.cpp (native build, run-time repack: `llama-bench -t 2 -n 0 -p 0
-gp 500,128 -r 2 -rtr 1`), alternated with `tokentop bench single --runs 3`, 2 rounds on an
Emerald Rapids (no AMX): the 0.5B 56.2-58.0 tok/s against 41.3-42.3 (1.36-1.37×), the 1.5B
25.0-25.4 against 15.8-17.1 (1.48-1.58×). On Zen 4 (an earlier build), 3 rounds: 0.5B
0.85-1.10×, 1.5B 0.85-1.14×, level within
the machine's swings. Prefill is
compute-bound (the panels). The memory on Emerald Rapids includes the packed copies of the
weights (0.4 GB for the 0.5B, 1.0 GB for the 1.5B; `TOKENTOP_PACKED=0` goes without them and their
speed-up of 2-32-row steps).""",
    "batching": """\
What bounds them: one stream is bound by memory, eight rows by the integer dot and the tile build
(`python tools/kernel_bench.py`): the 8-row forward takes ~1.8× the 1-row one on Zen 5, ~2.1× on
Zen 4 (512-bit operations in two halves). On Zen 3 the 8-row linear layers take 2.5-2.7× the 1-row
time (the `maddubs` dot at half of `vpmaddubsw`'s rate). Paging costs nothing measurable:
the model step reads paged and contiguous K/V at the same speed.""",
    "llama_server": """\
What bounds them: a tokentop step runs every active row through each linear layer in one call, so
the weights are read once a step for all streams and N = 8 is bound by the 8-row kernels;
llama-server's aggregate grows far less with N. At N = 1 the gap is single's decode ratio, less
the HTTP path.""",
    "routing": """\
What bounds them: this report's CPU worker (an earlier engine) decodes ~30× slower than the
simulated GPU, so `cost` gives it work only when the GPU's queue is long: completion within a few
per cent of `forced-fastest`. A real CPU and GPU: the GPU section.""",
    "prefix": """\
What bounds them: no request has its first token before one full prefill of its prompt (the
leader's 512 + 20 tokens), and a follower also computes the tokens past the last full shared page,
so for identical prompts at N = 8 the best mean is about −80%, which `after-prefill` reaches. On
the shared document every request needs its 800 tokens computed once first: `after-prefill` can
gain at most ~35% on `incremental`.""",
    "spec": """\
What bounds them: an 8-row step of the 1.5B costs about 1.5× a one-row step (rows, below), a
draft step half a target step, so 6 drafts and a verify cost ~4.5 target steps for up to 7 tokens.
On the sampled creative prompt a fixed k loses (acceptance 0.26-0.42), `adaptive:cost` not. The
repeated burst runs four requests at once outside `--deterministic`: its second run without
speculation (prefix hits, other row counts per step) may differ from the first at a near-tie, as
it did here.""",
    "seeds": """\
What bounds them: theirs ran on an M2 (GPU; its CPU for routing), ours on 2 Zen 4 cores, so the
changes compare, not the rates. Single flight: every first token waits for the leader's prefill
(~1 s here); at-completion adds the leader's 128 tokens, so the change tends to 1 − prefill /
(prefill + decode) as N grows. Routing: `sim:gpu0` holds its profiled rate with 4 rows (their M2
took 11.5 s for 8 requests, ours 3.6 s): the changes and offloads compare, not the seconds.
Speculation (Zen 4, an earlier engine): the draft cost the sampled creative prompt speed, as it
did theirs. Alternated (Emerald Rapids): a fresh engine's refactor explores a round, then
drafts; the creative three do not draft (a draft would hold the other two up); suffix on
refactors fired again reuses the first answers.""",
    "serve": """\
What bounds them: both clients drive the same engine, so throughput is the engine's; the HTTP path
adds request parsing, SSE framing and loopback per streamed token.""",
    "dashboard": """\
What bounds them: on 2 cores the UI thread takes CPU from the worker's 2 threads; with the
timeline and charts open the goal is missed (default panels, a run before: 0.94×).""",
    "trace": """\
What bounds them: light records a few events a step (timed alone: the column) and skips deep
scopes at one flag check each; full keeps the one-call decode step, timed inside it.""",
    "gpu": """\
What bounds them: a decode step is mostly host time (Python and kernel launches). CUDA graphs
(engine/worker/cuda_graphs.py) are the lever; no report with them yet. Routing: `cost`'s offload
to the CPU pays under load (48 requests), not at 8.""",
}


def bundle(runs: list[tuple[str, str, str, str]]) -> dict:
    """One kept report of several `tokentop compare` reports: compare records neither the machine
    nor its command line, so each run keeps its command and the report this machine's CPU."""
    sys.path.insert(0, str(ROOT))
    from engine.bench.common import machine
    experiments: dict[str, list[dict]] = {}
    for experiment, label, path, command in runs:
        report = json.loads(Path(path).read_text())
        experiments.setdefault(experiment, []).append({"label": label, "command": command, "report": report})
    return {"scenario": "compare-seeds", "command": "tokentop compare (one run per entry, its command kept with it)",
            "machine": machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "experiments": experiments}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, epilog=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only compare: exit 1 if the page is out of date")
    ap.add_argument("--bundle", metavar="OUT", help="instead: write one kept report OUT (e.g. docs/bench/"
                    "compare-seeds-zen4.json) of the --run compare reports, on the machine that ran them")
    ap.add_argument("--run", nargs=4, action="append", metavar=("EXPERIMENT", "LABEL", "REPORT", "COMMAND"),
                    help="with --bundle: a `tokentop compare` report, its experiment (single_flight, routing, "
                         "spec, rounds: one with --rounds N), a label and the command that wrote it")
    args = ap.parse_args()
    if args.bundle:
        Path(args.bundle).write_text(json.dumps(bundle([tuple(r) for r in args.run or ()]), indent=1,
                                                ensure_ascii=False) + "\n")
        return 0
    stale = 0
    for path, page in pages().items():
        if not args.check:
            path.write_text(page)
            print(f"wrote {path.relative_to(ROOT)} ({len(page.encode())} bytes)")
        elif not path.is_file() or path.read_text() != page:
            print(f"{path.relative_to(ROOT)} is out of date: run python tools/bench_tables.py", file=sys.stderr)
            stale += 1
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
