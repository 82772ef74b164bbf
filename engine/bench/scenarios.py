"""The engine's own benchmarks. Every figure here is measured by running the engine; nothing is assumed.

single    prefill tok/s (500-token prompt) and one-stream decode tok/s (128 tokens), peak RSS,
          per model; with --llama-cpp also llama.cpp's, measured in the same run, and the ratios
batching  N concurrent requests vs the same requests one after another; paged vs contiguous;
          memory pressure: 8 x 1000 tokens on a simulated worker with 48 MiB vs 1 GiB of KV
          (preemptions and recomputed tokens)
routing   a paced burst over unequal simulated workers, policy by policy
trace     decode throughput with the flight recorder off, light and full
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import time
from dataclasses import replace

from engine.bench import common
from engine.bench.common import (base_worker, decode_burst_tok_s, peak_rss_mb, prompt_of, read_ceiling_gbs,
                                 rss_now_mb, start_engine, stop_engine, timed_burst)
from engine.bench.rows import decode_roofline
from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.dtypes import resolve_kv_dtype
from engine.errors import describe_error
from engine.pacing import paced
from engine.stats import median, percentile

# --- single ------------------------------------------------------------------------------
def _single_child(worker: WorkerConfig, runs: int, prompt_len: int, out_tokens: int, q,
                  overhead: bool = True) -> None:
    try:
        import torch
        torch.set_num_threads(worker.threads)
        engine = start_engine([worker])
        try:
            greedy = SamplingParams(max_tokens=8, ignore_eos=True)
            engine.generate(prompt_ids=prompt_of(engine, 64, "warm up "), params=greedy)
            prefill, decode = [], []
            for r in range(runs):
                res = engine.generate(prompt_ids=prompt_of(engine, prompt_len, f"run {r}: "),
                                      params=SamplingParams(max_tokens=1))
                prefill.append(prompt_len / res.metrics.ttft)
                res = engine.generate(prompt_ids=prompt_of(engine, 16, f"decode {r}: "),
                                      params=SamplingParams(max_tokens=out_tokens, ignore_eos=True))
                m = res.metrics
                decode.append((m.output_tokens - 1) / (m.e2e - m.ttft))
            live = _live_roofline(engine)
            rss, rss_end = peak_rss_mb(), rss_now_mb()
            from engine import kernels
            from engine.models.catalog import resolve_model
            extra = _framework_overhead(engine, str(resolve_model(worker.model)), worker) if overhead else {}
            q.put({"prefill_tok_s": prefill, "decode_tok_s": decode, "peak_rss_mb": rss,
                   "rss_after_runs": rss_end, "decode_step_ms": round(1000 / median(decode), 2), **extra,
                   "live_roofline": live,
                   "linear_kernels": kernels.describe()})
        finally:
            engine.shutdown()
    except Exception as exc:  # report, don't hang the parent
        q.put({"error": describe_error(exc)})


def _live_roofline(engine, wait_s: float = 1.0) -> dict | None:
    """The worker's own read GB/s over its last decode steps (its next stats report)."""
    deadline = time.monotonic() + wait_s
    while (live := engine.snapshot().workers[0].roofline) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return live


