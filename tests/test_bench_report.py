"""Bench reports name the CPU they ran on and no path of that machine."""
import pytest

from engine.bench import command_line, machine
from engine.cpuinfo import ISA_FLAGS, cpu_info


def test_machine_records_cpu_model_and_isa():
    m = machine()
    assert m["cpu_model"] == cpu_info()["model"] and m["cpu_model"]
    assert set(m["isa"]) <= set(ISA_FLAGS)
    assert m["torch_cpu_capability"]


def test_command_line_hides_the_llama_cpp_python_path():
    assert command_line(["bench", "single", "--llama-cpp", "/home/me/ref/bin/python", "--runs", "3"]) == \
        "tokentop bench single --llama-cpp PATH/TO/python --runs 3"
    assert command_line(["bench", "single", "--llama-cpp=/x/python"]) == \
        "tokentop bench single --llama-cpp=PATH/TO/python"


def test_command_line_hides_the_llama_server_path():
    assert command_line(["bench", "batching", "--llama-server", "/opt/llama/bin/llama-server", "--runs", "3"]) == \
        "tokentop bench batching --llama-server PATH/TO/llama-server --runs 3"
    assert command_line(["bench", "batching", "--llama-server=/x/llama-server", "--llama-cpp=/y/python"]) == \
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
