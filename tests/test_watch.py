"""`tokentop watch` (engine/watch, app/watch.py): against a real tokentop serve and a real
vllm-router; vLLM, SGLang and llama.cpp's server through fixtures.

The fixtures are written in each project's documented Prometheus exposition format, with the
metric names, types and labels their sources register (vLLM's vllm/v1/metrics/loggers.py,
SGLang's python/sglang/srt/metrics/collector.py, llama.cpp's tools/server/server.cpp); the
values are made up. No vLLM, SGLang or llama.cpp server runs here.
"""
from __future__ import annotations

import contextlib
import json
import math
import threading

import httpx
import pytest

from app.cli import main
from engine.watch.sources import Sample, apply_snapshot, from_metrics, look
from engine.watch.watcher import STALL_S, Watcher, _Track, quantile
from tests.serve_util import in_process_server

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5000.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 50.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name="meta-llama/Llama-3.1-8B-Instruct"} 90.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.025",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4000.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4000.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4000.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 80.0
"""

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="Qwen/Qwen2.5-7B-Instruct",tp_rank="0"} 8.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="Qwen/Qwen2.5-7B-Instruct",tp_rank="0"} 4.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="Qwen/Qwen2.5-7B-Instruct",tp_rank="0"} 0.5
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="Qwen/Qwen2.5-7B-Instruct",tp_rank="0"} 812.5
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="Qwen/Qwen2.5-7B-Instruct"} 20000.0
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.2",model_name="Qwen/Qwen2.5-7B-Instruct"} 10.0
sglang:time_to_first_token_seconds_bucket{le="0.4",model_name="Qwen/Qwen2.5-7B-Instruct"} 20.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="Qwen/Qwen2.5-7B-Instruct"} 20.0
sglang:time_to_first_token_seconds_count{model_name="Qwen/Qwen2.5-7B-Instruct"} 20.0
sglang:time_to_first_token_seconds_sum{model_name="Qwen/Qwen2.5-7B-Instruct"} 5.0
# HELP sglang:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE sglang:inter_token_latency_seconds histogram
sglang:inter_token_latency_seconds_bucket{le="0.02",model_name="Qwen/Qwen2.5-7B-Instruct"} 100.0
sglang:inter_token_latency_seconds_bucket{le="+Inf",model_name="Qwen/Qwen2.5-7B-Instruct"} 100.0
sglang:inter_token_latency_seconds_count{model_name="Qwen/Qwen2.5-7B-Instruct"} 100.0
sglang:inter_token_latency_seconds_sum{model_name="Qwen/Qwen2.5-7B-Instruct"} 1.5
"""

LLAMACPP = """\
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 700
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s.
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 41.5
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.125
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""


def _slot(i: int, busy: bool, decoded: int) -> dict:
    """One entry of llama.cpp's GET /slots, as its server answers it (params left out)."""
    return {"id": i, "n_ctx": 1024, "speculative": False, "is_processing": busy, "id_task": 180 + i,
            "n_prompt_tokens": 12, "n_prompt_tokens_processed": 12, "n_prompt_tokens_cache": 0,
            "next_token": [{"has_next_token": busy, "has_new_line": False, "n_remain": 40, "n_decoded": decoded}]}


