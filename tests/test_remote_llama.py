"""llama.cpp's own `llama-server` as a remote worker, beside a local (simulated) one.

Needs a llama-server binary (docs: /work/shared/models.md builds it from the source vendored
in the llama-cpp-python sdist): set LLAMA_SERVER=/path/to/llama-server, or have it on PATH.
Skipped otherwise. Same GGUF file as ours, so prompts go as token ids.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import httpx
import pytest

from engine.config import SamplingParams
from tests.serve_util import in_process_server, wait_healthy

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]
MODEL = "qwen2.5-coder-0.5b"


@pytest.fixture(scope="module")
def llama_server(real_model_path):
    binary = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not binary or not os.path.exists(binary):
        pytest.skip("no llama-server binary (set LLAMA_SERVER; shared/models.md says how to build it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "-m", str(real_model_path), "--alias", MODEL, "-np", "4", "-c", "4096",
                             "-t", "2", "--host", "127.0.0.1", "--port", str(port), "--metrics"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 120, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(20)


def test_llama_server_behind_the_router(real_model_path, llama_server):
    devices = [f"remote:{llama_server},name=llama", "sim:local:prefill=5000,decode=200"]
    with in_process_server(real_model_path, devices, max_context=2048) as (engine, http):
        w = engine.snapshot().workers[0]
        assert w.state == "ready" and w.remote_url == llama_server and "same model" in w.note
        params = SamplingParams(max_tokens=8)
        forced = [engine.submit("The capital of France is", params=params, worker=0) for _ in range(2)]
        for h in forced:                 # its measured rates now stand in for the nominal ones
            h.result(120)
        burst = [engine.submit(f"Request {i}: count to ten.", params=params) for i in range(12)]
        results = [h.result(120) for h in forced + burst]
        assert {r.worker for r in results[2:]} == {0, 1}, "the cost policy used both workers"
        assert all(r.finish_reason in ("length", "stop") and r.error is None for r in results), \
            [r.error for r in results]
        paris = results[0]
        assert "Paris" in paris.text and paris.worker == 0        # llama.cpp's greedy answer, via us
        assert results[1].text == paris.text                      # greedy is greedy
        # its /metrics feeds the panel and the router's inputs
        deadline = time.monotonic() + 5
        while engine.snapshot().workers[0].kv_usage is None and time.monotonic() < deadline:
            time.sleep(0.2)
        w = engine.snapshot().workers[0]
        assert w.profile_prefill_tps > 0 and w.profile_decode_tps > 0
        metrics = httpx.get(llama_server + "/metrics").text
        assert "llamacpp:" in metrics


def test_llama_server_logprobs_through_our_api(real_model_path, llama_server):
    import openai

    with in_process_server(real_model_path, [f"remote:{llama_server},name=llama"]) as (engine, http):
        c = openai.OpenAI(base_url=http.url + "/v1", api_key="none", max_retries=0, timeout=120)
        out = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                   temperature=0, logprobs=2)
        lp = out.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
        assert "".join(lp.tokens) == out.choices[0].text
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)
        assert lp.top_logprobs[0][lp.tokens[0]] == pytest.approx(lp.token_logprobs[0])   # greedy: the top one
        stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                           max_tokens=3, temperature=0, logprobs=True, stream=True)
        entries = [e for ch in stream for choice in ch.choices if choice.logprobs
                   for e in choice.logprobs.content]
        assert len(entries) == 3 and all(e.logprob <= 0 and e.top_logprobs == [] for e in entries)


def test_llama_server_of_another_model_counts_prompts_with_its_tokenize(real_model_path, llama_server, tmp_path):
    """Our model file under another name: llama-server's alias no longer matches, so prompts go
    as text and chat messages, and their lengths come from its /tokenize (and /apply-template)."""
    import openai

    mine = tmp_path / "mine.gguf"
    mine.symlink_to(real_model_path)
    with in_process_server(mine, [f"remote:{llama_server},name=llama"], max_context=1024) as (engine, http):
        w = engine.snapshot().workers[0]
        assert w.state == "ready" and "/tokenize (llama.cpp" in w.note, w.note
        prompt = "Count the tokens of this prompt, please."
        engine.submit(prompt, params=SamplingParams(max_tokens=2), worker=0).result(120)
        rec = engine.snapshot().requests[-1]
        theirs = httpx.post(llama_server + "/tokenize", json={"content": prompt, "add_special": True}).json()
        assert (rec.prompt_tokens, rec.prompt_source) == (len(theirs["tokens"]), "remote")
        c = openai.OpenAI(base_url=http.url + "/v1", api_key="none", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is 2+2?"}]
        out = c.chat.completions.create(model="mine", messages=messages, max_tokens=3)
        rec = engine.snapshot().requests[-1]
        assert rec.worker == 0 and rec.prompt_source == "remote"
        assert out.usage.prompt_tokens == rec.prompt_tokens        # its count of its own template
        assert out.choices[0].message.content
