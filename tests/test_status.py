"""`GET /snapshot` on a real server, and `tokentop status` reading it (docs/snapshot.md)."""
from __future__ import annotations

import json

import httpx
import pytest

from app.cli import main
from app.status import status_text
from app.widgets.fmt import fmt_seconds
from engine.config import SamplingParams
from tests.fixtures.tiny_gguf import write_tiny_model
from tests.serve_util import in_process_server

DEVICES = ["sim:gpu0:prefill=20000,decode=2000", "sim:gpu1:prefill=20000,decode=2000"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny.gguf", "qwen2", context_length=1024)


@pytest.fixture(scope="module")
def server(model):
    with in_process_server(model, DEVICES) as (engine, http):
        for h in [engine.submit(f"request {i}", params=SamplingParams(max_tokens=6)) for i in range(5)]:
            h.result(30)
        yield engine, http


def test_snapshot_is_the_engines_picture_in_version_1(server):
    engine, http = server
    r = httpx.get(http.url + "/snapshot", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    snap = r.json()
    assert snap["version"] == 1
    assert set(snap) == {"version", "time", "uptime", "router_policy", "tracing", "workers", "requests",
                         "latency", "alerts", "alert_counts"}
    assert [w["name"] for w in snap["workers"]] == ["sim:gpu0", "sim:gpu1"]
    assert all(w["state"] == "ready" and w["kv"]["pages_total"] > 0 for w in snap["workers"])
    finished = [q for q in snap["requests"] if q["finish_reason"] == "length"]
    assert len(finished) == 5 and all(q["output_tokens"] == 6 for q in finished)
    assert "prompt" not in finished[0] and "text_tail" not in finished[0]     # no conversation leaves
    assert set(snap["latency"]) == {"10s", "60s", "session"}
    session = snap["latency"]["session"]
    assert session["seconds"] is None and session["overall"]["e2e"]["count"] == 5
    assert sum(t["e2e"]["count"] for t in session["workers"].values()) == 5
    ours = engine.snapshot().latency["session"].summary("ttft")
    assert session["overall"]["ttft"] == {"count": ours.count, "p50": ours.p50, "p95": ours.p95, "p99": ours.p99}
    assert snap["alerts"] == [] and snap["alert_counts"] == []


def test_status_prints_a_table_or_the_json(server, capsys):
    _, http = server
    assert main(["status", http.url]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"tokentop at {http.url}") and "2/2 workers ready" in lines[0]
    assert any(line.startswith("w0 gpu0") and " ready " in line for line in lines)
    assert any(line.startswith("w1 gpu1") for line in lines)
    assert "latency, the last 60 s" in out and lines[-1] == "no alerts"
    e2e = next(line for line in lines if line.startswith("e2e"))
    assert e2e.split()[-1] == "5"
    assert main(["status", http.url, "--json"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["version"] == 1 and len(snap["workers"]) == 2
    assert main(["status", http.url, "--window", "session"]) == 0
    assert "latency, the whole session" in capsys.readouterr().out


def test_status_text_shows_alerts_and_figures():
    snap = {"uptime": 65.0, "router_policy": "cost", "requests": [{"state": "decode"}],
            "workers": [{"index": 0, "name": "cpu", "state": "dead", "running": 0, "max_active": 8, "waiting": 0,
                         "prefill_tps": 0.0, "decode_tps": 0.0, "kv": {"usage": None}, "cpu_percent": None,
                         "rss_bytes": None}],
            "latency": {"60s": {"seconds": 60.0, "overall": {"ttft": {"count": 3, "p50": 0.02, "p95": 0.05,
                                                                        "p99": 0.05}}}},
            "alerts": [{"kind": "worker-dead", "message": "worker 0 (cpu) died: exit code -9"}]}
    text = status_text(snap, "http://x", "60s")
    assert "up 1m05s · 0/1 workers ready · 1 requests live" in text
    ttft = next(line for line in text.splitlines() if line.startswith("TTFT")).split()
    assert ttft == ["TTFT", fmt_seconds(0.02), fmt_seconds(0.05), fmt_seconds(0.05), "3"]
    assert text.splitlines()[-1] == "alert worker-dead: worker 0 (cpu) died: exit code -9"


def test_snapshot_needs_the_api_key_when_there_is_one(model, capsys):
    with in_process_server(model, DEVICES[:1], api_key="sesame") as (_, http):
        r = httpx.get(http.url + "/snapshot", timeout=10)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        ok = httpx.get(http.url + "/snapshot", headers={"Authorization": "Bearer sesame"}, timeout=10)
        assert ok.status_code == 200 and ok.json()["version"] == 1
        assert httpx.get(http.url + "/health", timeout=10).status_code == 200      # still open
        assert main(["status", http.url]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "wants an API key" in err
        assert main(["status", http.url, "--api-key", "sesame"]) == 0
        assert "1/1 workers ready" in capsys.readouterr().out


def test_status_of_nothing_is_one_line(capsys):
    assert main(["status", "http://127.0.0.1:9", "--timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot reach http://127.0.0.1:9" in err