@contextlib.contextmanager
def _fixture_server(pages: dict):
    """127.0.0.1 HTTP server answering GET path -> pages[path]() (str: text, else JSON; or a
    (status, body) pair); else 404."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = 404, "Not Found"
            if self.path in pages:
                status, body = 200, pages[self.path]()
                if isinstance(body, tuple):
                    status, body = body
            text = body if isinstance(body, str) else json.dumps(body)
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if text.startswith("{") else "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_llamacpp_tokens_count_while_its_requests_run():
    # llamacpp:tokens_predicted_total rises only when a request ends: the busy slots' decoded
    # tokens are added, so one long request shows a rate and no stall; an idle slot's are not
    decoded = [10]
    pages = {"/metrics": lambda: LLAMACPP, "/health": lambda: {"status": "ok"},
             "/slots": lambda: [_slot(0, True, decoded[0]), _slot(1, False, 33)],
             "/v1/models": lambda: {"object": "list", "data": [{"id": "/models/qwen2.5-coder-0.5b.gguf",
                                                                "object": "model", "owned_by": "llamacpp"}]}}
    with _fixture_server(pages) as url, httpx.Client() as client:
        first = look(client, url)
        decoded[0] = 25
        second = look(client, url)
    assert first.kind == "llamacpp" and first.slots == (1, 2)
    assert first.model == "qwen2.5-coder-0.5b.gguf"    # /metrics names none: /v1/models, a path's file
    assert (first.generated, second.generated) == (710, 725)
    t = _Track(url)
    for i in range(int(STALL_S) + 2):               # one request decoding all along: no stall
        t.add(Sample(url, float(i), True, kind="llamacpp", running=1, waiting=0, generated=700 + 15 * i))
    assert t.status().alerts == [] and t.status().tok_s == 15


@pytest.mark.slow
def test_a_real_llama_server_shows_a_rate_during_one_long_request(real_model_path):
    import os
    import shutil
    import socket
    import subprocess
    from engine.bench.llama_server import wait_healthy

    binary = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not binary or not os.path.exists(binary):
        pytest.skip("no llama-server binary (set LLAMA_SERVER; shared/models.md says how to build it)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    proc = subprocess.Popen([binary, "-m", str(real_model_path), "-np", "2", "-c", "2048", "-t", "1",
                             "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1], "--metrics", "--slots"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, 120, proc)
        long = threading.Thread(target=httpx.post, args=(url + "/v1/completions",), kwargs={
            "json": {"prompt": "def f(x):", "max_tokens": 400, "ignore_eos": True}, "timeout": 300})
        long.start()
        with httpx.Client() as client:
            from tests.waiting import wait_until
            first = wait_until(lambda: (s := look(client, url)).slots and s.slots[0] and s, 30,
                               "the request to start", poll=0.1)
            wait_until(lambda: look(client, url).generated > first.generated + 5, 30,
                       "tokens to be counted while the request runs", poll=0.2)
            during = look(client, url)
            assert during.slots[0] == 1 and during.running == 1      # it is still running
            assert during.model == real_model_path.name
        long.join(300)
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.mark.parametrize("text, kind, running, waiting, kv, generated", [
    (VLLM, "vllm", 3, 2, 0.25, 5000), (SGLANG, "sglang", 8, 4, 0.5, 20000), (LLAMACPP, "llamacpp", 1, 0, 0.125, 700),
])
def test_each_projects_names_are_read(text, kind, running, waiting, kv, generated):
    s = from_metrics("http://x", text)
    assert (s.kind, s.running, s.waiting, s.kv, s.generated) == (kind, running, waiting, kv, generated)


def test_percentiles_from_histograms_as_prometheus_computes_them():
    s = from_metrics("http://x", VLLM)
    assert quantile(0.5, s.ttft) == pytest.approx(0.1)              # exactly the 50th at 0.1
    assert quantile(0.9, s.ttft) == pytest.approx(0.25)
    assert quantile(0.95, s.ttft) == pytest.approx(0.25 + 0.25 * 0.5)   # linear inside (0.25, 0.5]
    assert quantile(0.5, s.itl) == pytest.approx(0.0175)
    assert quantile(0.5, []) is None and quantile(0.5, [(math.inf, 0.0)]) is None
    assert from_metrics("http://x", SGLANG).model == "Qwen/Qwen2.5-7B-Instruct"


def _sample(at: float, running: float, generated: float, up: bool = True) -> Sample:
    return Sample("http://x", at, up, kind="vllm", running=running, waiting=0, generated=generated)


def test_rates_and_a_stall():
    t = _Track("http://x")
    t.add(_sample(0.0, 2, 100))
    t.add(_sample(1.0, 2, 150))
    assert t.status().tok_s == 50 and not t.status().alerts
    for i in range(2, 2 + int(STALL_S)):               # running, and not one token more
        t.add(_sample(float(i), 2, 150))
    st = t.status()
    assert st.tok_s == 0 and st.tok_s_history[:2] == [50.0, 0.0]
    assert st.alerts == [f"stall: 2 running, no token generated for {STALL_S:.0f} s"]
    t.add(_sample(20.0, 0, 150))                       # idle is not a stall
    assert t.status().alerts == []


def test_down_and_imbalance_alerts():
    w = Watcher(["http://a", "http://b", "http://c"])
    try:
        for url, running in (("http://a", 9), ("http://b", 1)):
            w.tracks[url].add(Sample(url, 0.0, True, kind="vllm", running=running, waiting=0))
        w.tracks["http://c"].add(Sample("http://c", 0.0, False, error="connection refused"))
        a, b, c = w.status()
        assert a.alerts == b.alerts == ["imbalance: http://a has 9 requests, http://b 1"]
        assert c.state == "down" and c.alerts == ["down: connection refused"]
    finally:
        w.close()


@pytest.fixture(scope="module")
def server(real_model_path):
    with in_process_server(real_model_path, ["sim:slow:prefill=20000,decode=200"], max_active=4) as s:
        yield s


def test_once_json_against_a_real_tokentop_serve(server, capsys):
    engine, http = server
    for _ in range(3):
        assert httpx.post(http.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 5},
                          timeout=30).status_code == 200
    busy = threading.Thread(target=httpx.post, args=(http.url + "/v1/completions",),
                            kwargs={"json": {"prompt": "a longer one", "max_tokens": 300}, "timeout": 60})
    busy.start()                                        # generating while it looks twice
    try:
        rc = main(["watch", http.url, "--once", "--json", "--interval", "0.5"])
    finally:
        busy.join(60)
    assert rc == 0
    (s,) = json.loads(capsys.readouterr().out)
    assert (s["url"], s["kind"], s["state"], s["model"]) == (http.url, "tokentop", "up", http.api.model)
    assert s["running"] == 1 and s["waiting"] == 0 and s["kv_usage"] is not None and s["kv_usage"] > 0
    assert s["tok_s"] > 0 and s["ttft"]["p50"] is not None and s["itl"]["p99"] is not None
    assert s["alerts"] == [] and s["note"] == ""
    # read from /snapshot: its worker, and percentiles from the engine's own records
    assert s["source"] == "snapshot"
    (w,) = s["engine_workers"]
    assert (w["name"], w["state"], w["running"], w["max_active"]) == ("sim:slow", "ready", 1, 4)
    assert w["decode_tps"] > 0
    assert set(s["ttft"]) == {"p50", "p95", "p99"} and s["e2e"]["p50"] is not None
    n, window = s["latency_counts"]["ttft"]
    assert n >= 3 and window in ("60s", "session")
    # nearest rank: each percentile is a TTFT some request had (as its worker measured it, or as
    # the facade saw it while it ran)
    with engine.lock:
        recs = list(engine.requests.records.values())
    had = {r.metrics.ttft for r in recs if r.metrics} | {r.first_token_at - r.arrival for r in recs
                                                          if r.first_token_at is not None}
    assert all(any(abs(v - t) < 1e-9 for t in had) for v in s["ttft"].values())


def test_once_text_names_a_down_server(server, capsys):
    _, http = server
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    assert main(["watch", http.url, dead, "--once", "--interval", "0.2"]) == 1
    out = capsys.readouterr().out
    assert f"{http.url}  tokentop  up" in out and f"{dead}  ?  down" in out and "! down:" in out


@pytest.fixture(scope="module")
def keyed_server(real_model_path):
    """A tokentop serve with --api-key, one simulated worker and a remote one whose server is gone."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with in_process_server(real_model_path, ["sim:near:prefill=20000,decode=500", f"remote:{gone}"],
                           api_key="sesame") as (engine, http):
        assert httpx.post(http.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                          headers={"Authorization": "Bearer sesame"}, timeout=30).status_code == 200
        yield engine, http