def _framework_overhead(engine, path: str, worker: WorkerConfig, pairs: int = 7, steps: int = 33) -> dict:
    """Step time minus the time of its linear layers, measured as pairs taken back to back:
    a decode of `steps` tokens through the engine (its mean step time), then every linear
    layer of one decode step (one row each, on the same GGUF file) timed in a helper process
    (median of 5). The reported overhead is the median of the pairs' differences: both halves
    of a pair run at the same moment, so a busy spell of the machine cannot land on one side
    only. The rest of a step is framework overhead: norms, rope, attention, sampling, the
    scheduler, Python.

    The linear layers are timed in their own process, on its main thread: torch work from a
    second thread of the engine's process would start a second OpenMP team, and with more
    OpenMP threads than cores libgomp barely spin-waits and every step slows down
    (docs/kernels.md, "Measurements behind defaults"): the measurement would move what it
    measures."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    helper = ctx.Process(target=_linears_helper, args=(path, worker, theirs), daemon=True)
    helper.start()
    try:
        if not ours.poll(600):
            raise RuntimeError("the linear-layer timing helper did not start")
        ours.recv()                       # ready, its first (untimed) pass done
        step, kernel, diff = [], [], []
        for r in range(pairs):
            res = engine.generate(prompt_ids=prompt_of(engine, 16, f"overhead {r}: "),
                                  params=SamplingParams(max_tokens=steps, ignore_eos=True))
            m = res.metrics
            step.append(1000 * (m.e2e - m.ttft) / (m.output_tokens - 1))
            ours.send("time")
            kernel.append(ours.recv())
            diff.append(step[-1] - kernel[-1])
        ours.send("stop")
    finally:
        helper.join(30)
        if helper.is_alive():
            helper.kill()
    return {"linear_kernels_ms_per_step": round(median(kernel), 2),
            "framework_overhead_ms_per_step": round(median(diff), 2),
            "framework_overhead": {"pairs": pairs, "decode_steps_per_pair": steps - 1,
                                   "step_ms": [round(x, 2) for x in step],
                                   "linear_kernels_ms": [round(x, 2) for x in kernel],
                                   "overhead_ms": [round(x, 2) for x in diff]}}


def _linears_helper(path: str, worker: WorkerConfig, conn, reps: int = 5) -> None:
    """Every linear layer of one decode step, timed on request (see _framework_overhead)."""
    import torch

    from engine.models.decoder import Decoder
    from engine.models.gguf import load_gguf
    from engine.models.quant import LinearPolicy, QuantLinear
    from engine.worker.runner import pick_activation_dtype

    torch.set_num_threads(worker.threads)
    policy = LinearPolicy(activation_dtype=pick_activation_dtype(worker.device, worker.activation_dtype),
                          deterministic=worker.deterministic)
    model = Decoder.from_gguf(load_gguf(path), policy)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    xs = [torch.randn(1, m.in_features) for m in linears]

    def linears_ms() -> float:
        times = []
        with torch.inference_mode():
            for _ in range(reps):
                t0 = time.perf_counter()
                for m, x in zip(linears, xs):
                    m(x)
                times.append(time.perf_counter() - t0)
        return 1000 * median(times)

    linears_ms()                          # first touch of the file's pages, untimed
    conn.send("ready")
    while conn.recv() == "time":
        conn.send(linears_ms())


def _llama_cpp(python: str, model: str, threads: int, runs: int, out_tokens: int) -> dict:
    """Run llama.cpp (llama-cpp-python under another interpreter) on the same GGUF file."""
    import json
    import subprocess
    from pathlib import Path

    from engine.models.catalog import resolve_model
    script = Path(__file__).with_name("llama_cpp_ref.py")
    out = subprocess.run([python, str(script), str(resolve_model(model)), str(threads), str(runs),
                          "500", str(out_tokens)], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _tokentop_single(worker: WorkerConfig, runs: int, out_tokens: int, overhead: bool) -> dict:
    """One bench-single child process (its own engine, so each round starts cold alike)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_single_child, args=(worker, runs, 500, out_tokens, q, overhead))
    p.start()
    res = q.get()
    p.join()
    return res


def merge_rounds(rounds: list[dict]) -> dict:
    """One result from several rounds' results: the runs' lists joined, the peak RSS the
    largest, everything else (overhead, kernels, RSS after the runs) from the last round."""
    merged = dict(rounds[-1])
    for key in ("prefill_tok_s", "decode_tok_s"):
        merged[key] = [v for r in rounds for v in r[key]]
    merged["peak_rss_mb"] = max(r["peak_rss_mb"] for r in rounds)
    if "decode_step_ms" in merged:
        merged["decode_step_ms"] = round(1000 / median(merged["decode_tok_s"]), 2)
    return merged


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """Median of the run-by-run ratios of two interleaved series: each pair ran within seconds
    of each other, so a slow spell of a shared machine (its read bandwidth can swing over
    minutes) lands on both sides of a pair instead of on one side of the comparison."""
    return median([a / b for a, b in zip(ours, theirs)])


