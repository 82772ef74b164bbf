"""Remote workers that serve another model: prompt lengths from their /tokenize (vLLM's and
tokentop's shape, llama.cpp's shape with /apply-template for chat), the labelled estimate when
there is none or it is slow, chat messages forwarded as messages, logprobs passed back; and
other clients' requests on a remote (its scraped queue) counted by the router.

The remotes here are small OpenAI-shaped servers on loopback (uvicorn, real HTTP) whose answers
are known, so every figure can be checked; one test uses a real `tokentop serve` of "another
model" (the same file under another name) for tokentop's own /tokenize.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import openai
import pytest

from engine.config import SamplingParams
from tests.serve_util import in_process_server

WORDS = ["alpha ", "beta ", "gamma ", "delta ", "eps ", "zeta ", "eta ", "theta "]


class FakeRemote:
    """An OpenAI-compatible server for "other-model" that streams WORDS, one token per chunk.
    tokenize: "openai" ({"model", "prompt"|"messages"} -> {"count"}: its count is the prompt's
    length in characters), "llamacpp" ({"content"} -> {"tokens"}: one token per character, and
    /apply-template), "slow" (the openai shape, answering after 2 s) or None (no /tokenize).
    logprob_shape: "completions" (tokens/token_logprobs/top_logprobs) or "chat" (content list,
    as llama.cpp sends for both endpoints)."""

    def __init__(self, tokenize: str | None, logprob_shape: str = "completions", owned_by: str = "x"):
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        from engine.serve.server import bind

        self.bodies: list[tuple[str, dict]] = []
        self.tokenize = tokenize
        self.foreign_waiting = 0          # what its /metrics says waits (other clients' requests)

        async def health(_):
            return JSONResponse({"status": "ok"})

        async def models(_):
            return JSONResponse({"object": "list", "data": [{"id": "other-model", "object": "model",
                                                             "owned_by": owned_by}]})

        async def tokenize_(request):
            body = await request.json()
            self.bodies.append(("/tokenize", body))
            if tokenize == "llamacpp":
                return JSONResponse({"tokens": list(range(len(body.get("content", ""))))})
            if tokenize == "slow":
                await asyncio.sleep(2)
            text = body.get("prompt") if "prompt" in body else template(body["messages"])
            return JSONResponse({"count": len(text), "max_model_len": 4096, "tokens": list(range(len(text)))})

        async def metrics(_):
            from starlette.responses import PlainTextResponse
            return PlainTextResponse("# TYPE vllm:num_requests_running gauge\n"
                                     'vllm:num_requests_running{model_name="other-model"} 0\n'
                                     "# TYPE vllm:num_requests_waiting gauge\n"
                                     f'vllm:num_requests_waiting{{model_name="other-model"}} {self.foreign_waiting}\n')

        async def apply_template(request):
            body = await request.json()
            self.bodies.append(("/apply-template", body))
            return JSONResponse({"prompt": template(body["messages"])})

        def template(messages):
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

        def logprobs(i):
            tok, lp = WORDS[i % len(WORDS)], -0.25 * (i + 1)
            if logprob_shape == "chat":
                return {"content": [{"id": i, "token": tok, "logprob": lp, "bytes": list(tok.encode()),
                                     "top_logprobs": [{"id": i, "token": tok, "logprob": lp},
                                                      {"id": 99, "token": "other", "logprob": lp - 1},
                                                      {"id": 98, "token": "third", "logprob": lp - 2}]}]}
            return {"tokens": [tok], "token_logprobs": [lp], "top_logprobs": [{"other": lp - 1, tok: lp,
                                                                                "third": lp - 2}],
                    "text_offset": [0]}

        async def complete(request):
            body = await request.json()
            path = request.url.path
            self.bodies.append((path, body))
            chat = path.endswith("chat/completions")
            want_lp = bool(body.get("logprobs")) or body.get("logprobs") == 0

            async def stream():
                for i in range(body["max_tokens"]):
                    tok = WORDS[i % len(WORDS)]
                    choice = ({"index": 0, "delta": {"content": tok}} if chat else {"index": 0, "text": tok})
                    choice.update(finish_reason=None, logprobs=logprobs(i) if want_lp else None)
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                    await asyncio.sleep(0.005)
                end = {"index": 0, "finish_reason": "length", **({"delta": {}} if chat else {"text": ""})}
                yield f"data: {json.dumps({'choices': [end]})}\n\n"
                usage = {"prompt_tokens": 7, "completion_tokens": body["max_tokens"],
                         "total_tokens": 7 + body["max_tokens"]}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(stream(), media_type="text/event-stream")

        routes = [Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
                  Route("/v1/completions", complete, methods=["POST"]),
                  Route("/v1/chat/completions", complete, methods=["POST"])]
        if tokenize:
            routes.append(Route("/tokenize", tokenize_, methods=["POST"]))
        if tokenize == "llamacpp":
            routes.append(Route("/apply-template", apply_template, methods=["POST"]))
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(Starlette(routes=routes), log_level="error", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()

    def calls(self, path: str) -> list[dict]:
        return [b for p, b in self.bodies if p == path]

    def stop(self):
        self.server.should_exit = True
        self.thread.join(5)


@pytest.fixture
def fake(request):
    remote = FakeRemote(*request.param)
    yield remote
    remote.stop()


def client(http) -> openai.OpenAI:
    return openai.OpenAI(base_url=http.url + "/v1", api_key="none", max_retries=0, timeout=30)


def decision_for(engine, rid: str):
    return next(d for d in engine.snapshot().routing if d.request_id == rid)


def the_request(engine):
    return engine.snapshot().requests[-1]


@pytest.mark.parametrize("fake", [("openai",), ("llamacpp",)], indirect=True)
def test_prompt_lengths_come_from_the_remotes_tokenize(real_model_path, fake):
    # the local worker is slow, so the cost policy sends to the remote (nominal rates)
    devices = [f"remote:{fake.url},name=far", "sim:near:prefill=50,decode=2"]
    with in_process_server(real_model_path, devices) as (engine, http):
        far = engine.snapshot().workers[0]
        assert far.state == "ready" and "the remote's /tokenize" in far.note, far.note
        probes = len(fake.calls("/tokenize"))
        assert probes >= 1                     # asked once on admission ...

        # a plain prompt: the remote counts the text it will be sent
        prompt = "Count these characters, please."
        out = client(http).completions.create(model=http_model(http), prompt=prompt, max_tokens=3)
        assert out.usage.completion_tokens == 3
        assert out.usage.prompt_tokens == 7          # what the remote computed, from its usage
        rid = the_request(engine).id
        assert the_request(engine).worker == 0
        d = decision_for(engine, rid)
        far_c = next(c for c in d.candidates if c.worker == 0)
        near_c = next(c for c in d.candidates if c.worker == 1)
        local = len(engine.tokenizer.encode(prompt))
        assert (far_c.prompt_tokens, far_c.prompt_source) == (len(prompt), "remote")
        assert (near_c.prompt_tokens, near_c.prompt_source) == (local, "local")
        assert far_c.prompt_tokens != local            # the two tokenizers disagree, as they would
        sent = fake.calls("/tokenize")[probes:]
        assert len(sent) == 1
        assert sent[0].get("prompt", sent[0].get("content")) == prompt

        # chat: the remote counts with its own template; the messages reach it as messages
        messages = [{"role": "user", "content": "hello there"}]
        out = client(http).chat.completions.create(model=http_model(http), messages=messages, max_tokens=2)
        assert out.choices[0].finish_reason == "length"
        rec = the_request(engine)
        assert rec.worker == 0
        want = len("<user>hello there<assistant>")
        assert (rec.prompt_tokens, rec.prompt_source) == (want, "remote")
        assert fake.calls("/v1/chat/completions")[-1]["messages"] == messages
        if far.note.endswith("(llama.cpp; it serves other-model)"):
            assert fake.calls("/apply-template")[-1]["messages"] == messages

        # the same prompt again is answered from the cache: no second call
        n = len(fake.calls("/tokenize"))
        engine.submit(prompt, params=SamplingParams(max_tokens=2)).result(20)
        assert len(fake.calls("/tokenize")) == n
        # the routing log says where each figure came from
        assert decision_for(engine, the_request(engine).id).to_json()["candidates"][0]["prompt_source"] == "remote"


def http_model(http) -> str:
    return client(http).models.list().data[0].id


@pytest.mark.parametrize("fake", [(None,)], indirect=True)
def test_no_tokenize_means_a_labelled_estimate(real_model_path, fake):
    devices = [f"remote:{fake.url},name=far", "sim:near:prefill=5000,decode=200"]
    with in_process_server(real_model_path, devices) as (engine, http):
        far = engine.snapshot().workers[0]
        assert "estimate" in far.note and "no /tokenize" in far.note
        h = engine.submit("Some prompt text", params=SamplingParams(max_tokens=2), worker=0)
        h.result(20)
        rec = the_request(engine)
        assert (rec.prompt_tokens, rec.prompt_source) == (len(engine.tokenizer.encode("Some prompt text")),
                                                          "estimate")
        c = next(c for c in decision_for(engine, rec.id).candidates if c.worker == 0)
        assert c.prompt_source == "estimate"


@pytest.mark.parametrize("fake", [("slow",)], indirect=True)
def test_a_slow_tokenize_falls_back_to_the_estimate_quickly(real_model_path, fake):
    from engine.remote.tokens import TOKENIZE_TIMEOUT

    devices = [f"remote:{fake.url},name=far", "sim:near:prefill=5000,decode=200"]
    with in_process_server(real_model_path, devices) as (engine, http):
        assert engine.snapshot().workers[0].state == "ready"
        t0 = time.monotonic()
        out = client(http).completions.create(model=http_model(http), prompt="a slow one", max_tokens=2)
        took = time.monotonic() - t0
        assert out.usage.completion_tokens == 2
        assert took < TOKENIZE_TIMEOUT + 1.5, took     # not the remote's 2 s
        rec = the_request(engine)
        c = next(c for c in decision_for(engine, rec.id).candidates if c.worker == 0)
        assert c.prompt_source == "estimate"
        assert any("/tokenize failed" in line.text for line in engine.snapshot().log)
        # while it backs off, the next request does not wait on it at all
        n = len(fake.calls("/tokenize"))
        t0 = time.monotonic()
        engine.submit("another slow one", params=SamplingParams(max_tokens=2)).result(20)
        assert time.monotonic() - t0 < 1.0 and len(fake.calls("/tokenize")) == n


@pytest.mark.parametrize("fake", [("openai", "completions"), ("llamacpp", "chat", "llamacpp")], indirect=True)
def test_logprobs_come_back_from_a_remote_in_openai_shape(real_model_path, fake):
    devices = [f"remote:{fake.url},name=far"]
    with in_process_server(real_model_path, devices) as (engine, http):
        c = client(http)
        model = http_model(http)
        out = c.completions.create(model=model, prompt="tell me", max_tokens=3, logprobs=2)
        body = fake.calls("/v1/completions")[-1]
        assert body["logprobs"] == 2
        assert ("n_probs" in body) == (fake.tokenize == "llamacpp")     # llama.cpp's own name too
        lp = out.choices[0].logprobs
        assert lp.tokens == WORDS[:3]
        assert lp.token_logprobs == [-0.25, -0.5, -0.75]
        assert lp.top_logprobs[0] == {"alpha ": -0.25, "other": -1.25}       # the 2 asked for
        assert lp.text_offset == [0, 6, 11]
        # streamed chat, top_logprobs 1: the chat shape, per chunk
        stream = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, logprobs=True, top_logprobs=1, stream=True)
        entries = [e for ch in stream for choice in ch.choices if choice.logprobs
                   for e in choice.logprobs.content]
        body = fake.calls("/v1/chat/completions")[-1]
        assert body["logprobs"] is True and body["top_logprobs"] == 1
        assert [(e.token, e.logprob) for e in entries] == [("alpha ", -0.25), ("beta ", -0.5)]
        assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in entries] == \
            [[("alpha ", -0.25)], [("beta ", -0.5)]]
        assert entries[0].bytes == list(b"alpha ")
        # not asked: not requested of the remote, none returned
        out = c.completions.create(model=model, prompt="tell me", max_tokens=2)
        assert "logprobs" not in fake.calls("/v1/completions")[-1] and out.choices[0].logprobs is None
        # the sampling fields go along (stop_token_ids only to a server of our model: not this one)
        c.completions.create(model=model, prompt="tell me", max_tokens=2, temperature=0.5, top_p=0.9, seed=7,
                             stop=["zz"], presence_penalty=0.5, frequency_penalty=0.25,
                             extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
                                         "cache_salt": "tenant", "stop_token_ids": [5]})
        body = fake.calls("/v1/completions")[-1]
        assert {k: body.get(k) for k in ("temperature", "top_p", "seed", "stop", "presence_penalty",
                                          "frequency_penalty", "top_k", "min_p", "repetition_penalty",
                                          "cache_salt", "stop_token_ids")} == \
            {"temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": ["zz"], "presence_penalty": 0.5,
             "frequency_penalty": 0.25, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
             "cache_salt": "tenant", "stop_token_ids": None}


def test_tokentop_remote_of_another_model_counts_with_its_tokenize(real_model_path, tmp_path):
    """A real `tokentop serve` whose model id differs (the same file under another name): the
    front probes its /tokenize, counts prompts there, and sends chat as messages."""
    other = tmp_path / "other-model.gguf"
    other.symlink_to(real_model_path)
    with in_process_server(other, ["sim:r:prefill=5000,decode=200"]) as (_, remote):
        with in_process_server(real_model_path, [f"remote:{remote.url},name=far"]) as (engine, http):
            w = engine.snapshot().workers[0]
            assert w.state == "ready" and w.model == "other-model" and "/tokenize" in w.note, w.note
            out = client(http).chat.completions.create(
                model=http_model(http), messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=3)
            assert out.usage.completion_tokens == 3
            rec = the_request(engine)
            want = len(engine.tokenizer.encode_chat([{"role": "user", "content": "What is 2+2?"}],
                                                    add_generation_prompt=True))
            assert (rec.prompt_tokens, rec.prompt_source) == (want, "remote")
            assert out.usage.prompt_tokens == want       # the remote's own count, the same tokenizer


@pytest.mark.parametrize("fake", [(None,)], indirect=True)
def test_other_clients_requests_on_a_remote_count_in_routing(real_model_path, fake):
    """Its /metrics says 200 requests wait there that are not ours: the router weighs them."""
    devices = [f"remote:{fake.url},name=far", "sim:near:prefill=50,decode=2"]
    with in_process_server(real_model_path, devices) as (engine, http):
        params = SamplingParams(max_tokens=3)
        assert engine.submit("first one", params=params).result(20).worker == 0   # idle: the remote
        fake.foreign_waiting = 200
        deadline = time.monotonic() + 10
        while engine.snapshot().workers[0].waiting < 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine.snapshot().workers[0].waiting == 200       # shown, as scraped
        h = engine.submit("second one", params=params)
        d = decision_for(engine, h.id)
        far = next(c for c in d.candidates if c.worker == 0)
        assert far.waiting == 200 and far.decode_tokens >= 200 * 3 and d.chosen == 1
        h.result(30)
        fake.foreign_waiting = 0                                # they drained: back to the remote
        deadline = time.monotonic() + 10
        while engine.snapshot().workers[0].waiting and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine.submit("third one", params=params).result(20).worker == 0
