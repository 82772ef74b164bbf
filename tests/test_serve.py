"""`tokentop serve` with simulated workers: errors, metrics, 429, API key, disconnects.

Simulated workers (labelled as such) make the load fast; the tokenizer and KV geometry come
from the real bundled model file. Correctness of generated text is in test_serve_model.py.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.serve.protocol import ApiError, parse_chat, parse_completion
from tests.serve_util import in_process_server

FAST = ["sim:gpu0:prefill=20000,decode=4000", "sim:gpu1:prefill=20000,decode=4000"]


def client(http, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=http.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                         timeout=30, **kw)


def metrics(url: str) -> dict:
    """{(name, frozenset(labels)): value} of every sample on /metrics, parsed by prometheus_client."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(samples: dict, name: str, **match) -> float:
    return sum(v for (n, labels), v in samples.items()
               if n == name and all((k, want) in labels for k, want in match.items()))


def wait_idle(engine, timeout: float = 20.0) -> None:
    """Until nothing is outstanding and every worker reports every KV page free."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = engine.snapshot()
        if engine.outstanding() == 0 and all(w.pages_used == 0 and w.running == 0 and w.waiting == 0
                                             for w in snap.workers):
            return
        time.sleep(0.1)
    snap = engine.snapshot()
    raise AssertionError(f"engine not idle: outstanding {engine.outstanding()}, "
                         f"pages used {[w.pages_used for w in snap.workers]}")


@pytest.fixture(scope="module")
def sim_server(real_model_path):
    with in_process_server(real_model_path, FAST, max_active=32, max_queue=1000) as s:
        yield s


# --- parsing (no server) ---------------------------------------------------------------
@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens", "must be an integer"),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens", "must be an integer"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature", "must be a number"),
    ({"prompt": "hi", "stream": 1}, "stream", "true or false"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "at least 1"),
    ({"prompt": "hi", "max_tokens": -3}, "max_tokens", "at least 1"),
    ({"prompt": "   "}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"max_tokens": 3}, "prompt", "required"),
    ({"prompt": "hi", "n": 2}, "n", "must be 1"),
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(65)]}, "stop", "up to 64 strings"),
    ({"prompt": "hi", "stop": ["x" * 257]}, "stop", "up to 256 characters"),
    ({"prompt": "hi", "stop": ["a", ""]}, "stop", "non-empty"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs", "between 0 and 20"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "only allowed"),
    ({"prompt": "hi", "cache_salt": 7}, "cache_salt", "must be a string"),
    ({"prompt": "hi", "cache_salt": ""}, "cache_salt", "non-empty"),
    ({"prompt": "hi", "speculate": "magic"}, "speculate", "must be one of"),
    ({"prompt": "hi", "spec_k": 99}, "spec_k", "0-16"),
    ({"prompt": "hi", "logit_bias": {"5": 100}}, "logit_bias", "not supported"),
    ({"prompt": "hi", "response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ({"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
    ({"prompt": "hi", "spec_tv_budget": 2}, "spec_tv_budget", "[0, 1]"),
])
def test_completion_parse_refuses_with_the_field_and_the_fix(body, param, words):
    with pytest.raises(ApiError) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message


def test_speculation_settings_reach_the_request():
    p = parse_completion({"prompt": "hi", "speculate": "ngram", "spec_k": 4, "spec_tv_budget": 0.5}).params
    assert (p.speculate, p.spec_k, p.spec_tv_budget) == ("ngram", "4", 0.5)
    p = parse_completion({"prompt": "hi", "spec_k": "adaptive:cost"}).params
    assert p.spec_k == "adaptive:cost" and p.speculate == "" and p.spec_tv_budget is None


def test_any_number_of_stops_up_to_the_cap_reach_the_request():
    codex = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
    assert parse_completion({"prompt": "hi", "stop": codex}).params.stop == tuple(codex)
    many = [f"{i:03d}" + "x" * 253 for i in range(64)]
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "stop": many}).params.stop == tuple(many)


def test_cache_salt_reaches_the_request():
    assert parse_completion({"prompt": "hi", "cache_salt": "tenant-a"}).params.cache_salt == "tenant-a"
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}).params.cache_salt is None


def test_chat_parse_accepts_text_parts_and_max_completion_tokens():
    p = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}],
                    "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3, "seed": 1})
    assert p.messages[0]["content"] == "ab" and p.params.max_tokens == 7 and p.params.logprobs == 3
    with pytest.raises(ApiError, match="top_logprobs"):
        parse_chat({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    # the harmless values of fields this server does not implement pass
    parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "none",
                "response_format": {"type": "text"}, "logit_bias": {}})


# --- errors over HTTP, with the real client ----------------------------------------------
def test_every_error_is_openai_shaped_and_queues_nothing(sim_server):
    engine, http = sim_server
    c = client(http)
    before = total(metrics(http.url), "tokentop:routing_decisions_total")
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="qwen2.5-coder-0.5b", prompt="hi", max_tokens=0)
    assert "max_tokens" in e.value.message and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="exceed the context of 1024"):
        c.completions.create(model="qwen2.5-coder-0.5b", prompt="hi", max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match="exceed the context"):
        c.chat.completions.create(model="qwen2.5-coder-0.5b", max_completion_tokens=1020,
                                  messages=[{"role": "user", "content": "hello there"}])
    with pytest.raises(openai.BadRequestError, match="prompt.*context is 1024"):
        c.completions.create(model="qwen2.5-coder-0.5b", prompt="word " * 1100, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="empty"):
        c.completions.create(model="qwen2.5-coder-0.5b", prompt="")
    with pytest.raises(openai.BadRequestError, match="messages is empty"):
        c.chat.completions.create(model="qwen2.5-coder-0.5b", messages=[])
    with pytest.raises(openai.BadRequestError, match="role"):
        c.chat.completions.create(model="qwen2.5-coder-0.5b", messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.NotFoundError, match="GET /v1/models lists") as e:
        c.completions.create(model="gpt-4o", prompt="hi")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="must be a number"):
        c.completions.create(model="qwen2.5-coder-0.5b", prompt="hi", extra_body={"temperature": "warm"})
    with pytest.raises(openai.BadRequestError, match="n' must be 1"):
        c.completions.create(model="qwen2.5-coder-0.5b", prompt="hi", n=3)
    # what the client library cannot send: bad JSON, a non-object, an oversized body
    url = http.url + "/v1/completions"
    r = httpx.post(url, content=b'{"prompt": "hi",', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url, json=["hi"])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = httpx.post(url, json={"prompt": "x" * (5 * 2**20)})
    assert r.status_code == 413 and "(`max_body`)" in r.json()["error"]["message"]
    r = httpx.get(http.url + "/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    after = metrics(http.url)
    assert total(after, "tokentop:routing_decisions_total") == before      # nothing was queued
    assert total(after, "tokentop:http_rejected_requests_total") >= 14
    assert engine.outstanding() == 0


def test_tokenize_counts_what_the_completion_endpoints_feed_the_model(sim_server):
    engine, http = sim_server
    url = http.url + "/tokenize"
    r = httpx.post(url, json={"model": "qwen2.5-coder-0.5b", "prompt": "hello world"}).json()
    assert r["tokens"] == engine.tokenizer.encode("hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 1024
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(url, json={"messages": messages}).json()
    assert r["count"] == len(engine.tokenizer.encode_chat(messages, add_generation_prompt=True))
    for body, status, words in (({"model": "nope", "prompt": "x"}, 404, "does not exist"),
                                ({"prompt": "x", "messages": messages}, 400, "exactly one"),
                                ({"prompt": "  "}, 400, "empty"),
                                ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "role")):
        r = httpx.post(url, json=body)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text


def test_models_and_health(sim_server):
    engine, http = sim_server
    models = client(http).models.list()
    assert [m.id for m in models.data][0] == "qwen2.5-coder-0.5b"
    assert httpx.get(http.url + "/health").json() == {"status": "ok"}


def test_stream_shape_with_usage(sim_server):
    _, http = sim_server
    lines = []
    with httpx.stream("POST", http.url + "/v1/completions", json={
            "prompt": "hello", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(ch["usage"] is None for ch in chunks[:-1])
    assert "".join(ch["choices"][0]["text"] for ch in chunks[:-1]) == " sim" * 4   # simulated tokens


# --- metrics agree with the engine --------------------------------------------------------
def test_metrics_agree_with_the_engine_snapshot_after_a_burst(sim_server):
    engine, http = sim_server
    wait_idle(engine)
    before = metrics(http.url)
    old_ids = {r.id for r in engine.snapshot().requests}
    c = openai.AsyncOpenAI(base_url=http.url + "/v1", api_key="none", max_retries=0, timeout=30)

    async def one(i):
        if i % 2:
            return await c.completions.create(model="qwen2.5-coder-0.5b", prompt=f"request {i} " * (i + 1),
                                              max_tokens=3 + i % 5)
        stream = await c.chat.completions.create(model="qwen2.5-coder-0.5b", max_tokens=2 + i % 4, stream=True,
                                                 messages=[{"role": "user", "content": f"hi {i}"}])
        async for _ in stream:
            pass

    async def burst():
        await asyncio.gather(*(one(i) for i in range(24)))
        await c.close()

    asyncio.run(burst())
    wait_idle(engine)
    after = metrics(http.url)
    snap = engine.snapshot()
    new = [r for r in snap.requests if r.id not in old_ids]
    assert len(new) == 24 and all(r.state == "finished" for r in new)

    def delta(name, **m):
        return total(after, name, **m) - total(before, name, **m)

    assert delta("vllm:prompt_tokens_total") == sum(r.prompt_tokens for r in new)
    assert delta("vllm:generation_tokens_total") == sum(r.output_tokens for r in new)
    assert delta("vllm:request_success_total", finished_reason="length") == 24
    assert delta("vllm:e2e_request_latency_seconds_count") == 24
    assert delta("vllm:time_to_first_token_seconds_count") == 24
    assert delta("vllm:inter_token_latency_seconds_count") == sum(r.output_tokens - 1 for r in new)
    assert delta("tokentop:routing_decisions_total", policy="cost") == 24
    for w in snap.workers:       # per-worker series carry the worker's name
        mine = [r for r in new if r.worker == w.index]
        assert delta("vllm:prompt_tokens_total", worker=w.name) == sum(r.prompt_tokens for r in mine)
        assert total(after, "vllm:num_requests_running", worker=w.name) == 0
        assert total(after, "vllm:kv_cache_usage_perc", worker=w.name) == 0
        assert total(after, "tokentop:worker_state", worker=w.name, state="ready") == 1
    # the prefix cache's counters, under vLLM's names, as the workers last reported them
    for _ in range(2):
        client(http).completions.create(model="qwen2.5-coder-0.5b", prompt="The quick brown fox. " * 60,
                                        max_tokens=2)
    wait_idle(engine)
    time.sleep(0.5)              # a stats report after the last request
    after = metrics(http.url)
    snap = engine.snapshot()
    assert sum(w.prefix["prefix_cache_queries"] for w in snap.workers) > 0
    for w in snap.workers:
        assert total(after, "vllm:prefix_cache_queries_total", worker=w.name) == w.prefix["prefix_cache_queries"]
        assert total(after, "vllm:prefix_cache_hits_total", worker=w.name) == w.prefix["prefix_cache_hits"]


# --- disconnects ----------------------------------------------------------------------------
# 500 tokens/s a worker: the server, not this process's client, sets the pace. At FAST's 4000 a
# slow machine's client can read every stream's 48 tokens after they have all been generated,
# and then no quitter has anything left to abort
PACED = ["sim:gpu0:prefill=20000,decode=500", "sim:gpu1:prefill=20000,decode=500"]


@pytest.fixture
def paced_server(real_model_path):
    with in_process_server(real_model_path, PACED, max_active=32, max_queue=1000) as s:
        yield s


def test_200_streams_with_a_third_disconnecting_free_every_page(paced_server):
    engine, http = paced_server
    wait_idle(engine)
    rng = random.Random(14)
    quitters = set(rng.sample(range(200), 67))
    outcome = {}

    async def one(c, i):
        stream = await c.completions.create(model="qwen2.5-coder-0.5b", prompt=f"stream {i} " * 8,
                                            max_tokens=48, stream=True)
        n = 0
        stop_after = rng.randint(0, 40) if i in quitters else None
        async for chunk in stream:
            if stop_after is not None and n >= stop_after:
                await stream.close()        # the client goes away mid-stream
                outcome[i] = "left"
                return
            n += len(chunk.choices[0].text) and 1
        outcome[i] = n

    async def run():
        async with openai.AsyncOpenAI(base_url=http.url + "/v1", api_key="none", max_retries=0,
                                      timeout=60) as c:
            await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(200))), 90)

    asyncio.run(run())
    wait_idle(engine)                       # every page free, nothing running or waiting
    snap = engine.snapshot()
    assert not [r for r in snap.requests if r.state in ("queued", "prefill", "decode")]
    finished = [i for i in range(200) if i not in quitters]
    assert all(outcome[i] == 48 for i in finished)
    mine = snap.requests[-200:]
    assert {r.state for r in mine} <= {"finished", "aborted"}
    # a quitter whose stream had already been generated in full has nothing left to abort
    assert 20 <= sum(r.state == "aborted" for r in mine) <= len(quitters)


def test_whole_response_client_timeout_aborts_the_request(real_model_path):
    slow = ["sim:slow:prefill=1000,decode=5"]
    with in_process_server(real_model_path, slow, max_active=2) as (engine, http):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(http.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 200}, timeout=0.5)
        wait_idle(engine, 10)
        assert [r.state for r in engine.snapshot().requests] == ["aborted"]


# --- queue limit and API key ----------------------------------------------------------------
def test_429_past_the_queue_limit_and_bearer_key(real_model_path):
    slow = ["sim:slow:prefill=1000,decode=20"]
    with in_process_server(real_model_path, slow, max_active=1, max_queue=1, api_key="s3cret") as (engine, http):
        with pytest.raises(openai.AuthenticationError, match=r"\(`api_key`\)"):
            client(http, api_key="wrong").completions.create(model="qwen2.5-coder-0.5b", prompt="hi")
        c = client(http, api_key="s3cret")
        running = c.completions.create(model="qwen2.5-coder-0.5b", prompt="a", max_tokens=40, stream=True)
        waiting = c.completions.create(model="qwen2.5-coder-0.5b", prompt="b", max_tokens=40, stream=True)
        with pytest.raises(openai.RateLimitError, match=r"\(`max_queue=1`\)") as e:
            c.completions.create(model="qwen2.5-coder-0.5b", prompt="c", max_tokens=4)
        assert e.value.status_code == 429
        running.close()
        waiting.close()
        wait_idle(engine, 10)
        assert c.completions.create(model="qwen2.5-coder-0.5b", prompt="d", max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(http.url + "/metrics").status_code == 200         # no key needed to scrape


def test_health_is_503_while_loading_then_200(real_model_path):
    from engine.config import EngineConfig, WorkerConfig
    from engine.facade.devices import parse_devices
    from engine.facade.engine import Engine
    from engine.serve.app import ServeConfig
    from engine.serve.server import HttpServer

    engine = Engine(EngineConfig(workers=parse_devices(["sim:gpu0"], WorkerConfig(model=str(real_model_path))),
                                 worker_mode="thread"))
    http = HttpServer(engine, ServeConfig(port=0), quiet=True).start()
    try:
        r = httpx.get(http.url + "/health", timeout=5)
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(http.url + "/v1/completions", json={"prompt": "hi"}, timeout=5)
        assert r.status_code == 503 and "still loading" in r.json()["error"]["message"]
        engine.start()
        assert httpx.get(http.url + "/health", timeout=5).status_code == 200
    finally:
        http.stop()
        engine.shutdown()


def test_busy_port_and_bad_remote_spec_are_one_line_errors():
    import socket
    import subprocess
    import sys

    from tests.serve_util import ROOT

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        for argv in (["--serve", f"127.0.0.1:{port}"], ["serve", "--port", str(port)],
                     ["serve", "--device", "remote:localhost:80"]):
            r = subprocess.run([sys.executable, "-m", "app.cli", *argv, "--device", "sim:gpu0"], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
            assert "Address already in use" in r.stderr or "remote:http://HOST:PORT" in r.stderr


def test_an_internal_fault_is_a_500_in_the_api_shape_and_logged(sim_server, monkeypatch):
    engine, http = sim_server

    def broken(*a, **k):
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(engine, "encode", broken)
    r = httpx.post(http.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert r.status_code == 500 and "tokenizer exploded" in r.json()["error"]["message"]
    assert any("tokenizer exploded" in line.text for line in engine.snapshot().log)


# --- the flight recorder, headless ------------------------------------------------------------
def test_post_trace_writes_the_flight_recorder_and_needs_the_key(tiny_model_path, tmp_path, monkeypatch):
    from tests.trace_checks import check_chrome_trace
    monkeypatch.chdir(tmp_path)                       # no --trace-dir: ./traces
    with in_process_server(tiny_model_path("qwen2", context_length=2048), FAST, api_key="sesame") as (engine, http):
        body = {"prompt": "traced request", "max_tokens": 4}
        auth = {"Authorization": "Bearer sesame"}
        model = http.api.model
        r = httpx.post(http.url + "/v1/completions", json={"model": model, **body}, headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        refused = httpx.post(http.url + "/trace", timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert not (tmp_path / "traces").exists()
        answer = httpx.post(http.url + "/trace", headers=auth, timeout=30)
        assert answer.status_code == 200, answer.text
        path = answer.json()["path"]
        assert any(line.text == f"trace written to {path} (POST /trace)" for line in engine.snapshot().log)
        ids = {r.id for r in engine.snapshot().requests}
    assert path.startswith(str(tmp_path / "traces"))
    document = json.load(open(path))
    assert check_chrome_trace(document) == []
    phases = [e["name"] for e in document["traceEvents"] if e["ph"] == "X" and e.get("args", {}).get("request") in ids]
    assert phases[0] == "queued" and phases[-1] == "finished"


def test_sigusr1_and_shutdown_write_the_trace(tiny_model_path, tmp_path):
    from tests.serve_util import ServeProcess
    model = tiny_model_path("qwen2", context_length=2048)
    traces = tmp_path / "traces"
    server = ServeProcess(["--model", str(model), "--worker-mode", "thread", "--trace-dir", str(traces),
                           "--device", FAST[0]], timeout=60)
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200, r.text
        os.kill(server.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 20
        while not any("trace written to" in line for line in server.lines) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.status_code == 200 and httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        server.stop()
    written = [line.split("trace written to ", 1)[1].strip() for line in server.lines if "trace written to" in line]
    assert len(written) == 2 and server.proc.returncode == 0, server.lines      # SIGUSR1, then on exit
    for path in written:
        events = json.load(open(path))["traceEvents"]
        assert any(e["name"] == "engine step" for e in events)
    assert sorted(os.listdir(traces)) == sorted(os.path.basename(p) for p in written)
