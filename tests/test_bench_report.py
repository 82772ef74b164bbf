"""Bench reports name the CPU they ran on and no path of that machine."""
import pytest

from engine.bench.common import command_line, machine
from engine.cpuinfo import ISA_FLAGS, cpu_info, parse_cpuinfo


def test_machine_records_cpu_model_and_isa():
    m = machine()
    assert m["cpu_model"] == cpu_info()["model"] and m["cpu_model"]
    assert m["cpu_family_model"] == cpu_info()["family"]
    assert set(m["isa"]) <= set(ISA_FLAGS)
    assert m["torch_cpu_capability"]


def test_cpuinfo_names_family_and_model_that_a_vm_s_model_name_hides():
    lines = ["processor\t: 0\n", "vendor_id\t: AuthenticAMD\n", "cpu family\t: 25\n", "model\t\t: 1\n",
             "model name\t: AMD EPYC\n", "flags\t\t: fpu sse avx2 fma bmi2\n",
             "processor\t: 1\n", "cpu family\t: 99\n"]
    assert parse_cpuinfo(lines) == {"model": "AMD EPYC", "family": "25/1", "isa": ["avx2", "fma"]}
    assert parse_cpuinfo([])["family"] == "unknown"


def test_command_line_hides_the_llama_cpp_python_path():
    assert command_line(["bench", "single", "--llama-cpp", "/home/me/ref/bin/python", "--runs", "3"], {}) == \
        "tokentop bench single --llama-cpp PATH/TO/python --runs 3"
    assert command_line(["bench", "single", "--llama-cpp=/x/python"], {}) == \
        "tokentop bench single --llama-cpp=PATH/TO/python"


def test_command_line_names_the_kernel_settings_it_ran_with():
    """A report of the AVX2 kernels forced on an AVX-512 CPU says so in its command."""
    env = {"TOKENTOP_KERNEL_ISA": "avx2", "HOME": "/root", "TOKENTOP_PACKED": ""}
    assert command_line(["bench", "rows", "--runs", "3"], env) == \
        "TOKENTOP_KERNEL_ISA=avx2 tokentop bench rows --runs 3"
    assert command_line(["bench", "rows"], {}) == "tokentop bench rows"


def test_command_line_hides_the_llama_server_path():
    assert command_line(["bench", "batching", "--llama-server", "/opt/llama/bin/llama-server", "--runs", "3"], {}) == \
        "tokentop bench batching --llama-server PATH/TO/llama-server --runs 3"
    assert command_line(["bench", "batching", "--llama-server=/x/llama-server", "--llama-cpp=/y/python"], {}) == \
        "tokentop bench batching --llama-server=PATH/TO/llama-server --llama-cpp=PATH/TO/python"


def test_single_pairs_rounds_run_by_run():
    """bench single alternates tokentop and llama.cpp one run each; the ratio is the median of
    the rounds' ratios. Round 1 here ran llama.cpp in a fast spell and tokentop in a slow one:
    it is one outlier of three pairs, not a shift of one side's median."""
    from engine.bench.scenarios import merge_rounds, paired_ratio
    ours = [{"prefill_tok_s": [300.0], "decode_tok_s": [50.0], "peak_rss_mb": 800.0, "decode_step_ms": 20.0},
            {"prefill_tok_s": [200.0], "decode_tok_s": [33.0], "peak_rss_mb": 820.0, "decode_step_ms": 30.0},
            {"prefill_tok_s": [210.0], "decode_tok_s": [35.0], "peak_rss_mb": 810.0, "decode_step_ms": 28.6}]
    theirs = [70.0, 30.0, 31.0]        # decode tok/s of the interleaved llama.cpp runs
    merged = merge_rounds(ours)
    assert merged["decode_tok_s"] == [50.0, 33.0, 35.0] and merged["prefill_tok_s"] == [300.0, 200.0, 210.0]
    assert merged["peak_rss_mb"] == 820.0 and merged["decode_step_ms"] == round(1000 / 35.0, 2)
    assert paired_ratio(merged["decode_tok_s"], theirs) == pytest.approx(33 / 30)   # of 50/70, 33/30, 35/31


