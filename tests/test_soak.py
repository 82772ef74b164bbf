"""`tokentop bench soak`: its ledgers and verdicts on synthetic samples (fast), and the soak
itself for two minutes on simulated workers and a real `tokentop serve` remote (slow)."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import time
from types import SimpleNamespace

import pytest

from engine.bench.soak_checks import (
    ABORTED,
    DISCONNECTED,
    FAILED,
    FINISHED,
    EngineLedger,
    Ledger,
    cached_pages,
    fd_verdict,
    growth,
    held_pages,
    pages_verdict,
    rss_verdict,
    table_verdict,
)
from engine.kv.states import CACHED, FREE, SHARED, USED


# --- the ledgers ---------------------------------------------------------------------------
def test_the_ledger_counts_each_outcome_once_and_names_what_is_still_open():
    ledger = Ledger()
    numbers = [ledger.open(f"request {i}") for i in range(6)]
    ledger.close(numbers[0], FINISHED)
    ledger.close(numbers[1], ABORTED)
    ledger.close(numbers[2], DISCONNECTED)
    ledger.close(numbers[3], FAILED, "worker 1 (sim:soak1) died: worker process exited (exit code -9)")
    ledger.close(numbers[4], FAILED, "HTTP 429: 300 requests are already waiting")
    s = ledger.summary()
    assert (s["submitted"], s["finished"], s["aborted"], s["disconnected"], s["failed"]) == (6, 1, 1, 1, 2)
    assert s["lost"] == 1 and s["lost_requests"] == ["request 5: request 5"]
    assert (s["failed_by_disruption"], s["failed_unexpected"]) == (1, 1)
    # failures of one cause count together, whatever their numbers
    assert s["failure_reasons"]["worker N (sim:soakN) died: worker process exited (exit code -N)"] == 1
    assert s["doubled"] == 0


def test_a_request_that_ends_twice_is_doubled_and_keeps_its_first_outcome():
    ledger = Ledger()
    n = ledger.open()
    ledger.close(n, FINISHED)
    ledger.close(n, FAILED, "worker 0 died")
    s = ledger.summary()
    assert s["doubled"] == 1 and s["finished"] == 1 and s["failed"] == 0 and s["failed_by_disruption"] == 0
    assert "ended twice: finished, then failed" in s["anomalies"][0]


def test_tokens_after_a_finish_and_short_outputs_are_counted():
    ledger = Ledger()
    n = ledger.open()
    ledger.close(n, FINISHED)
    ledger.streamed_after_finish(n, "data after [DONE]")
    ledger.wrong_length(n, "finish 'stop' with 3 tokens; asked for 8")
    s = ledger.summary()
    assert s["streamed_after_finish"] == 1 and s["wrong_length"] == 1 and len(s["anomalies"]) == 2


def _route(rid):
    return ("route", SimpleNamespace(request_id=rid))


def _finished(rid, reason="length", worker=0):
    return ("finished", (worker, SimpleNamespace(request_id=rid, reason=reason)))


def test_the_engine_ledger_wants_every_routed_request_finished_exactly_once():
    ledger = EngineLedger()
    for event in [_route("r1"), _route("r1"),                 # a reroute routes it again
                  _finished("r1"), _route("r2"), _finished("r2", "error"), _finished("r2", "abort"),
                  _route("r3"), _finished("r5", worker=2), _route("r5")]:   # a finish may come first
        ledger.observe(*event)
    s = ledger.summary()
    assert (s["routed"], s["finished"], s["unfinished"], s["finished_twice"]) == (4, 3, 1, 1)
    assert s["finished_unrouted"] == 0 and ledger.totals() == {"routed": 4, "finished": 3}
    # the report names no key "error": to run_bench that is a part that could not run
    assert s["reasons"] == {"length": 2, "failed": 1, "abort": 1}
    assert s["finished_by_worker"] == {"0": 3, "2": 1}


# --- the verdicts ------------------------------------------------------------------------------
def _samples(rss_of, n=60, step=2.0, fds_of=lambda i: 30):
    """n samples; rss_of(i) -> {"main": MB, ...} and pids {"main": 1}."""
    return [{"t": i * step, "rss_mb": rss_of(i), "pids": {name: 1 for name in rss_of(i)}, "fds": fds_of(i)}
            for i in range(n)]


def test_flat_memory_with_noise_and_start_up_growth_passes():
    rng = random.Random(0)
    # growth while warming up (the first 20%), then flat within +-2%
    samples = _samples(lambda i: {"main": (300 if i < 12 else 400) * (1 + rng.uniform(-0.02, 0.02))})
    v = rss_verdict(samples)
    assert v["ok"] and v["grew"] == [], v
    assert abs(v["processes"]["main (pid 1)"]["growth_pct"]) < 3


def test_a_slow_leak_is_caught():
    rng = random.Random(1)
    # +0.25% of 400 MB per sample: 15% over the run, about 10% after the warm-up
    samples = _samples(lambda i: {"main": 400 * (1 + 0.0025 * i) * (1 + rng.uniform(-0.01, 0.01)),
                                  "worker0": 250.0})
    v = rss_verdict(samples)
    assert not v["ok"] and v["grew"] == ["main (pid 1)"]
    assert v["processes"]["main (pid 1)"]["growth_pct"] > 5
    assert v["processes"]["worker0 (pid 1)"]["growth_pct"] == 0


def test_a_restarted_process_is_its_own_series():
    """A respawned worker has a new pid: its memory starting again lower is no growth, and its
    own series is judged after its own warm-up."""
    samples = [{"t": float(i), "rss_mb": {"main": 300.0, "worker1": 200.0 if i < 30 else 180.0},
                "pids": {"main": 1, "worker1": 10 if i < 30 else 11}, "fds": 30} for i in range(60)]
    v = rss_verdict(samples)
    assert v["ok"] and set(v["processes"]) == {"main (pid 1)", "worker1 (pid 10)", "worker1 (pid 11)"}
    assert v["processes"]["worker1 (pid 11)"]["from_s"] == 30.0


def test_memory_is_not_called_flat_without_enough_samples():
    v = rss_verdict(_samples(lambda i: {"main": 300.0}, n=3))
    assert not v["ok"] and not v["processes"]["main (pid 1)"]["judged"]
    assert growth([])["judged"] is False
    # a process unmeasured (None: starting, or gone) is left out, not read as 0
    samples = _samples(lambda i: {"main": 300.0, "remote_server": None if i % 2 else 250.0})
    assert rss_verdict(samples)["ok"]


def test_descriptors_leaked_per_sample_are_caught():
    assert fd_verdict(_samples(lambda i: {"main": 300.0}, fds_of=lambda i: 30 + i % 5))["ok"]
    v = fd_verdict(_samples(lambda i: {"main": 300.0}, fds_of=lambda i: 30 + i))
    assert not v["ok"] and v["growth"] > v["slack"]


def _final(kv, remote=0):
    return {"kv": kv, "remote_server_pages_used": remote}


def test_cached_prefix_pages_are_not_leaks_but_held_pages_are():
    states = bytes([FREE, CACHED, CACHED, USED, SHARED, FREE])
    assert (held_pages(states), cached_pages(states)) == (2, 2)
    idle = {"pages_used": 0, "pages_held": held_pages(bytes([FREE, CACHED, CACHED])), "pages_cached": 2,
            "pages_total": 3}
    assert pages_verdict(_final({"sim:a": idle, "sim:b": idle}))["ok"]
    leak = {**idle, "pages_used": 1, "pages_held": 1}
    v = pages_verdict(_final({"sim:a": idle, "sim:b": leak}))
    assert not v["ok"] and list(v["leaked"]) == ["sim:b"]
    # the grid holding a page the count does not show is a leak too
    assert not pages_verdict(_final({"sim:a": {**idle, "pages_held": 1}}))["ok"]
    # the remote server's own pages, and not knowing them
    assert not pages_verdict(_final({"sim:a": idle}, remote=3))["ok"]
    v = pages_verdict(_final({"sim:a": idle}, remote=None))
    assert not v["ok"] and "could not be read" in v["why"]


def test_the_request_table_once_idle():
    assert table_verdict({"requests_in_table": 200, "requests_live": 0}, 200)["ok"]
    assert not table_verdict({"requests_in_table": 150, "requests_live": 1}, 200)["ok"]
    assert not table_verdict({"requests_in_table": 201, "requests_live": 0}, 200)["ok"]


# --- the command line ------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-1", "abc", "inf", "nan"])
def test_bad_minutes_are_one_line_before_any_run(capsys, value):
    from app.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "soak", "--minutes", value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert f"argument --minutes: {value!r} is not a positive number of minutes" in err, err


def test_fractional_minutes_are_read():
    from app.cli import build_parser

    assert build_parser().parse_args(["bench", "soak", "--minutes", "0.5"]).minutes == 0.5
    assert build_parser().parse_args(["bench", "soak"]).minutes == 2.0


def test_a_soak_with_a_trace_is_refused():
    from engine.bench.soak import bench_soak
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="without a trace"):
        bench_soak(SimpleNamespace(trace_dir="traces", minutes=1))


# --- the soak ------------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def soak_model(tiny_model_path):
    # a byte-level tokenizer: a prompt is about one token per character
    return tiny_model_path("qwen2", context_length=2048)


@pytest.mark.slow
def test_a_two_minute_soak_passes_every_verdict(soak_model, tmp_path, capsys):
    from app.cli import main

    out = tmp_path / "soak.json"
    code = main(["bench", "soak", "--minutes", "2", "--model", str(soak_model), "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0, (capsys.readouterr().err, report.get("error"), report["requests"], report["events"])
    assert all(report["goals"].values()) and "error" not in report
    client, engine = report["requests"]["client"], report["requests"]["engine"]
    assert client["lost"] == 0 and engine["unfinished"] == 0 and engine["finished_twice"] == 0
    assert client["finished"] > 100 and client["aborted"] and client["disconnected"]
    # the engine saw every request sent, but for whole answers a client left before the server took them
    assert client["submitted"] - client["disconnected"] <= engine["routed"] <= client["submitted"]
    kill, restart = report["events"]["worker_kill"], report["events"]["remote_restart"]
    assert kill["new_pid"] != kill["pid"] and restart["new_pid"] != restart["old_pid"]
    # every worker carried load: the remote too
    assert set(engine["finished_by_worker"]) == {"0", "1", "2"}
    # samples every few seconds over the whole run, the last one idle
    samples = report["samples"]
    assert len(samples) >= 30 and samples[-1]["final"] and samples[-1]["requests_live"] == 0
    assert report["load_seconds"] >= 120
    # nothing outlives it: the worker processes (each incarnation) and both remote servers
    pids = {p for s in samples for p in s["pids"].values() if p} | {kill["pid"], kill["new_pid"],
                                                                    restart["old_pid"], restart["new_pid"]}
    assert not [p for p in pids if p != os.getpid() and _alive(p)]
    assert not mp.active_children()




@pytest.mark.slow
def test_a_soak_that_fails_midway_leaves_no_process_behind(soak_model, monkeypatch):
    """A failure after everything started (here: at the end checks) is the report's error, and
    the engine's workers and the remote server are stopped all the same."""
    from app.cli import build_parser, with_worker
    from engine.bench import soak

    seen: set[int] = set()

    def failing_finish(self):
        seen.update(self.worker_pids, self.remote.pids)
        seen.update(w.process.pid for w in self.engine.workers if not w.cfg.remote)
        raise RuntimeError("a check failed")

    monkeypatch.setattr(soak.Soak, "chaos", lambda self: None)
    monkeypatch.setattr(soak.Soak, "finish", failing_finish)
    args = with_worker(build_parser().parse_args(["bench", "soak", "--minutes", "0.05", "--model", str(soak_model)]))
    report = soak.bench_soak(args)
    assert report["error"] == "RuntimeError: a check failed"
    assert len(seen) == 3      # two local workers and the remote server
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in seen) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in seen if _alive(p)]
    assert report["verdicts"]["orphan_processes"] == []
