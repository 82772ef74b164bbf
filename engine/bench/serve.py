"""`tokentop bench serve`: the same burst through the HTTP API and in-process, side by side.

One engine (its worker in its own process, as `tokentop serve` runs it) serves both variants;
the HTTP server runs on a loopback port in this process. Each run fires N concurrent
streaming requests (ignore_eos, so every request produces exactly the asked tokens) and the
client measures: throughput = output tokens / wall time of the burst, and each request's
time to first token. Runs alternate between the variants; medians and p50/p95 are reported.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx

from engine.stats import median, percentile
from engine.config import SamplingParams

FILLER = "Continuous batching admits new requests between decode steps so that no slot idles. "


async def _in_process(engine, prompts: list[str], out_tokens: int) -> tuple[float, list[float]]:
    params = SamplingParams(max_tokens=out_tokens, ignore_eos=True)

    async def one(prompt: str) -> float:
        t0 = time.perf_counter()
        ttft = None
        n = 0
        async for d in engine.submit(prompt, params=params):
            if ttft is None and d.text:
                ttft = time.perf_counter() - t0
            n += d.token_id >= 0
        assert n == out_tokens, f"in-process request produced {n} tokens, not {out_tokens}"
        return ttft

    t0 = time.perf_counter()
    ttfts = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0, list(ttfts)


async def _http(url: str, model: str, prompts: list[str], out_tokens: int) -> tuple[float, list[float]]:
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)) as c:
        async def one(prompt: str) -> float:
            body = {"model": model, "prompt": prompt, "max_tokens": out_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            ttft, usage = None, None
            async with c.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    elif ttft is None and chunk["choices"] and chunk["choices"][0]["text"]:
                        ttft = time.perf_counter() - t0
            assert usage and usage["completion_tokens"] == out_tokens, usage
            return ttft

        t0 = time.perf_counter()
        ttfts = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - t0, list(ttfts)


def bench_serve(args) -> dict:
    from engine.bench.common import base_worker, start_engine, stop_engine
    from engine.serve.app import ServeConfig
    from engine.serve.server import HttpServer

    runs = 1 if args.quick else args.runs
    streams = 8
    out_tokens = 16 if args.quick else 64
    engine = start_engine([base_worker(args, max_active=streams)], mode="process")
    http = HttpServer(engine, ServeConfig(port=0), quiet=True).start()
    try:
        deadline = time.monotonic() + 30
        while httpx.get(http.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.1)
        model = http.api.model

        def prompts(tag: str) -> list[str]:    # distinct prompts of the same length, per run
            return [f"{tag} stream {i}: " + FILLER * 3 for i in range(streams)]

        asyncio.run(_in_process(engine, prompts("warm-a"), 4))
        asyncio.run(_http(http.url, model, prompts("warm-b"), 4))
        res = {"in_process": {"tok_s": [], "ttft": []}, "http": {"tok_s": [], "ttft": []}}
        for r in range(runs):
            order = ("in_process", "http") if r % 2 == 0 else ("http", "in_process")
            for name in order:
                ps = prompts(f"run {r} {name}")
                if name == "http":
                    wall, ttfts = asyncio.run(_http(http.url, model, ps, out_tokens))
                else:
                    wall, ttfts = asyncio.run(_in_process(engine, ps, out_tokens))
                res[name]["tok_s"].append(streams * out_tokens / wall)
                res[name]["ttft"].extend(ttfts)
    finally:
        http.stop()
        stop_engine(engine)

    def summary(v: dict) -> dict:
        return {"throughput_tok_s": median(v["tok_s"]), "throughput_runs": v["tok_s"],
                "ttft_p50_s": median(v["ttft"]), "ttft_p95_s": percentile(v["ttft"], 95)}

    inp, web = summary(res["in_process"]), summary(res["http"])
    overhead = 100.0 * (1.0 - web["throughput_tok_s"] / inp["throughput_tok_s"])
    return {"model": args.model, "streams": streams, "output_tokens": out_tokens, "runs": runs,
            "in_process": inp, "http": web, "http_throughput_overhead_pct": round(overhead, 2),
            "goals": {"http_overhead_le_5pct": overhead <= 5.0}}