def test_batching_runs_every_size_in_every_round(monkeypatch):
    """bench batching runs N = 1 and N = 8 (and every other size) in each round, and N8/N1 is the
    median of the rounds' ratios: a slow spell during one round moves one ratio, not one size's
    median. Simulated bursts: round 2 is a slow spell (every size at half speed)."""
    from types import SimpleNamespace

    from engine.bench import scenarios
    calls = []
    speed = {1: 80.0, 8: 340.0}         # tok/s of each size in a normal spell

    def burst(engine, n, out_tokens, batched, tag):
        if tag == "warm":
            return 1.0
        calls.append((tag, n))
        slow = 2.0 if tag == "b1" else 1.0
        return n * out_tokens / speed[n] * slow

    monkeypatch.setattr(scenarios, "start_engine", lambda *a, **k: SimpleNamespace(
        config=SimpleNamespace(workers=[SimpleNamespace(device="cpu")])))
    monkeypatch.setattr(scenarios, "stop_engine", lambda engine: None)
    monkeypatch.setattr(scenarios, "base_worker", lambda args, **k: None)
    monkeypatch.setattr(scenarios, "timed_burst", burst)
    monkeypatch.setattr(scenarios, "_memory_pressure", lambda args, kv: {})
    args = SimpleNamespace(quick=False, runs=3, sizes="1,8", no_sequential=True, model="m", llama_server=None)
    report = scenarios.bench_batching(args)
    assert calls[:6] == [("b0", 1), ("b0", 8), ("b1", 1), ("b1", 8), ("b2", 1), ("b2", 8)]
    # the paged/contiguous pair alternates which engine goes first (ABBA)
    pair = [tag for tag, n in calls if n == 1 and tag[0] in "pc"]
    assert pair == ["paged0", "contiguous0", "contiguous1", "paged1", "paged2", "contiguous2"]
    assert report["aggregate_n8_over_n1"] == pytest.approx(340 / 80)
    assert set(report["goals"]) == {"paged_ge_97pct_contiguous"}   # no goal against one stream


def _single_args(llama_cpp=None):
    from types import SimpleNamespace
    return SimpleNamespace(quick=False, runs=3, models="qwen2.5-coder-0.5b", llama_cpp=llama_cpp)


def _fake_single(monkeypatch, decode):
    """bench single's children replaced: tokentop's rounds decode at `decode` tok/s in turn,
    llama.cpp's at 40 tok/s; no process starts, no memory is read."""
    from engine.bench import scenarios
    ours = iter(decode)
    calls = []

    def tokentop(worker, runs, out_tokens, overhead):
        calls.append(("tokentop", runs))
        return {"prefill_tok_s": [900.0] * runs, "decode_tok_s": [next(ours) for _ in range(runs)],
                "peak_rss_mb": 900.0, "decode_step_ms": 12.0}

    def llama(python, model, threads, runs, out_tokens):
        calls.append(("llama.cpp", python))
        return {"prefill_tok_s": [300.0], "decode_tok_s": [40.0], "peak_rss_mb": 750.0}

    monkeypatch.setattr(scenarios, "base_worker", lambda args, **k: scenarios.WorkerConfig(model=k["model"]))
    monkeypatch.setattr(scenarios, "_tokentop_single", tokentop)
    monkeypatch.setattr(scenarios, "_llama_cpp", llama)
    reads = iter(range(20, 40))
    monkeypatch.setattr(scenarios, "read_ceiling_gbs", lambda threads: float(next(reads)))
    return calls


def test_single_without_llama_cpp_reports_tokentop_only(monkeypatch):
    """Without --llama-cpp there is nothing to compare with: no llama.cpp figures, no ratios and
    no goal flags: a ratio is only reported against llama.cpp measured in the same run."""
    from engine.bench import scenarios
    calls = _fake_single(monkeypatch, [80.0, 90.0, 85.0])
    row = scenarios.bench_single(_single_args())["results"][0]
    assert calls == [("tokentop", 1)] * 3      # a fresh process per run, the ceiling read around each
    assert row["decode_tok_s_median"] == 85.0 and row["prefill_tok_s_median"] == 900.0
    assert not {"llama_cpp", "prefill_ratio", "decode_ratio", "rss_ratio", "goals"} & set(row)