def _compare_with_llama_cpp(row: dict, res: dict, refs: list[dict], reads: dict) -> dict:
    """llama.cpp's rounds merged into one result, and the ratios into `row`: medians of the
    rounds' ratios (see paired_ratio), the ratio of the medians beside them."""
    ref = refs[-1] if "error" in refs[-1] else merge_rounds(refs)
    if "error" in ref:
        return ref
    ref["source"] = ("measured in this run, interleaved with tokentop's runs (llama-cpp-python, "
                     "same GGUF file, same threads)")
    ref["prefill_tok_s_median"] = median(ref["prefill_tok_s"])
    ref["decode_tok_s_median"] = median(ref["decode_tok_s"])
    row["rss_ratio"] = round(res["peak_rss_mb"] / ref["peak_rss_mb"], 3)
    row["prefill_ratio"] = round(paired_ratio(res["prefill_tok_s"], ref["prefill_tok_s"]), 3)
    row["decode_ratio"] = round(paired_ratio(res["decode_tok_s"], ref["decode_tok_s"]), 3)
    row["decode_ratio_rounds"] = [round(a / b, 3) for a, b in zip(res["decode_tok_s"], ref["decode_tok_s"])]
    row["memory_read_gb_s"] = {**reads, "note": (
        "the read ceiling just before and just after each tokentop round (llama.cpp's round "
        "follows the second): memory bandwidth can swing over minutes on a shared machine, and "
        "a memory-bound decode swings with it")}
    row["ratio_of_medians"] = {"prefill": round(row["prefill_tok_s_median"] / ref["prefill_tok_s_median"], 3),
                               "decode": round(row["decode_tok_s_median"] / ref["decode_tok_s_median"], 3)}
    return ref


def bench_single(args) -> dict:
    """tokentop and llama.cpp alternate, one run each per round (ABAB...), each in a fresh
    process; the ratios are the medians of the rounds' ratios. The read ceiling is measured
    just before and just after each of tokentop's runs, so each run's read share has its own
    ceiling (the bandwidth of a shared machine swings over minutes)."""
    runs = 1 if args.quick else args.runs
    out_tokens = 32 if args.quick else 128
    rows = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        worker = base_worker(args, model=model)
        # GB/s just before and just after each tokentop run; llama.cpp's runs follow the
        # "after" reading
        reads = {"tokentop": [], "tokentop_after": []}
        ours, refs = [], []
        for r in range(runs):
            reads["tokentop"].append(round(read_ceiling_gbs(worker.threads), 1))
            ours.append(_tokentop_single(worker, 1, out_tokens, overhead=r == runs - 1))
            reads["tokentop_after"].append(round(read_ceiling_gbs(worker.threads), 1))
            if args.llama_cpp and "error" not in ours[-1]:
                refs.append(_llama_cpp(args.llama_cpp, model, worker.threads, 1, out_tokens))
            if "error" in ours[-1] or (refs and "error" in refs[-1]):
                break
        res = ours[-1] if "error" in ours[-1] else merge_rounds(ours)
        row = {"model": model, "device": worker.device, "threads": worker.threads,
               "activation_dtype": worker.activation_dtype,
               "kv_dtype": resolve_kv_dtype(worker.device, worker.kv_dtype),
               "kv_cache_memory_mib": worker.kv_cache_memory / 2**20,
               "kv_note": "the CPU store is resident only where written (after these runs: about "
                          "2,000 token positions); --kv-cache-memory caps it", **res}
        if "error" in res:
            rows.append(row)
            continue
        row["prefill_tok_s_median"] = median(res["prefill_tok_s"])
        row["decode_tok_s_median"] = median(res["decode_tok_s"])
        around = [(a + b) / 2 for a, b in zip(reads["tokentop"], reads["tokentop_after"])]
        row["roofline"] = decode_roofline(worker, row["decode_tok_s_median"], 16 + out_tokens // 2,
                                          row.pop("live_roofline", None), res["decode_tok_s"][-1],
                                          runs=list(zip(res["decode_tok_s"], around)))
        if args.llama_cpp and refs:
            row["llama_cpp"] = _compare_with_llama_cpp(row, res, refs, reads)
        rows.append(row)
    return {"prompt_tokens": 500, "output_tokens": out_tokens, "runs": runs, "results": rows}


# --- batching ----------------------------------------------------------------------------
PAIR_CONTEXT = 512   # tokens per sequence in bench batching's paged-vs-contiguous pair