def _watch_once(capsys, *args) -> list[dict]:
    assert main(["watch", *args, "--once", "--json", "--interval", "0.3"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_keyed_servers_snapshot_with_its_key_shows_workers_and_alerts(keyed_server, capsys):
    _, http = keyed_server
    from tests.waiting import wait_until
    wait_until(lambda: httpx.get(http.url + "/snapshot", headers={"Authorization": "Bearer sesame"},
                                 timeout=5).json()["alerts"], 20, "the remote-down alert", poll=0.2)
    (s,) = _watch_once(capsys, http.url, "--api-key", "sesame")
    assert s["source"] == "snapshot" and s["note"] == ""
    near, far = s["engine_workers"]
    assert (near["state"], far["state"]) == ("ready", "down") and far["message"]
    assert any(a.startswith("remote-down: ") for a in s["alerts"])
    assert s["ttft"]["p50"] is not None and s["latency_counts"]["ttft"][0] >= 1


def test_a_refused_snapshot_falls_back_to_metrics_and_says_so(keyed_server, capsys):
    _, http = keyed_server
    (s,) = _watch_once(capsys, http.url)                      # no key: /snapshot answers 401
    assert s["kind"] == "tokentop" and s["state"] == "up" and s["source"] == "metrics"
    assert "--api-key" in s["note"] and s["engine_workers"] == []
    assert set(s["ttft"]) == {"p50", "p90", "p99"} and s["ttft"]["p50"] is not None   # the histograms'
    (s,) = _watch_once(capsys, http.url, "--api-key", "wrong")
    assert s["source"] == "metrics" and "refused the API key" in s["note"]
    assert main(["watch", http.url, "--once", "--interval", "0.3"]) == 0
    assert "/snapshot wants the server's API key" in capsys.readouterr().out


def test_an_older_server_without_snapshot_is_read_from_metrics(server, capsys):
    """An older tokentop: its real /metrics and /health (proxied), and no /snapshot (404)."""
    _, http = server
    pages = {"/metrics": lambda: httpx.get(http.url + "/metrics", timeout=5).text,
             "/health": lambda: httpx.get(http.url + "/health", timeout=5).json()}
    with _fixture_server(pages) as url:
        (s,) = _watch_once(capsys, url)
    assert s["kind"] == "tokentop" and s["state"] == "up"
    assert s["source"] == "metrics" and s["note"] == "" and s["engine_workers"] == []


def test_a_snapshot_of_another_shape_changes_nothing(server):
    _, http = server
    snap = httpx.get(http.url + "/snapshot", timeout=5).json()
    sample = Sample("http://x", 0.0, True, kind="tokentop", running=7.0)
    for bad in ({**snap, "version": 2}, {**snap, "workers": [{"name": "w"}]}, [], {**snap, "latency": {}}):
        with pytest.raises((KeyError, TypeError, ValueError)):
            apply_snapshot(sample, bad)
        assert sample.running == 7.0 and sample.source == "metrics" and sample.engine_workers == []
    apply_snapshot(sample, snap)
    assert sample.source == "snapshot" and [w["name"] for w in sample.engine_workers] == ["sim:slow"]


def test_a_routers_workers_are_not_weighed_against_servers_beside_it():
    w = Watcher(["http://r", "http://a", "http://b", "http://llama"])
    try:
        w.tracks["http://r"].add(Sample("http://r", 0.0, True, kind="vllm-router", workers=[
            {"url": "http://a/", "healthy": True, "load": 0}, {"url": "http://b", "healthy": True, "load": 0}]))
        for url, kind, running in (("http://a", "tokentop", 0), ("http://b", "tokentop", 0),
                                   ("http://llama", "llamacpp", 9)):
            w.tracks[url].add(Sample(url, 0.0, True, kind=kind, running=running, waiting=0))
        assert [s.alerts for s in w.status()] == [[], [], [], []]
        w.tracks["http://c"] = _Track("http://c")      # a server beside it, not the router's
        w.tracks["http://c"].add(Sample("http://c", 0.0, True, kind="vllm", running=1, waiting=0))
        alerts = {s.url: s.alerts for s in w.status()}
        assert alerts["http://llama"] == alerts["http://c"] == ["imbalance: http://llama has 9 requests, http://c 1"]
        assert alerts["http://a"] == alerts["http://b"] == []
    finally:
        w.close()


async def test_the_dashboard_shows_one_group_per_server(server):
    from app.watch import WatchApp

    _, http = server
    app = WatchApp(Watcher([http.url]), interval=0.2)
    async with app.run_test() as pilot:
        for _ in range(50):
            await pilot.pause(0.1)
            text = str(app.panels[http.url].render())
            if "tokentop  up" in text and "sim:slow  ready" in text:
                break
        assert f"{http.url}  tokentop  up" in text and "running" in text
        assert "  sim:slow  ready  run " in text       # its worker, from /snapshot


def test_bad_watch_flags_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["watch", "localhost:8000"])
    assert e.value.code == 2 and "write the server's URL" in capsys.readouterr().err
    assert main(["watch", "http://127.0.0.1:1", "--json"]) == 2
    assert "--json prints one snapshot: add --once" in capsys.readouterr().err
    assert main(["watch", "http://127.0.0.1:1", "--once", "--api-key", " "]) == 2
    assert "--api-key is empty" in capsys.readouterr().err


@pytest.mark.slow
def test_once_against_a_real_vllm_router(real_model_path, capsys):
    from tests.fleet_util import need, tokentop, vllm_router

    need("vllm_router", "vllm-router")
    a = tokentop("sim:r:prefill=20000,decode=2000")
    router = None
    try:
        router = vllm_router([a.url], "--policy", "round_robin")
        assert httpx.post(router.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                          timeout=30).status_code == 200
        metrics_url = f"http://127.0.0.1:{router.metrics_port}"
        assert main(["watch", router.url, metrics_url, a.url, "--once", "--json", "--interval", "0.3"]) == 0
        front, prom, worker = json.loads(capsys.readouterr().out)
        assert front["kind"] == "vllm-router" and front["state"] == "up"
        assert front["workers"] == [{"url": a.url, "healthy": True, "load": 0}]
        assert prom["kind"] == "vllm-router" and prom["state"] == "up"
        assert worker["kind"] == "tokentop" and worker["state"] == "up"
    finally:
        if router is not None:
            router.stop()
        a.stop()
