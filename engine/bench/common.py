"""What every benchmark shares: the benchmarked worker and engine, prompts, timed bursts, and
the machine a report ran on."""
from __future__ import annotations

import platform
import time
from dataclasses import replace

import torch

from engine.config import EngineConfig, SamplingParams, WorkerConfig

FILLER = ("The scheduler admits requests in arrival order, charges each step against a token "
          "budget, and preempts the youngest sequence when the page pool runs dry. ")


def base_worker(args, **over) -> WorkerConfig:
    """The benchmarked worker: the first device of the run (default cpu) built from
    `args.worker` (the WorkerConfig the command line made), on 2 threads unless it names
    another count, without a speed calibration; `over` replaces fields."""
    from engine.facade.devices import parse_devices
    w = replace(args.worker, threads=args.worker.threads or 2, calibrate=False)
    if args.device:
        w = parse_devices(args.device[:1], w)[0]
    return replace(w, **over)


TRACE_DIR: str | None = None   # `bench --trace-dir DIR`: every engine of the run writes a trace


def start_engine(workers, mode="thread"):
    from engine.facade.engine import Engine
    return Engine(EngineConfig(workers=tuple(workers), worker_mode=mode, trace_dir=TRACE_DIR)).start()


def stop_engine(engine) -> None:
    if TRACE_DIR:
        engine.export_trace(TRACE_DIR)
    engine.shutdown()


def prompt_of(engine, n_tokens: int, salt: str = "") -> list[int]:
    ids = engine.tokenizer.encode(salt + FILLER * (n_tokens // 20 + 2), add_special=False)
    return ids[:n_tokens]


def timed_burst(engine, n: int, out_tokens: int, concurrent: bool, salt: str) -> float:
    """Wall seconds to finish n requests, all at once or one after another."""
    params = SamplingParams(max_tokens=out_tokens, ignore_eos=True)
    prompts = [prompt_of(engine, 24, f"{salt} request {i}: ") for i in range(n)]
    t0 = time.perf_counter()
    if concurrent:
        handles = [engine.submit(prompt_ids=p, params=params) for p in prompts]
        results = [h.result() for h in handles]
    else:
        results = [engine.generate(prompt_ids=p, params=params) for p in prompts]
    wall = time.perf_counter() - t0
    assert all(r.finish_reason == "length" for r in results), [r.error for r in results]
    return wall


def decode_burst_tok_s(engine, n: int, out_tokens: int, salt: str) -> float:
    return n * out_tokens / timed_burst(engine, n, out_tokens, True, salt)


# environment settings that change which kernels run: a report's command names those set
KERNEL_ENV = ("TOKENTOP_KERNEL_ISA", "TOKENTOP_PACKED", "TOKENTOP_AVX_VNNI", "ATEN_CPU_CAPABILITY")


def command_line(argv: list[str], env: dict | None = None) -> str:
    """The command as a reader would retype it, without the path of the machine that ran it,
    after the kernel settings of the environment (KERNEL_ENV) it ran with."""
    import os
    import shlex
    env = os.environ if env is None else env
    hidden = {"--llama-cpp": "PATH/TO/python", "--llama-server": "PATH/TO/llama-server"}
    words = [f"{k}={shlex.quote(env[k])}" for k in KERNEL_ENV if env.get(k)]
    words, hide = words + ["tokentop"], None
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
    from engine.worker.roofline import on_threads
    with on_threads(threads):
        buf = torch.ones(nbytes // 4)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            buf.sum()
            times.append(time.perf_counter() - t0)
    return nbytes / median(times) / 1e9


def read_ceiling_gbs(threads: int, reps: int = 5) -> float:
    """The roofline's read ceiling (engine/worker/roofline.py: the fastest of `reps` sums of
    twice the last-level cache) on `threads` threads, measured now."""
    from engine.worker.roofline import measure_read_gbs, on_threads
    with on_threads(threads):
        return measure_read_gbs(reps=reps)


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