def test_single_with_llama_cpp_measures_the_ratios_in_the_same_run(monkeypatch):
    from engine.bench import scenarios
    calls = _fake_single(monkeypatch, [80.0, 90.0, 60.0])
    row = scenarios.bench_single(_single_args("/ref/python"))["results"][0]
    assert calls == [("tokentop", 1), ("llama.cpp", "/ref/python")] * 3      # alternating, ABAB
    assert row["llama_cpp"]["decode_tok_s_median"] == 40.0 and "measured in this run" in row["llama_cpp"]["source"]
    assert row["decode_ratio_rounds"] == [2.0, 2.25, 1.5] and row["decode_ratio"] == 2.0
    assert row["prefill_ratio"] == 3.0 and row["rss_ratio"] == 1.2
    assert "goals" not in row
    # the ceiling just before and just after each tokentop run
    assert row["memory_read_gb_s"]["tokentop"] == [20.0, 22.0, 24.0]
    assert row["memory_read_gb_s"]["tokentop_after"] == [21.0, 23.0, 25.0]


def test_read_bandwidth_reads_with_the_threads_asked_and_puts_them_back():
    import torch

    from engine.bench.common import read_bandwidth
    before = torch.get_num_threads()
    gb_s = read_bandwidth(1 << 22, reps=2, threads=1)
    assert gb_s > 0.1 and torch.get_num_threads() == before


def test_bench_flags_reach_the_benchmarked_worker():
    """Every engine flag reaches the benchmarked worker (--max-context, --policy, --prefix-cache,
    --single-flight and the speculation flags included), not only those the parser reads."""
    from app.cli import build_parser, with_worker
    from engine.bench.common import base_worker

    def parse(argv):   # as `tokentop bench` does: the flags become the WorkerConfig it passes on
        return with_worker(build_parser().parse_args(argv))

    args = parse(["bench", "batching", "--max-context", "300", "--max-active", "5",
                  "--policy", "spf", "--prefix-cache", "off", "--single-flight", "off",
                  "--speculate", "ngram", "--spec-k", "3"])
    worker = base_worker(args)
    assert (worker.max_context, worker.max_active, worker.policy, worker.prefix_cache, worker.single_flight,
            worker.speculate, worker.spec_k) == (300, 5, "spf", "off", "off", "ngram", "3")
    assert worker.threads == 2 and not worker.calibrate        # the benchmark's own defaults
    assert base_worker(parse(["bench", "batching"])).max_context == 0


def test_a_part_that_could_not_run_fails_the_command(monkeypatch, capsys):
    """`bench single --models nope` prints its report with the error inside it, and exits 1
    with the error on stderr: a script cannot take the report for a success."""
    import json
    import sys
    from types import SimpleNamespace

    from engine import bench
    from engine.bench import scenarios

    report = {"results": [{"model": "nope", "error": "Unknown model 'nope'"},
                          {"model": "qwen2.5-coder-0.5b", "decode_tok_s_median": 90.0,
                           "llama_cpp": {"error": "llama.cpp failed"}}]}
    monkeypatch.setattr(scenarios, "bench_single", lambda args: report)
    monkeypatch.setattr(sys, "argv", ["tokentop", "bench", "single"])
    code = bench.run_bench(SimpleNamespace(scenario="single", trace_dir=None, out=None))
    out, err = capsys.readouterr()
    assert code == 1 and json.loads(out)["results"][0]["error"] == "Unknown model 'nope'"
    assert err.splitlines() == ["tokentop: error: bench single: nope: Unknown model 'nope'",
                                "tokentop: error: bench single: qwen2.5-coder-0.5b.llama_cpp: llama.cpp failed"]
    monkeypatch.setattr(scenarios, "bench_single", lambda args: {"results": [{"model": "m", "x": 1}]})
    assert bench.run_bench(SimpleNamespace(scenario="single", trace_dir=None, out=None)) == 0