def bench_batching(args) -> dict:
    """--sizes N,N,...: the concurrent request counts (each engine admits max(8, largest) at
    once); --no-sequential: only the batched aggregate (a GPU's N=32 one after another is long)."""
    runs = 1 if args.quick else args.runs
    out_tokens = 32 if args.quick else 128
    ns = [1, 2, 4, 8] if args.quick else [1, 2, 3, 4, 5, 8]
    if getattr(args, "sizes", None):
        ns = sorted({int(n) for n in args.sizes.split(",")} | {1, 8})
    sequential_too = not getattr(args, "no_sequential", False)
    active = max(8, *ns)
    table, runs_of = _batched_vs_sequential(args, ns, runs, out_tokens, active, sequential_too)
    one = next(t for t in table if t["n"] == 1)["batched_tok_s"]
    eight = next(t for t in table if t["n"] == 8)["batched_tok_s"]
    largest = table[-1]
    # N = 8 over one stream: the median of the rounds' ratios (each round ran both sizes)
    n8_over_n1 = paired_ratio(runs_of[8][0], runs_of[1][0])
    nmax_over_n1 = paired_ratio(runs_of[largest["n"]][0], runs_of[1][0])
    context = getattr(args, "max_context", None) or PAIR_CONTEXT
    kv, device = _paged_vs_contiguous(args, runs, out_tokens, active, context)
    pressure = [_memory_pressure(args, kv_memory) for kv_memory in ("48MiB", "1GiB")]
    side_by_side = None
    if getattr(args, "llama_server", None):
        from engine.bench.llama_server import bench_llama_server
        from engine.models.catalog import resolve_model
        side_by_side = bench_llama_server(args, base_worker(args, max_active=active), str(resolve_model(args.model)),
                                          out_tokens, runs, [1, 8])
    goals = {"paged_ge_97pct_contiguous": all(k["paged_over_contiguous"] >= 0.97 for k in kv)}
    if sequential_too:
        # from N = 2: one request alone is the same work either way (its ratio is noise around 1)
        goals["batched_ge_sequential_all_n"] = all(t["ratio"] >= 1.0 for t in table if t["n"] >= 2)
    if largest["n"] >= 32:
        goals[f"n{largest['n']}_at_least_10x_one_stream"] = nmax_over_n1 >= 10.0
    return {
        "output_tokens": out_tokens, "runs": runs, "model": args.model, "device": device,
        "batching": table, "aggregate_n8_over_n1": round(n8_over_n1, 3),
        f"aggregate_n{largest['n']}_over_n1": round(nmax_over_n1, 3),
        "aggregate_n8_over_n1_ratio_of_medians": round(eight / one, 3),
        "paged_vs_contiguous": kv, "paged_vs_contiguous_max_context": context, "memory_pressure": pressure,
        **({"llama_server": side_by_side} if side_by_side else {}),
        "goals": {**goals, **({"n8_ge_llama_server_n8": side_by_side["goals"]["n8_ge_llama_server_n8"]}
                              if side_by_side else {})},
    }


def _batched_vs_sequential(args, ns: list[int], runs: int, out_tokens: int, active: int,
                           sequential_too: bool) -> tuple[list[dict], dict]:
    """One paged engine: each size's burst at once and one after another. The table's rows, and
    per size its (batched, sequential) tok/s of each round."""
    paged = start_engine([base_worker(args, max_active=active, kv_cache="paged")])
    try:
        timed_burst(paged, 2, 8, True, "warm")
        timed_burst(paged, 1, 8, True, "warm")   # one stream takes the single-sequence attention path
        # every size in every round, batched and sequential side by side: a slow spell of the
        # shared machine lands on all sizes of a round, not on one size's runs
        runs_of = {n: ([], []) for n in ns}
        for r in range(runs):
            for n in ns:
                batched, sequential = runs_of[n]
                batched.append(n * out_tokens / timed_burst(paged, n, out_tokens, True, f"b{r}"))
                if sequential_too:
                    sequential.append(n * out_tokens / timed_burst(paged, n, out_tokens, False, f"s{r}"))
    finally:
        stop_engine(paged)
    table = []
    for n in ns:
        batched, sequential = runs_of[n]
        b, s = median(batched), median(sequential)
        table.append({"n": n, "batched_tok_s": b, "sequential_tok_s": s,
                      "ratio": round(paired_ratio(batched, sequential), 3) if s else None,
                      "batched_runs": batched, "sequential_runs": sequential})
    return table, runs_of


