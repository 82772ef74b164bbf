"""The live roofline (engine/worker/roofline.py): machine ceilings measured once and cached,
the bytes and multiply-adds of decode steps, the figures in WorkerStats, the view and the panel."""
import pytest

from app.widgets.worker import roofline_parts
from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.facade.engine import Engine
from engine.models.gguf import load_gguf
from engine.worker import roofline
from engine.worker.roofline import DecodeTraffic, machine_ceilings, weight_traffic


def test_ceilings_are_measured_once_per_cpu_and_thread_count(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENTOP_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(roofline, "measure_read_gbs", lambda: calls.append("read") or 25.0)
    monkeypatch.setattr(roofline, "measure_matmul_gflops", lambda: calls.append("mm") or 150.0)
    first = machine_ceilings(2)
    assert first["source"] == "measured" and first["read_gbs"] == 25.0 and first["matmul_gflops"] == 150.0
    again = machine_ceilings(2)
    assert again["source"] == "cached" and again["read_gbs"] == 25.0
    assert calls == ["read", "mm"]
    machine_ceilings(4)                     # another thread count is another machine
    assert calls == ["read", "mm"] * 2
    assert machine_ceilings(2, remeasure=True)["source"] == "measured"


def test_ceilings_are_measured_on_a_thread_that_ends_with_them(tmp_path, monkeypatch):
    """torch's parallel ops leave an OpenMP team on the thread that ran them: measured on the
    caller's thread (bench rows' main thread, beside a thread-mode worker), the ceilings made that
    worker's every step 1.5x slower. They run on a passing thread, and its errors reach the caller."""
    import threading
    monkeypatch.setenv("TOKENTOP_CACHE_DIR", str(tmp_path))
    seen = []
    monkeypatch.setattr(roofline, "measure_read_gbs", lambda: seen.append(threading.current_thread()) or 25.0)
    monkeypatch.setattr(roofline, "measure_matmul_gflops", lambda: seen.append(threading.current_thread()) or 150.0)
    assert machine_ceilings(2, remeasure=True)["read_gbs"] == 25.0
    assert len(seen) == 2 and seen[0] is seen[1]
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()

    def fails():
        raise RuntimeError("no memory for the read test")
    monkeypatch.setattr(roofline, "measure_read_gbs", fails)
    with pytest.raises(RuntimeError, match="no memory"):
        machine_ceilings(2, remeasure=True)


def test_the_read_test_reads_past_the_last_level_cache(tmp_path):
    """A 256 MiB buffer fits the 300 MiB L3 an Emerald Rapids guest reports: the read test then
    timed the cache, not memory. Its buffer is twice the largest cache sysfs names."""
    from engine.cpuinfo import last_level_cache_bytes
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "307200K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    (tmp_path / "index1").mkdir()
    (tmp_path / "index1" / "size").write_text("garbage\n")     # unreadable entries are skipped
    llc = last_level_cache_bytes(str(tmp_path))
    assert llc == 300 << 20
    assert roofline.read_test_bytes(llc) == 600 << 20
    assert roofline.read_test_bytes(8 << 20) == 256 << 20     # at least 256 MiB
    assert roofline.read_test_bytes(4 << 30) == 2 << 30       # at most 2 GiB
    assert last_level_cache_bytes(str(tmp_path / "missing")) == 0
    assert roofline.read_test_bytes(0) == 256 << 20


def test_the_measurements_are_short_and_plausible():
    assert 0.1 < roofline.measure_read_gbs(1 << 24, 2) < 10_000
    assert 0.1 < roofline.measure_matmul_gflops(128, 2) < 1_000_000


def test_weight_traffic_counts_every_matrix_and_a_tied_embedding(tiny_model_path):
    gguf = load_gguf(tiny_model_path("qwen2"))
    nbytes, macs = weight_traffic(gguf)
    every = sum(t.nbytes for t in gguf.tensors.values())
    if gguf.has("output.weight"):   # untied: a step gathers one embedding row, not the table
        assert nbytes == every - gguf.tensor("token_embd.weight").nbytes
    else:
        assert nbytes == every
    out = gguf.tensor("output.weight" if gguf.has("output.weight") else "token_embd.weight")
    assert macs >= out.shape[0] * out.shape[1]


def test_decode_traffic_is_bytes_per_second_of_stepping_against_the_ceilings():
    t = DecodeTraffic(weight_bytes=400_000_000, weight_macs=500_000_000, kv_bytes_per_token=12_288,
                      ceilings={"read_gbs": 40.0, "matmul_gflops": 200.0})
    assert t.as_dict(0.0) is None
    # ten one-row steps of 20 ms at 1000 tokens of context, then idle time (not counted)
    for i in range(10):
        t.add(0.1 * i, 0.020, 1, 1000)
    got = t.as_dict(1.0)
    step = 400_000_000 + 12_288 * 1000
    assert got["read_gbs"] == pytest.approx(step / 0.020 / 1e9, rel=1e-3)
    assert got["read_share"] == pytest.approx(got["read_gbs"] / 40.0, rel=1e-2)
    assert got["rows"] == 1 and got["gflops"] == pytest.approx(2 * 5e8 / 0.020 / 1e9, rel=1e-3)
    assert got["compute_share"] == pytest.approx(got["gflops"] / 200.0, rel=1e-2)
    assert t.as_dict(100.0) is None         # the window moved past them


def test_panel_parts_show_the_read_share_and_for_many_rows_the_compute_share():
    one = {"read_gbs": 24.1, "bandwidth_gbs": 31.0, "read_share": 0.777, "rows": 1.0,
           "gflops": 40.0, "peak_gflops": 200.0, "compute_share": 0.2}
    assert roofline_parts(one) == [(1, "read 24.1 GB/s 78% of 31")]
    many = {**one, "rows": 8.0, "compute_share": 0.55}
    assert roofline_parts(many)[1] == (3, "8 rows 55% of matmul peak")
    assert roofline_parts(None) == []


def test_a_cpu_worker_reports_its_roofline_and_the_view_carries_it(tiny_model_path):
    cfg = WorkerConfig(model=str(tiny_model_path("qwen2")), threads=1, calibrate=False)
    with Engine(EngineConfig(workers=(cfg,), worker_mode="thread")).start(timeout=300) as engine:
        engine.generate("hello there", params=SamplingParams(max_tokens=24, ignore_eos=True))
        import time
        deadline = time.monotonic() + 10
        while (r := engine.snapshot().workers[0].roofline) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        from engine.serve.snapshot_json import worker_json
        assert worker_json(engine.snapshot().workers[0])["roofline"] is not None   # GET /snapshot carries it
    assert r is not None and r["read_gbs"] > 0 and r["bandwidth_gbs"] > 0
    assert 0 < r["read_share"] and r["rows"] >= 1


def test_no_measurement_while_a_kernel_build_holds_the_cores(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENTOP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(roofline, "measure_read_gbs", lambda: pytest.fail("measured"))
    assert machine_ceilings(2, measure=False) == {}
    t = DecodeTraffic(10**9, 10, 1, {})
    t.add(0.0, 0.001, 1, 0)
    got = t.as_dict(0.5)
    assert got["read_gbs"] > 0 and got["read_share"] is None and got["compute_share"] is None
    assert roofline_parts(got) == [(1, f"read {got['read_gbs']:.1f} GB/s")]
