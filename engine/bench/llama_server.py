"""`bench batching --llama-server PATH`: tokentop's HTTP server against llama.cpp's own server
with 8 parallel slots, on the same GGUF file, driven by one HTTP client.

Both sides are OpenAI-compatible servers on loopback ports: tokentop's is engine/serve's
HttpServer in this process over a process-mode engine (the worker in its own process, as
`tokentop serve` runs it); llama.cpp's is `llama-server -m MODEL.gguf -np 8 -c 8192 -t T`.
The client is the same function for both: N concurrent non-streaming /v1/completions
requests, prompts sent as token ids (one GGUF file, one vocabulary: the same ids on both
sides), temperature 0 and ignore_eos, so every request produces exactly `out_tokens`
(checked against each response's usage). Aggregate throughput = N x out_tokens / wall time
of the burst. Runs alternate between the servers; each run uses fresh prompts (a salt at
their start), so neither side's prompt cache helps.
"""
from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from contextlib import contextmanager

import httpx

from engine.stats import median

SLOTS = 8            # llama-server -np
CONTEXT = 8192       # llama-server -c: 1,024 positions per slot
PROMPT_TOKENS = 24


def llama_server_argv(binary: str, model_path: str, port: int, threads: int) -> list[str]:
    return [binary, "-m", model_path, "-np", str(SLOTS), "-c", str(CONTEXT), "-t", str(threads),
            "--host", "127.0.0.1", "--port", str(port)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Until GET /health answers 200 (llama-server answers 503 while it loads the model)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not become healthy within {timeout:.0f} s")


@contextmanager
def llama_server(binary: str, model_path: str, threads: int, timeout: float = 300):
    """A llama-server process on a free loopback port; yields its URL, terminates it after."""
    port = free_port()
    proc = subprocess.Popen(llama_server_argv(binary, model_path, port, threads),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextmanager
def tokentop_server(worker):
    """tokentop's HTTP server in this process, over an engine whose worker has its own process."""
    from engine.bench.common import start_engine, stop_engine
    from engine.serve.app import ServeConfig
    from engine.serve.server import HttpServer

    engine = start_engine([worker], mode="process")
    http = HttpServer(engine, ServeConfig(port=0), quiet=True).start()
    try:
        wait_healthy(http.url, 60)
        yield http.url
    finally:
        http.stop()
        stop_engine(engine)


async def burst(url: str, prompts: list[list[int]], out_tokens: int) -> float:
    """Wall seconds for every prompt's completion, all sent at once; each must produce
    exactly out_tokens tokens."""
    async with httpx.AsyncClient(base_url=url, timeout=900,
                                 limits=httpx.Limits(max_connections=len(prompts) + 4)) as client:
        async def one(ids: list[int]) -> None:
            body = {"prompt": ids, "max_tokens": out_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": False}
            r = await client.post("/v1/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
            got = r.json().get("usage", {}).get("completion_tokens")
            if got != out_tokens:
                raise RuntimeError(f"{url}: a request produced {got} tokens, not {out_tokens}")

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - t0


def compare(servers: dict[str, str], make_prompt, ns: list[int], runs: int, out_tokens: int) -> dict:
    """Aggregate tok/s of each server at each N (medians of `runs`, servers alternating in
    each run). make_prompt(tag) -> token ids; every request of every run gets its own tag."""
    names = list(servers)
    for name in names:                                   # warm-up: both paths, then one stream
        asyncio.run(burst(servers[name], [make_prompt(f"warm {name} {i}") for i in range(2)], 8))
        asyncio.run(burst(servers[name], [make_prompt(f"warm {name} one")], 8))
    table = []
    for n in ns:
        tok_s: dict[str, list[float]] = {name: [] for name in names}
        for r in range(runs):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                prompts = [make_prompt(f"n{n} run {r} {name} request {i}") for i in range(n)]
                tok_s[name].append(n * out_tokens / asyncio.run(burst(servers[name], prompts, out_tokens)))
        row = {"n": n}
        for name in names:
            row[f"{name}_tok_s"] = median(tok_s[name])
            row[f"{name}_runs"] = tok_s[name]
        if len(names) == 2:
            a, b = names
            row[f"{a}_over_{b}"] = round(row[f"{a}_tok_s"] / row[f"{b}_tok_s"], 3)
        table.append(row)
    return {"table": table}


def bench_llama_server(args, worker, model_path: str, out_tokens: int, runs: int, ns: list[int]) -> dict:
    """The side-by-side section of `bench batching --llama-server PATH`."""
    from engine.bench.common import FILLER
    from engine.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(model_path)

    def make_prompt(tag: str) -> list[int]:
        return tok.encode(tag + ": " + FILLER * 2, add_special=False)[:PROMPT_TOKENS]

    with tokentop_server(worker) as ours, llama_server(args.llama_server, model_path, worker.threads) as theirs:
        result = compare({"tokentop": ours, "llama_server": theirs}, make_prompt, ns, runs, out_tokens)
    eight = next(r for r in result["table"] if r["n"] == 8)
    one = next(r for r in result["table"] if r["n"] == 1)
    return {
        "llama_server_command": " ".join(llama_server_argv("llama-server", "MODEL.gguf", 0, worker.threads)
                                         ).replace("--port 0", "--port P"),
        "tokentop_side": "engine/serve HttpServer in the bench process, worker in its own process "
                         f"(as `tokentop serve`), --threads {worker.threads}, --max-active {worker.max_active}",
        "client": "one httpx client function for both: N concurrent non-streaming /v1/completions, "
                  f"{PROMPT_TOKENS}-token prompts as token ids, temperature 0, ignore_eos, "
                  f"{out_tokens} tokens each (checked from usage)",
        "prompt_tokens": PROMPT_TOKENS, "output_tokens": out_tokens, "runs": runs,
        **result,
        "llama_server_n8_over_n1": round(eight["llama_server_tok_s"] / one["llama_server_tok_s"], 3),
        "tokentop_n8_over_n1": round(eight["tokentop_tok_s"] / one["tokentop_tok_s"], 3),
        "goals": {"n8_ge_llama_server_n8": eight["tokentop_tok_s"] >= eight["llama_server_tok_s"]},
    }