def _paged_vs_contiguous(args, runs: int, out_tokens: int, active: int, context: int) -> tuple[list[dict], str]:
    """The same bursts on paged and contiguous K/V, rounds alternating which goes first; the
    rows for N = 1 and 8, and the device they ran on.

    Two engines at once: each worker in its own process. As two threads of this process
    they would run two OpenMP teams on the same cores, and with more OpenMP threads than
    cores libgomp hardly spin-waits: both variants would measure the teams rather than the
    KV layouts. Contiguous K/V reserves a whole context per sequence: at the default 4096
    tokens 256 MiB of the 0.5B's fp32 K/V holds two, and N = 8 would measure admission
    rather than what paging costs. Both get a context that lets all N run (the burst's
    sequences are 24 + out_tokens long), unless --max-context says otherwise."""
    contiguous = start_engine([base_worker(args, max_active=active, kv_cache="contiguous", max_context=context)],
                              mode="process")
    paged = start_engine([base_worker(args, max_active=active, kv_cache="paged", max_context=context)],
                         mode="process")
    try:
        timed_burst(contiguous, 2, 8, True, "warm")
        timed_burst(paged, 2, 8, True, "warm")
        kv = []
        for n in (1, 8):
            res = {"paged": [], "contiguous": []}
            for r in range(runs):
                pair = (("paged", paged), ("contiguous", contiguous))
                for name, eng in pair if r % 2 == 0 else pair[::-1]:   # ABBA: neither always goes first
                    res[name].append(n * out_tokens / timed_burst(eng, n, out_tokens, True, f"{name}{r}"))
            p, c = median(res["paged"]), median(res["contiguous"])
            # the median of the rounds' ratios (each round ran both back to back), as elsewhere:
            # the ratio of medians moved 0.94-1.01 between runs of the same code
            kv.append({"n": n, "paged_tok_s": p, "contiguous_tok_s": c,
                       "paged_over_contiguous": round(paired_ratio(res["paged"], res["contiguous"]), 3),
                       "paged_over_contiguous_ratio_of_medians": round(p / c, 3),
                       "paged_runs": res["paged"], "contiguous_runs": res["contiguous"]})
    finally:
        stop_engine(paged)
        stop_engine(contiguous)
    return kv, paged.config.workers[0].device


PRESSURE_DEVICE = "sim:fast:prefill=25000,decode=4000"


def _memory_pressure(args, kv_memory: str, n: int = 8, out_tokens: int = 1000) -> dict:
    """n requests x out_tokens at once on a simulated worker (the model's KV geometry, no
    forward pass) with kv_memory of KV: what preemption costs when the pool is too small."""
    from engine.facade.devices import parse_devices
    from engine.config import parse_size

    worker = parse_devices([PRESSURE_DEVICE], base_worker(args, max_active=8,
                                                          kv_cache_memory=parse_size(kv_memory)))
    engine = start_engine(worker)
    try:
        params = SamplingParams(max_tokens=out_tokens, ignore_eos=True)
        prompts = [prompt_of(engine, 24, f"pressure request {i}: ") for i in range(n)]
        t0 = time.perf_counter()
        results = [h.result() for h in [engine.submit(prompt_ids=p, params=params) for p in prompts]]
        wall = time.perf_counter() - t0
        assert all(r.finish_reason == "length" for r in results), [r.error for r in results]
        deadline = time.monotonic() + 5   # the worker's totals arrive with its next stats (5 Hz)
        preemptions = [r.metrics.preemptions for r in results]
        while time.monotonic() < deadline:
            w = engine.snapshot().workers[0]
            if w.preemptions == sum(preemptions):
                break
            time.sleep(0.05)
        return {"device": PRESSURE_DEVICE, "simulated": True, "kv_cache_memory": kv_memory,
                "kv_pages": w.pages_total, "page_size": w.page_size, "requests": n,
                "output_tokens": out_tokens, "wall_s": round(wall, 2),
                "preemptions_per_request": preemptions, "recomputed_tokens": w.recomputed_tokens,
                "useful_tokens": sum(len(r.prompt_token_ids) + len(r.token_ids) for r in results)}
    finally:
        stop_engine(engine)


