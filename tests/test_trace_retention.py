"""The trace folder keeps the newest `trace_keep` traces, at most `trace_keep_mib` MiB of them,
and `POST /trace` / SIGUSR1 answer 429 (TraceBusy) while a trace is being written or right
after one (engine/facade/recorder.py, engine/serve/app.py)."""
from __future__ import annotations

import contextlib
import os
import threading
import time

import httpx
import pytest

from app.cli import main
from engine.bench.llama_server import wait_healthy
from engine.config import EngineConfig, WorkerConfig
from engine.errors import ConfigError
from engine.facade.devices import parse_devices
from engine.facade.engine import Engine
from engine.facade.recorder import MIN_TRACE_INTERVAL_S, TraceBusy, prune_traces
from engine.serve.app import ServeConfig
from engine.serve.server import HttpServer

DEVICE = "sim:gpu0:prefill=20000,decode=4000"


def _trace_files(folder, n: int, size: int = 100) -> list:
    """n trace files named as write_chrome_trace names them, each a second older than the next."""
    paths = []
    for i in range(n):
        path = folder / f"tokentop-20261206-0500{i:02d}-000.json"
        path.write_bytes(b"x" * size)
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
        paths.append(path)
    return paths


def test_prune_deletes_the_oldest_beyond_the_count_and_nothing_else(tmp_path):
    paths = _trace_files(tmp_path, 25)
    others = [tmp_path / "notes.json", tmp_path / "tokentop-mine.json", tmp_path / "tokentop-20261206-050000-000.txt"]
    for p in others:
        p.write_text("keep me")
        os.utime(p, (1, 1))                        # older than every trace
    assert prune_traces(tmp_path, 20, 1 << 30, str(paths[-1])) == 5
    assert sorted(p for p in tmp_path.iterdir()) == sorted(paths[5:] + others)


def test_prune_keeps_the_newest_within_the_size_and_always_the_one_just_written(tmp_path):
    paths = _trace_files(tmp_path, 6, size=1000)
    assert prune_traces(tmp_path, 20, 3500, str(paths[-1])) == 3       # 3 x 1000 bytes fit in 3500
    assert sorted(tmp_path.iterdir()) == paths[3:]
    big = tmp_path / "tokentop-20261206-060000-000.json"
    big.write_bytes(b"x" * 5000)                                          # alone over the cap: it stays
    assert prune_traces(tmp_path, 20, 3500, str(big)) == 3
    assert list(tmp_path.iterdir()) == [big]


@contextlib.contextmanager
def _engine(model, folder, **config):
    base = WorkerConfig(model=str(model), calibrate=False, threads=1, max_context=512)
    engine = Engine(EngineConfig(workers=parse_devices([DEVICE], base), worker_mode="thread",
                                 trace_dir=str(folder), **config))
    try:
        engine.start()
        yield engine
    finally:
        engine.shutdown()


def test_exports_into_the_folder_keep_the_newest_n(tiny_model_path, tmp_path):
    folder = tmp_path / "traces"
    with _engine(tiny_model_path("qwen2", context_length=512), folder, trace_keep=3) as engine:
        written = [engine.export_trace() for _ in range(5)]
        log = [line.text for line in engine.snapshot().log]
        engine.export_trace(folder / "named.json")                       # a file named: no pruning
    assert sorted(os.listdir(folder)) == sorted([os.path.basename(p) for p in written[-3:]] + ["named.json"])
    assert any("deleted 1 older trace in" in line and "`trace_keep=3`" in line for line in log)


def test_a_trace_asked_for_while_one_is_written_or_right_after_is_refused(tiny_model_path, tmp_path):
    with _engine(tiny_model_path("qwen2", context_length=512), tmp_path / "t") as engine:
        first = engine.export_trace(refuse_busy=True)
        with pytest.raises(TraceBusy) as soon:
            engine.export_trace(refuse_busy=True)
        assert soon.value.retry_after >= 1 and "ask again in" in str(soon.value)
        assert engine.export_trace() != first                            # a caller that waits is served
        with engine.recorder._writing:                                    # one being written now
            with pytest.raises(TraceBusy, match="being written"):
                engine.export_trace(refuse_busy=True)
        time.sleep(MIN_TRACE_INTERVAL_S + 0.1)
        assert engine.export_trace(refuse_busy=True)


def test_post_trace_answers_429_with_retry_after_and_the_folder_stays_capped(tiny_model_path, tmp_path):
    folder = tmp_path / "traces"
    with _engine(tiny_model_path("qwen2", context_length=512), folder, trace_keep=2) as engine:
        http = HttpServer(engine, ServeConfig(port=0), quiet=True)
        http.start()
        try:
            wait_healthy(http.url, 30)
            answers = []
            threads = [threading.Thread(target=lambda: answers.append(httpx.post(http.url + "/trace", timeout=30)))
                       for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            codes = sorted(a.status_code for a in answers)
            assert codes.count(200) >= 1 and codes.count(429) >= 1 and set(codes) == {200, 429}, codes
            busy = next(a for a in answers if a.status_code == 429)
            assert int(busy.headers["Retry-After"]) >= 1 and busy.json()["error"]["code"] == "trace_busy"
            for _ in range(3):                                            # paced as told: each is written
                time.sleep(MIN_TRACE_INTERVAL_S + 0.1)
                assert httpx.post(http.url + "/trace", timeout=30).status_code == 200
        finally:
            http.stop()
    assert len(os.listdir(folder)) == 2


def test_trace_keep_flags_are_checked(capsys):
    with pytest.raises(ConfigError, match="`trace_keep`"):
        Engine(EngineConfig(trace_keep=0))
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hi", "--trace-keep-mib", "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "--trace-keep-mib: '0' is not a positive" in err
