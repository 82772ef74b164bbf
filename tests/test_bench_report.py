"""Bench reports name the CPU they ran on and no path of that machine."""
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
