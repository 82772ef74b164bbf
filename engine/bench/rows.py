"""`tokentop bench rows`: the cost of a decode step by its row count, against one row.

N requests (N = 1 .. 16, or --sizes) are prefilled together and then decode in lockstep, so
every decode step has exactly N rows; a step's time is the median over the requests of
(end-to-end - time to first token) / (tokens - 1). Per N: the step in ms and against one row,
tokens per second, and the bytes the step reads (the weights once, each request's K/V) times
steps per second, as GB/s and as a share of the machine's read bandwidth; and the step's
multiply-adds per second as a share of the matmul peak (engine/worker/roofline.py measures
both ceilings, cached per machine). One row is bound by the read; many rows by the arithmetic
(and the unpacking of the weight blocks), which the shares show side by side.

Also what `bench single` reports as its roofline: its decode's bytes per second against the
same read bandwidth (decode_roofline).
"""
from __future__ import annotations

from engine.config import SamplingParams
from engine.stats import median

PROMPT_TOKENS = 64
SIZES = tuple(range(1, 17))
QUICK_SIZES = (1, 2, 4, 8)


def model_traffic(worker) -> tuple[int, int, int]:
    """(weight bytes, weight multiply-adds per row, K/V bytes per token) of the worker's model."""
    import torch
    from engine.dtypes import resolve_kv_dtype
    from engine.models.batch import KV_TORCH_DTYPES, KVStore
    from engine.models.catalog import resolve_model
    from engine.models.gguf import load_gguf
    from engine.worker.roofline import weight_traffic

    gguf = load_gguf(resolve_model(worker.model))
    nbytes, macs = weight_traffic(gguf)
    c = gguf.config
    kv_dtype = KV_TORCH_DTYPES.get(resolve_kv_dtype(worker.device, worker.kv_dtype), torch.float32)
    return nbytes, macs, KVStore.bytes_per_slot(c.n_layers, c.n_kv_heads, c.head_dim, kv_dtype)


def ceilings(threads: int) -> dict:
    """The machine's ceilings measured in this run (and cached for the workers): a ceiling
    cached by a worker that started on a busy machine would make every share too high."""
    from engine.worker.roofline import machine_ceilings
    return machine_ceilings(threads, remeasure=True)


def decode_roofline(worker, steps_per_s: float, context_tokens: int, live: dict | None = None,
                    live_steps_per_s: float | None = None,
                    runs: list[tuple[float, float]] | None = None) -> dict:
    """A one-stream decode's read GB/s (bytes per step × steps per second) and its share of
    the measured read bandwidth; `live` is the worker's own figure, read after the decode that
    ran at live_steps_per_s: compared with that run's read (live_vs_run), since the median over
    runs can sit a tenth away from any one run on a shared machine. `runs`: (steps per second,
    the read ceiling measured around that run) per run, for each run's own share (paired)."""
    if worker.simulated:
        return {"note": "not shown: a simulated worker's step is a timed wait"}
    try:
        weight_bytes, _, kv_per_token = model_traffic(worker)
        ceil = ceilings(worker.threads)
    except Exception as exc:  # noqa: BLE001 - the decode figures stand without it
        from engine.errors import describe_error
        return {"note": f"not measured: {describe_error(exc)}"}
    step = weight_bytes + kv_per_token * context_tokens
    read = step * steps_per_s / 1e9
    out = {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token,
           "mean_context_tokens": context_tokens, "step_bytes": step, "read_gb_s": round(read, 2),
           "read_bandwidth_gb_s": ceil["read_gbs"], "read_share": round(read / ceil["read_gbs"], 3),
           "ceilings_source": ceil["source"], "live": live}
    if live and live.get("read_gbs") and live_steps_per_s:
        run_read = step * live_steps_per_s / 1e9
        out["live_vs_run"] = {"run_read_gb_s": round(run_read, 2), "ratio": round(live["read_gbs"] / run_read, 3)}
    if runs:
        shares = [step * sps / 1e9 / ceiling for sps, ceiling in runs if ceiling > 0]
        out["paired"] = {"read_share_runs": [round(x, 3) for x in shares],
                         "read_share": round(median(shares), 3) if shares else None,
                         "note": "each run's read against the ceiling measured just before and after it"}
    return out


