"""`tokentop serve` instances behind the real fleet routers: vllm-router 0.1.17 and SGLang's
sglang-router 0.3.2 (pip install 'tokentop[fleet]'), all on loopback.

The servers run simulated workers (labelled; their text is " sim" per token) on the bundled
model's tokenizer, so each prompt's prefix-cache hits are known in advance: prompts are token
ids, a group of requests shares its first 64 (four 16-token pages), and every request beyond
a group's first on a server can restore exactly those 64. The servers' own /metrics
(vllm:prefix_cache_queries / _hits) say which server a group went to and what it restored.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from tests.fleet_util import (MODEL, access_lines, need, port_of, samples, sglang_router, tokentop, total,
                              vllm_router)

SIM = "sim:r:prefill=20000,decode=400"
SHARED, PAGE = 64, 16
GROUP = 4
OWN = (8, 24)          # the two groups of a round differ in length: a server's count says which it got
KILL_TOKENS = 160      # the answers of the burst during which a server is killed


def prompt(group: int, request: int, own: int = 8) -> list[int]:
    shared = [1000 + 97 * group + i for i in range(SHARED)]
    return shared + [60_000 + 50 * group + 9 * request + j for j in range(own)]


def round_prompts(rnd: int) -> list[list[int]]:
    """Two groups, their requests interleaved: X0, Y0, X1, Y1, ..."""
    return [prompt(2 * rnd + k, r, OWN[k]) for r in range(GROUP) for k in (0, 1)]


def split(queries: float) -> tuple[int, int]:
    """How many of each group a server's looked-up prompt tokens are (unique for 0..4 each)."""
    lx, ly = SHARED + OWN[0], SHARED + OWN[1]
    found = [(x, y) for x in range(GROUP + 1) for y in range(GROUP + 1) if x * lx + y * ly == queries]
    assert len(found) == 1, queries
    return found[0]


