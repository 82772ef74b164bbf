"""`tokentop bench SCENARIO`: measured comparisons, JSON out (stdout, and --out FILE).

Each scenario compares its variants side by side in one run, interleaved, and reports
medians and ratios, together with the command line that produced them.
"""
from __future__ import annotations

import json
import platform
import sys
import time
from typing import Iterator

import torch


def run_bench(args, extra: dict | None = None) -> int:
    """Run `args.scenario`: one of engine/bench/scenarios.py, or of `extra` (name -> function),
    how the command line adds the scenarios that measure the dashboard."""
    from engine.bench import scenarios

    fn = (extra or {}).get(args.scenario) or getattr(scenarios, f"bench_{args.scenario.replace('-', '_')}")
    scenarios.TRACE_DIR = args.trace_dir
    started = time.time()
    report = fn(args)
    report = {
        "scenario": args.scenario,
        "command": command_line(sys.argv[1:]),
        "machine": machine(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        **report,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    # a part that could not run (an unknown model, a reference that failed) is in the report;
    # it also makes the command fail, with one line each, so a script cannot miss it
    failures = list(failed_parts(report))
    for where, error in failures:
        print(f"tokentop: error: bench {args.scenario}: {where}: {error}", file=sys.stderr)
    return 1 if failures else 0


def failed_parts(node, where: str = "report") -> Iterator[tuple[str, str]]:
    """(where, error) for every dict of the report with an "error": named by its "model" where it
    has one, else by its path."""
    if isinstance(node, dict):
        here = str(node.get("model") or where)
        if node.get("error"):
            yield here, str(node["error"])
        for key, value in node.items():
            if key != "error":
                yield from failed_parts(value, key if here == "report" else f"{here}.{key}")
    elif isinstance(node, list):
        for value in node:
            yield from failed_parts(value, where)


def command_line(argv: list[str]) -> str:
    """The command as a reader would retype it, without the path of the machine that ran it."""
    hidden = {"--llama-cpp": "PATH/TO/python", "--llama-server": "PATH/TO/llama-server"}
    words, hide = ["tokentop"], None
    for word in argv:
        flag = word.split("=", 1)[0]
        if hide:
            word, hide = hide, None
        elif word in hidden:
            hide = hidden[word]
        elif "=" in word and flag in hidden:
            word = f"{flag}={hidden[flag]}"
        words.append(word)
    return " ".join(words)


def machine() -> dict:
    """Every figure depends on the CPU: its model and instruction sets go in every report."""
    import os
    from engine.cpuinfo import cpu_info
    from engine import kernels
    info = cpu_info()
    isa = kernels.isa_name() if kernels.available() else None
    if isa == "avx2":   # its integer dots: AVX-VNNI where the CPU has it (TOKENTOP_AVX_VNNI=0: not)
        isa += " (dots: avx-vnni)" if torch.ops.tokentop.avx_vnni() else " (dots: maddubs)"
    return {"quantized_kernels": isa,
            "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "processor": platform.processor() or platform.machine(),
            "cpu_model": info["model"], "cpu_family_model": info["family"], "isa": info["isa"], "torch_cpu_capability": info["torch_capability"]}


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 5, threads: int | None = None) -> float:
    """GB/s of a plain read of nbytes (a float32 sum over `threads`, default torch's): the
    memory ceiling a decode step's weight reads compare with. On a shared machine it can swing
    over minutes (other tenants), so benchmarks take it next to each figure."""
    from engine.stats import median
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            buf.sum()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return nbytes / median(times) / 1e9


def peak_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_now_mb() -> dict:
    """This process's resident memory now, in MB: anonymous (heap, KV, torch) and file-backed
    (the mmap'd GGUF weights, shared libraries); {} where /proc is missing."""
    keys = {"VmRSS": "rss_mb", "RssAnon": "anon_mb", "RssFile": "file_mb"}
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in keys:
                    out[keys[key]] = round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return out