def _step_seconds(engine, n: int, out_tokens: int, salt: str) -> float:
    """Median decode step time of n requests decoding together."""
    from engine.bench.common import prompt_of
    params = SamplingParams(max_tokens=out_tokens, ignore_eos=True)
    handles = [engine.submit(prompt_ids=prompt_of(engine, PROMPT_TOKENS, f"{salt} row {i}: "), params=params)
               for i in range(n)]
    steps = []
    for h in handles:
        m = h.result(600).metrics
        steps.append((m.e2e - m.ttft) / max(1, m.output_tokens - 1))
    return median(steps)


def _row(n: int, seconds: float, one: float, out_tokens: int, traffic, ceil: dict | None) -> dict:
    row = {"rows": n, "step_ms": round(seconds * 1000, 3), "vs_1_row": round(seconds / one, 3),
           "tok_s": round(n / seconds, 2)}
    if ceil is None:   # a simulated worker waits; it reads nothing
        return row
    weight_bytes, macs, kv_per_token = traffic
    step_bytes = weight_bytes + kv_per_token * n * (PROMPT_TOKENS + out_tokens // 2)
    read, gflops = step_bytes / seconds / 1e9, 2 * macs * n / seconds / 1e9
    read_share, compute_share = read / ceil["read_gbs"], gflops / ceil["matmul_gflops"]
    return {**row, "step_bytes": step_bytes, "read_gb_s": round(read, 2),
            "read_share": round(read_share, 3), "gflops": round(gflops, 1),
            "compute_share": round(compute_share, 3),
            "nearer_bound": "bandwidth" if read_share >= compute_share else "arithmetic"}


def _sizes(args) -> list[int]:
    if getattr(args, "sizes", None):
        return sorted({int(n) for n in args.sizes.split(",")} | {1})
    return list(QUICK_SIZES if args.quick else SIZES)


def _one_model(args, model: str, sizes: list[int], runs: int, out_tokens: int) -> dict:
    from engine.bench.common import base_worker, start_engine, stop_engine
    from engine.facade.compare import wait_for_kernels
    worker = base_worker(args, model=model, max_active=max(sizes),
                         max_batched_tokens=max(2048, max(sizes) * (PROMPT_TOKENS + 1)))
    traffic = model_traffic(worker)
    ceil = None if worker.simulated else ceilings(worker.threads)
    engine = start_engine([worker])
    try:
        wait_for_kernels(engine, lambda text: None)
        _step_seconds(engine, 2, 8, "warm")
        _step_seconds(engine, 1, 8, "warm")
        # every size in every round: a slow spell of the machine lands on all sizes alike
        times = {n: [] for n in sizes}
        for r in range(runs):
            for n in sizes:
                times[n].append(_step_seconds(engine, n, out_tokens, f"r{r}"))
        simulated = engine.snapshot().workers[0].simulated
    finally:
        stop_engine(engine)
    one = median(times[1])
    table = [_row(n, median(times[n]), one, out_tokens, traffic, None if simulated else ceil) for n in sizes]
    return {"model": model, "device": worker.device, "threads": worker.threads, "simulated": simulated,
            "weight_bytes": traffic[0], "weight_macs_per_row": traffic[1], "kv_bytes_per_token": traffic[2],
            **({"roofline": "not shown: a simulated worker's step is a timed wait"} if simulated else
               {"read_bandwidth_gb_s": ceil["read_gbs"], "matmul_peak_gflops": ceil["matmul_gflops"],
                "ceilings_source": ceil["source"]}),
            "rows": table,
            "step_ms_runs": {str(n): [round(t * 1000, 3) for t in times[n]] for n in sizes}}


def bench_rows(args) -> dict:
    runs = 1 if args.quick else args.runs
    out_tokens = 16 if args.quick else 64
    sizes = _sizes(args)
    results = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        try:
            results.append(_one_model(args, model, sizes, runs, out_tokens))
        except Exception as exc:  # noqa: BLE001 - a model that cannot run is reported, the rest run
            from engine.errors import describe_error
            results.append({"model": model, "error": describe_error(exc)})
    return {"prompt_tokens": PROMPT_TOKENS, "output_tokens": out_tokens, "runs": runs, "sizes": sizes,
            "ceilings_note": "read bandwidth: a float32 sum of twice the last-level cache (at least 256 MiB); matmul peak: torch float32 "
                             "1024x1024 matmuls (the integer dot kernels can exceed it)",
            "results": results}