async def _burst(url: str, prompts: list, max_tokens: int) -> list[dict]:
    """Each prompt (token ids, text, or a list of chat messages) as one request, all at once."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async def one(p):
            chat = isinstance(p, list) and p and isinstance(p[0], dict)
            body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                    **({"messages": p} if chat else {"prompt": p})}
            r = await c.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
            return {"status": r.status_code, "body": r.json() if r.status_code == 200 else r.text}
        return await asyncio.gather(*(one(p) for p in prompts))


def burst(url, prompts, max_tokens):
    return asyncio.run(_burst(url, prompts, max_tokens))


def check_outputs(outs: list[dict], prompts: list, max_tokens: int, server=None) -> None:
    """Every answer complete and right: a simulated worker's text, the prompt's own length (a
    text or chat prompt counted by a server's /tokenize), max_tokens generated."""
    for out, p in zip(outs, prompts):
        assert out["status"] == 200, out
        body = out["body"]
        choice = body["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert text == " sim" * max_tokens and choice["finish_reason"] == "length"
        if isinstance(p, list) and p and isinstance(p[0], int):
            n = len(p)
        else:
            n = httpx.post(server.url + "/tokenize", json={"messages": p} if isinstance(p, list) else {"prompt": p},
                           timeout=10).json()["count"]
        assert body["usage"]["prompt_tokens"] == n and body["usage"]["completion_tokens"] == max_tokens


def prefix_counts(servers: dict) -> dict[str, tuple[float, float]]:
    out = {}
    for name, s in servers.items():
        m = samples(s.url + "/metrics")
        out[name] = (total(m, "vllm:prefix_cache_queries_total"), total(m, "vllm:prefix_cache_hits_total"))
    return out


def group_deltas(servers: dict, before: dict, want_queries: int, timeout: float = 10.0) -> dict:
    """Per server (queries, hits) since `before`, once the workers have reported all of them."""
    deadline = time.monotonic() + timeout
    while True:
        now = prefix_counts(servers)
        delta = {k: (now[k][0] - before[k][0], now[k][1] - before[k][1]) for k in servers}
        if sum(q for q, _ in delta.values()) >= want_queries or time.monotonic() > deadline:
            return delta
        time.sleep(0.1)


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_vllm_router_over_two_tokentop_servers(real_model_path):
    need("vllm_router", "vllm-router")
    a, b = tokentop(SIM), tokentop(SIM)
    router = None
    try:
        router = vllm_router([a.url, b.url], "--policy", "cache_aware", "--worker-startup-check-interval", "1",
                             "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                             "--health-success-threshold", "1", "--cb-failure-threshold", "2",
                             "--cb-timeout-duration-secs", "2", "--retry-max-retries", "10",
                             "--retry-initial-backoff-ms", "100", "--retry-max-backoff-ms", "1000")
        servers = {"a": a, "b": b}
        # 1. rounds of two groups, each round one concurrent burst: per server, every request
        #    beyond a group's first there restores the group's 4 shared pages, and no more
        served_by: dict[int, set] = {}
        for rnd in range(3):
            prompts = round_prompts(rnd)
            before = prefix_counts(servers)
            check_outputs(burst(router.url, prompts, 8), prompts, 8)
            want = sum(len(p) for p in prompts)
            delta = group_deltas(servers, before, want)
            assert sum(q for q, _ in delta.values()) == want, delta
            for name, (queries, hits) in delta.items():
                counts = split(queries)
                assert hits == sum(max(0, n - 1) for n in counts) * SHARED, (rnd, name, delta)
                for k, n in enumerate(counts):
                    if n:
                        served_by.setdefault(2 * rnd + k, set()).add(name)
        assert {n for names in served_by.values() for n in names} == {"a", "b"}, served_by
        assert all(len(names) == 1 for names in served_by.values()), f"cache_aware split a group: {served_by}"
        # text and chat prompts: the router tokenizes them with the servers' render endpoints
        texts = [f"Summarise report number {i} in one line." for i in range(4)]
        chats = [[{"role": "user", "content": f"Say hello to user {i}."}] for i in range(4)]
        check_outputs(burst(router.url, texts + chats, 5), texts + chats, 5, server=a)
        lines = access_lines(a) + access_lines(b)
        for path in ("/v1/completions/render", "/v1/chat/completions/render"):
            assert any(f'"POST {path} HTTP/1.1" 200' in line for line in lines), path
        assert not [line for line in lines if '" 404' in line]
        inputs = router.metrics()
        assert total(inputs, "vllm_router_kv_routing_inputs_total", result="render") >= len(texts + chats)
        assert total(inputs, "vllm_router_kv_routing_inputs_total", result="render_unavailable") == 0
        # 2. kill one server mid-burst: the router retries its requests on the other. Long
        #    answers (at least 0.4 s each at the simulated 400 tokens a second), so the kill lands
        #    while a's requests run: with 32 tokens a lone request could finish between the
        #    poll that saw it running and the kill, and nothing was retried
        port_a = port_of(a)
        prompts = [p for rnd in range(5, 7) for p in round_prompts(rnd)]
        retried_before = total(router.metrics(), "vllm_router_retries_total")

        async def burst_and_kill():
            task = asyncio.ensure_future(_burst(router.url, prompts, KILL_TOKENS))
            await asyncio.to_thread(wait_for, lambda: total(samples(a.url + "/metrics"),
                                                            "vllm:num_requests_running") > 0, 20, "work on a")
            os.killpg(a.proc.pid, signal.SIGKILL)
            return await task

        outs = asyncio.run(burst_and_kill())
        a.proc.wait(10)
        check_outputs(outs, prompts, KILL_TOKENS)
        assert total(router.metrics(), "vllm_router_retries_total") > retried_before
        # 3. restarted on its port: healthy again, and the groups it held route to it again
        a = servers["a"] = tokentop(SIM, port=port_a)
        wait_for(lambda: httpx.get(router.url + "/health", timeout=5).status_code == 200, 30, "a healthy again")
        mine = [g for g, names in served_by.items() if names == {"a"}]
        replay = [prompt(g, r, OWN[g % 2]) for g in mine for r in range(GROUP)]
        check_outputs(burst(router.url, replay, 8), replay, 8)
        assert any('"POST /v1/completions HTTP/1.1" 200' in line for line in access_lines(a))
    finally:
        if router is not None:
            router.stop()
        a.stop()
        b.stop()


@pytest.mark.slow
def test_sglang_router_discovers_and_routes_to_tokentop(real_model_path):
    need("sglang_router", "sglang-router")
    a, b = tokentop(SIM), tokentop(SIM)
    router = None
    try:
        router = sglang_router([a.url, b.url], "--policy", "cache_aware")
        def models() -> list[str]:
            r = httpx.get(router.url + "/v1/models", timeout=5)     # text until a worker registers
            return [m["id"] for m in r.json()["data"]] if r.status_code == 200 else []

        wait_for(lambda: models() == [MODEL], 30, "the gateway to learn the model id from /server_info")
        # its completions take text only (prompt: a string or list of strings), chat as usual
        prompts = [f"Summarise report number {i} in one line." for i in range(3)] + \
            [[{"role": "user", "content": f"Say hello to user {i}."}] for i in range(3)]
        check_outputs(burst(router.url, prompts, 8), prompts, 8, server=a)
        for s in (a, b):
            lines = access_lines(s)
            assert any('"GET /server_info HTTP/1.1" 200' in line for line in lines)
            assert any('"GET /model_info HTTP/1.1" 200' in line for line in lines)
            # its gRPC probe opens with the HTTP/2 preface (PRI *), which an HTTP/1 server refuses
            assert not [line for line in lines if '" 404' in line and "PRI *" not in line]
        served = sum(total(samples(s.url + "/metrics"), "vllm:request_success_total") for s in (a, b))
        assert served == len(prompts)
    finally:
        if router is not None:
            router.stop()
        a.stop()
        b.stop()