# --- routing -----------------------------------------------------------------------------
def _routing_burst(engine, prompts, interval_s: float, out_tokens: int, force: int | None) -> dict:
    params = SamplingParams(max_tokens=out_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    handles = [engine.submit(prompt_ids=prompts[i], params=params, worker=force, burst="routing")
               for i in paced(len(prompts), interval_s)]
    results = [h.result() for h in handles]
    wall = time.perf_counter() - t0
    failed = [r.error for r in results if r.finish_reason != "length"]
    if failed:
        raise RuntimeError(f"routing burst had failures: {failed[:3]}")
    ttft = [r.metrics.ttft for r in results]
    e2e = [r.metrics.e2e for r in results]
    per_worker: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for r in results:
        per_worker[str(r.worker)] = per_worker.get(str(r.worker), 0) + 1
        tokens[str(r.worker)] = tokens.get(str(r.worker), 0) + r.metrics.output_tokens
    out = sum(r.metrics.output_tokens for r in results)
    return {"completion_s": wall, "throughput_tok_s": out / wall, "ttft_p50": median(ttft),
            "ttft_p95": percentile(ttft, 95), "e2e_p50": median(e2e), "e2e_p95": percentile(e2e, 95),
            "requests_per_worker": per_worker, "output_tokens_per_worker": tokens}


def _routing_row(n: int, policy: str, bursts: list[dict]) -> dict:
    """One policy's row at n requests: the medians of its bursts' figures, and each burst's split."""
    row = {"requests": n, "policy": policy}
    for key in ("completion_s", "throughput_tok_s", "ttft_p50", "ttft_p95", "e2e_p50", "e2e_p95"):
        row[key] = median([x[key] for x in bursts])
    for key in ("requests_per_worker", "output_tokens_per_worker"):
        row[key] = [x[key] for x in bursts]
    return row


def bench_routing(args) -> dict:
    """mini-vllm-rs's heterogeneous-serving burst: requests 50 ms apart, ~516-token prompts sharing a ~512-token
    prefix, 128 output tokens, up to 4 active per worker; forced-fastest vs each policy.

    Devices default to one real CPU worker plus one simulated GPU with mini-vllm-rs's published
    Metal rates (labelled simulated in the report)."""
    from engine.facade.devices import parse_devices
    from engine.facade.engine import Engine

    runs = 1 if args.quick else args.runs
    sizes = [8, 16] if args.quick else [8, 48]
    out_tokens = 32 if args.quick else 128
    specs = args.device or ["cpu", "sim:gpu0"]
    base = replace(base_worker(args, max_active=4), calibrate=True)
    workers = parse_devices(specs, base)
    policies = [p.strip() for p in args.policies.split(",")]
    engine = Engine(EngineConfig(workers=workers, worker_mode=args.worker_mode or "process",
                                 trace_dir=common.TRACE_DIR, routing_log=getattr(args, "routing_log", None))).start()
    try:
        snap = engine.snapshot()
        devices = [{"index": w.index, "name": w.name, "simulated": w.simulated,
                    "profile_prefill_tps": w.profile_prefill_tps,
                    "profile_decode_tps": w.profile_decode_tps} for w in snap.workers]
        fastest = max(snap.workers, key=lambda w: w.profile_decode_tps).index
        shared = prompt_of(engine, 512, "Shared design note. ")
        table = []
        for n in sizes:
            rows = {p: [] for p in policies}
            for r in range(runs):
                for policy in policies:     # interleaved: one run of each policy in turn
                    prompts = [shared + engine.tokenizer.encode(f" Question {r}.{i}?", add_special=False)[:4]
                               for i in range(n)]
                    if policy != "forced-fastest":
                        engine.set_router_policy(policy)
                    force = fastest if policy == "forced-fastest" else None
                    rows[policy].append(_routing_burst(engine, prompts, 0.05, out_tokens, force))
            table += [_routing_row(n, policy, res) for policy, res in rows.items()]
    finally:
        stop_engine(engine)

    def row(n, p):
        return next(t for t in table if t["requests"] == n and t["policy"] == p)
    big, small = sizes[-1], sizes[0]
    goals = {}
    if {"cost", "forced-fastest"} <= set(policies):   # the goals compare the two
        goals = {
            f"cost_beats_forced_completion_at_{big}": row(big, "cost")["completion_s"] < row(big, "forced-fastest")["completion_s"],
            f"cost_beats_forced_throughput_at_{big}": row(big, "cost")["throughput_tok_s"] > row(big, "forced-fastest")["throughput_tok_s"],
            f"cost_vs_forced_completion_ratio_at_{small}": round(row(small, "cost")["completion_s"] / row(small, "forced-fastest")["completion_s"], 3),
        }
    return {
        "devices": devices, "runs": runs, "interval_ms": 50, "output_tokens": out_tokens,
        "prompt_tokens": len(shared) + 4, "shared_prefix_tokens": len(shared),
        "note": "sim workers replace the forward pass by a timed wait at their declared rates",
        "table": table, "goals": goals,
    }


# --- tracing cost ------------------------------------------------------------------------
TRACE_ORDERS = list(itertools.permutations(("off", "light", "full")))   # each detail in each place


def bench_trace(args) -> dict:
    """What the flight recorder costs: decode throughput with no recording, the light ring
    (the default) and full detail (per-layer scopes) side by side on one engine. Each round
    runs the three back to back and then in reverse (A B C C B A: a steady drift costs each the
    same), starting from each of the six orders in turn, so the place in a round falls on every
    detail alike; the figures are medians of per-round ratios of each detail's two runs. Also what
    light detail records in a step (engine step, scheduler and sampler spans, three counters)
    and the cost of a deep scope it leaves out (a no-op), timed alone, as shares of a step."""
    rounds = 1 if args.quick else max(6, args.runs)
    out_tokens = 16 if args.quick else 64
    n = 4
    engine = start_engine([base_worker(args)])
    runs: list[dict] = []
    try:
        timed_burst(engine, 2, 8, True, "warm")
        for r in range(rounds):
            order = TRACE_ORDERS[r % len(TRACE_ORDERS)]
            row: dict = {"order": list(order), **{d: [] for d in order}}
            for i, detail in enumerate(order + order[::-1]):
                engine.recorder.set_detail(detail)
                time.sleep(0.05)     # the worker takes the command before the burst starts
                row[detail].append(decode_burst_tok_s(engine, n, out_tokens, f"{detail}{r}.{i}"))
            runs.append(row)
        engine.export_trace(args.trace_dir or "traces")   # what a full ring holds is written, as `t` would
        engine.recorder.set_detail("light")
        from engine.models.gguf import load_gguf
        from engine.models.catalog import resolve_model
        n_layers = load_gguf(resolve_model(args.model)).config.n_layers
    finally:
        engine.shutdown()
    tok_s = {d: median(v for r in runs for v in r[d]) for d in ("off", "light", "full")}
    light_ratios = sorted(sum(r["light"]) / sum(r["off"]) for r in runs)
    full_ratios = sorted(sum(r["full"]) / sum(r["off"]) for r in runs)
    light, full = median(light_ratios), median(full_ratios)
    step_s = n / tok_s["off"]
    # deep scopes a step would make on the per-layer path, a no-op at light detail: model +
    # per layer (layer, attn, attention, mlp, 4 qmatmul) + lm_head
    scopes_per_step = 2 + 8 * n_layers
    noop_s, light_step_s = _light_record_costs(n)
    return {"requests": n, "output_tokens": out_tokens, "rounds": rounds,
            "no_recording_tok_s": tok_s["off"], "light_tok_s": tok_s["light"], "full_tok_s": tok_s["full"],
            "light_over_none": round(light, 3), "full_over_none": round(full, 3),
            "light_over_none_range": [round(light_ratios[0], 3), round(light_ratios[-1], 3)],
            "full_over_none_range": [round(full_ratios[0], 3), round(full_ratios[-1], 3)],
            "runs_tok_s": runs,
            "light_step_records_us": round(light_step_s * 1e6, 2),
            "light_step_records_fraction_of_step": round(light_step_s / step_s, 5),
            "light_noop_scope_ns": round(noop_s * 1e9, 1), "scopes_per_step": scopes_per_step,
            "light_noop_scopes_fraction_of_step": round(noop_s * scopes_per_step / step_s, 5),
            "goals": {"light_costs_le_1pct": light >= 0.99, "full_costs_le_10pct": full >= 0.90}}


def _light_record_costs(n: int, reps: int = 50_000) -> tuple[float, float]:
    """Seconds of a no-op deep scope, and of what a worker records in one decode step of n
    requests at light detail, each timed alone."""
    from engine.trace import Tracer

    t = Tracer("bench", detail="light")
    t0 = time.perf_counter()
    for _ in range(reps):
        with t.scope("qmatmul", op="x"):
            pass
    noop_s = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for i in range(reps):      # what a worker records in a decode step at light detail
        with t.span("engine step", step=i):
            with t.span("scheduler decision"):
                pass
            with t.span("sampler", rows=n):
                pass
        t.counter("kv pages", used=i, cached=0, free=512)
        t.counter("requests", running=n, waiting=0)
        t.counter("tokens in step", tokens=n)
    light_step_s = (time.perf_counter() - t0) / reps
    return noop_s, light_step_s
