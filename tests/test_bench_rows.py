"""bench rows (engine/bench/rows.py): a decode step by its row count, and bench single's roofline."""
import json

import pytest

from app.cli import main
from engine.bench.rows import _row, decode_roofline, model_traffic
from engine.config import WorkerConfig


def test_a_row_is_its_step_against_one_row_with_bytes_and_shares():
    traffic = (400_000_000, 500_000_000, 10_000)
    ceil = {"read_gbs": 40.0, "matmul_gflops": 200.0, "source": "cached"}
    one = _row(1, 0.020, 0.020, 64, traffic, ceil)
    eight = _row(8, 0.044, 0.020, 64, traffic, ceil)
    assert one["vs_1_row"] == 1.0 and eight["vs_1_row"] == 2.2
    assert eight["tok_s"] == pytest.approx(8 / 0.044, rel=1e-3)
    assert eight["step_bytes"] == 400_000_000 + 10_000 * 8 * (64 + 32)
    assert one["read_gb_s"] == pytest.approx(one["step_bytes"] / 0.020 / 1e9, rel=1e-3)
    assert one["read_share"] == pytest.approx(one["read_gb_s"] / 40.0, rel=1e-2)
    assert eight["gflops"] == pytest.approx(2 * 5e8 * 8 / 0.044 / 1e9, rel=1e-3)
    assert one["nearer_bound"] == "bandwidth"
    assert set(_row(2, 0.03, 0.02, 64, traffic, None)) == {"rows", "step_ms", "vs_1_row", "tok_s"}


def test_bench_single_roofline_is_step_bytes_times_steps_per_second(tiny_model_path, monkeypatch):
    import engine.bench.rows as rows
    monkeypatch.setattr(rows, "ceilings", lambda threads: {"read_gbs": 50.0, "matmul_gflops": 1.0, "source": "x"})
    worker = WorkerConfig(model=str(tiny_model_path("qwen2")), threads=1)
    weight, _, kv = model_traffic(worker)
    got = decode_roofline(worker, 100.0, 80, live={"read_gbs": 1.0})
    assert got["step_bytes"] == weight + kv * 80
    assert got["read_gb_s"] == round(got["step_bytes"] * 100 / 1e9, 2)
    assert got["read_share"] == round(got["step_bytes"] * 100 / 1e9 / 50.0, 3)
    assert got["live"] == {"read_gbs": 1.0}
    # the live figure against the run it was read after, not against the median over runs
    live_read = got["step_bytes"] * 110 / 1e9
    run = decode_roofline(worker, 100.0, 80, live={"read_gbs": live_read}, live_steps_per_s=110.0)
    assert run["live_vs_run"]["run_read_gb_s"] == round(got["step_bytes"] * 110 / 1e9, 2)
    assert run["live_vs_run"]["ratio"] == 1.0
    assert "live_vs_run" not in got and "paired" not in got
    # each run's read against the ceiling measured around it, not against one ceiling for all
    per_run = decode_roofline(worker, 100.0, 80, runs=[(100.0, 20.0), (50.0, 10.0), (100.0, 40.0)])
    share = got["step_bytes"] * 100 / 1e9 / 20.0
    assert per_run["paired"]["read_share_runs"] == [round(share, 3), round(share, 3), round(share / 2, 3)]
    assert per_run["paired"]["read_share"] == round(share, 3)
    assert per_run["read_share"] == got["read_share"]       # the one-ceiling figure stays beside it


def test_bench_rows_command_on_a_simulated_worker(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "rows.json"
    code = main(["bench", "rows", "--quick", "--sizes", "1,2,3", "--model", str(tiny_model_path("qwen2")),
                 "--models", str(tiny_model_path("qwen2")), "--device", "sim:g:prefill=20000,decode=500",
                 "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["scenario"] == "rows" and report["sizes"] == [1, 2, 3]
    result = report["results"][0]
    assert result["simulated"] and "not shown" in result["roofline"]
    assert [r["rows"] for r in result["rows"]] == [1, 2, 3]
    assert result["rows"][0]["vs_1_row"] == 1.0 and all(r["step_ms"] > 0 for r in result["rows"])
