"""The endpoints fleet routers call on a worker (engine/serve/router_api.py), on a real server.

vllm-router's render calls and /get_load, SGLang gateway's server and model info: each
checked for the fields those routers read, and the token ids against this server's own
/tokenize (what /v1/completions would feed the model). Simulated workers keep it fast; the
tokenizer is the real bundled model's.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.serve_util import in_process_server

FAST = ["sim:gpu0:prefill=20000,decode=4000", "sim:gpu1:prefill=20000,decode=4000"]
GENERATE_REQUEST_FIELDS = {"request_id", "token_ids", "features", "sampling_params", "model", "stream",
                           "stream_options", "cache_salt", "priority", "kv_transfer_params"}


@pytest.fixture(scope="module")
def server(real_model_path):
    with in_process_server(real_model_path, FAST, max_active=4, max_context=512) as s:
        yield s


def post(http, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(http.url + path, json=body, timeout=30, **kw)


def test_completion_render_is_vllms_list_of_generate_requests(server):
    engine, http = server
    r = post(http, "/v1/completions/render", {"model": http.api.model, "prompt": "def add(a, b):",
                                              "temperature": 0.5, "stop": ["\n\n"], "seed": 7})
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and len(out) == 1
    g = out[0]
    assert set(g) == GENERATE_REQUEST_FIELDS
    assert g["request_id"].startswith("cmpl-")
    want = post(http, "/tokenize", {"prompt": "def add(a, b):"}).json()["tokens"]
    assert g["token_ids"] == want
    sp = g["sampling_params"]
    assert sp["max_tokens"] == 16            # OpenAI's and vLLM's completion default
    assert (sp["temperature"], sp["stop"], sp["seed"], sp["n"]) == (0.5, ["\n\n"], 7, 1)
    assert g["model"] == http.api.model and g["stream"] is False and g["stream_options"] is None


def test_completion_render_one_entry_per_prompt_and_token_ids_as_given(server):
    engine, http = server
    r = post(http, "/v1/completions/render", {"prompt": ["first prompt", "a second one"], "max_tokens": 5})
    assert r.status_code == 200, r.text
    a, b = r.json()
    assert a["token_ids"] == post(http, "/tokenize", {"prompt": "first prompt"}).json()["tokens"]
    assert b["token_ids"] == post(http, "/tokenize", {"prompt": "a second one"}).json()["tokens"]
    assert a["request_id"] != b["request_id"] and a["sampling_params"]["max_tokens"] == 5
    r = post(http, "/v1/completions/render", {"prompt": [1, 2, 3]})
    assert [g["token_ids"] for g in r.json()] == [[1, 2, 3]]


def test_chat_render_is_one_generate_request_with_the_templated_ids(server):
    engine, http = server
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    r = post(http, "/v1/chat/completions/render", {"messages": messages, "stream": True,
                                                   "stream_options": {"include_usage": True},
                                                   "cache_salt": "tenant-a"})
    assert r.status_code == 200, r.text
    g = r.json()
    assert set(g) == GENERATE_REQUEST_FIELDS and g["request_id"].startswith("chatcmpl-")
    assert g["token_ids"] == post(http, "/tokenize", {"messages": messages}).json()["tokens"]
    _, ctx = engine.capacity()
    assert g["sampling_params"]["max_tokens"] == ctx - len(g["token_ids"])   # chat: all that fits
    assert g["stream"] is True and g["stream_options"] == {"include_usage": True}
    assert g["cache_salt"] == "tenant-a"


@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/completions/render", {"prompt": "hi", "model": "nope"}, 404, "does not exist"),
    ("/v1/completions/render", {"prompt": "x " * 600}, 400, "context is 512 tokens"),
    ("/v1/completions/render", {"prompt": "hi", "max_tokens": 10_000}, 400, "ask for at most"),
    ("/v1/chat/completions/render", {"messages": "hi"}, 400, "'messages' must be a list"),
    ("/v1/completions/render", {"max_tokens": 3}, 400, "'prompt' is required"),
])
def test_render_refuses_what_completions_would_refuse(server, path, body, status, words):
    _, http = server
    r = post(http, path, body)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]


def test_get_load_counts_requests_running_and_waiting(real_model_path):
    # slow decode: a request stays running long enough to be seen
    with in_process_server(real_model_path, ["sim:slow:prefill=5000,decode=40"], max_active=1) as (engine, http):
        assert httpx.get(http.url + "/get_load", timeout=10).json()["load"] == 0
        done = []

        def one():
            done.append(post(http, "/v1/completions", {"prompt": "hello", "max_tokens": 40}).status_code)

        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        deadline, seen = time.monotonic() + 10, {}
        while time.monotonic() < deadline and (seen.get("load"), seen.get("num_waiting_reqs")) != (3, 2):
            seen = httpx.get(http.url + "/get_load", timeout=10).json()
            time.sleep(0.05)
        assert seen["load"] == 3 and seen["num_waiting_reqs"] == 2     # one runs (max_active 1)
        for t in threads:
            t.join(30)
        assert done == [200, 200, 200]
        assert httpx.get(http.url + "/get_load", timeout=10).json()["load"] == 0


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info_has_what_sglangs_gateway_reads(server, real_model_path, path):
    engine, http = server
    info = httpx.get(http.url + path, timeout=10).json()
    # sgl-model-gateway's ServerInfo: model_id (or its alias model, never both), model_path,
    # served_model_name, dp_size and the limits, all optional, integers unsigned
    assert info["model_id"] == info["served_model_name"] == http.api.model and "model" not in info
    assert info["model_path"] == str(real_model_path)
    assert info["dp_size"] == 1
    assert info["max_running_requests"] == engine.capacity()[0] == 8
    snap = engine.snapshot()
    assert info["max_total_tokens"] == sum(w.pages_total * w.page_size for w in snap.workers) > 0
    assert info["max_prefill_tokens"] > 0 and info["context_length"] == 512


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
def test_model_info_has_what_sglangs_gateway_reads(server, real_model_path, path):
    _, http = server
    info = httpx.get(http.url + path, timeout=10).json()
    assert info["model_path"] == info["tokenizer_path"] == str(real_model_path)
    assert info["model_type"] == "qwen2" and info["is_generation"] is True


def test_with_an_api_key_render_and_info_need_it_and_load_stays_open(real_model_path):
    with in_process_server(real_model_path, FAST[:1], api_key="sekret") as (_, http):
        for path, method in (("/v1/completions/render", "POST"), ("/v1/chat/completions/render", "POST"),
                             ("/server_info", "GET"), ("/model_info", "GET")):
            r = httpx.request(method, http.url + path, json={"prompt": "hi", "messages": []}, timeout=10)
            assert r.status_code == 401, (path, r.text)
        ok = post(http, "/v1/completions/render", {"prompt": "hi"}, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.json()[0]["token_ids"]
        assert httpx.get(http.url + "/get_load", timeout=10).status_code == 200
