"""Engine flags are checked when the arguments are read (or, for the ones that depend on the
model, as soon as its header is read): one line on stderr that names the flag and the fix,
exit code 2, before any weights load or any request runs."""
import io
import json
import os

import pytest

from app.cli import MAX_PROMPT_FILE_BYTES, main
from tests.fixtures.bounded import run_bounded

SIM = "sim:gpu0:prefill=5000,decode=2000"


@pytest.fixture
def model(tiny_model_path):
    return str(tiny_model_path("qwen2"))   # 256-token context, 8 KiB per KV page of 16 tokens


@pytest.fixture
def no_weights(monkeypatch):
    """Fail loudly if a model's weights start loading: the check must come before."""
    from engine.worker.runner import ModelRunner

    def refuse(*a, **kw):
        raise AssertionError("weights loaded before the flags were checked")
    monkeypatch.setattr(ModelRunner, "__init__", refuse)


@pytest.mark.parametrize("flags, fragment", [
    (["--threads", "-1"], "--threads must be 0 (all cores) or a positive count, got -1"),
    (["--max-context", "0"], "--max-context must be at least 2 tokens"),
    (["--max-context", "10000000"], "--max-context 10000000 is more than"),
    (["--kv-cache-memory", "1KiB"], "--kv-cache-memory 1 KiB is less than one KV page of"),
    (["--kv-cache-memory", "99999TiB"], "--kv-cache-memory 99999 TiB would be"),
    (["--kv-cache-memory", "infMiB"], "cannot read size 'infMiB'"),
    # a page of fp16 K/V is 4 KiB: 6 KiB holds one, whereas fp32 pages (8 KiB) would not fit
    (["--kv-dtype", "fp32", "--kv-cache-memory", "6KiB"], "--kv-cache-memory 6 KiB is less than one KV page of"),
])
@pytest.mark.parametrize("device", ["cpu", SIM])
def test_bad_engine_flags_are_one_line_before_any_work(model, no_weights, capsys, flags, fragment, device):
    code = main(["generate", "hello", "--model", model, "--device", device, *flags])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert fragment in err and "Traceback" not in err, err


def test_trained_context_is_named(model, no_weights, capsys):
    main(["generate", "hello", "--model", model, "--max-context", "257"])
    assert "was trained for (256 tokens); use --max-context 256 or less" in capsys.readouterr().err


def test_max_tokens_beyond_the_context_is_lowered_and_said_once(model, capsys):
    code = main(["generate", "hello there", "--model", model, "--device", SIM,
                 "--max-context", "8", "--max-tokens", "10", "--json"])
    out, err = capsys.readouterr()
    result = json.loads(out)
    room = 8 - len(result["prompt_token_ids"])
    assert code == 0 and len(result["token_ids"]) == room and result["finish_reason"] == "length"
    assert err.count("\n") == 1 and f"note: max_tokens 10 lowered to {room}" in err


def test_the_record_router_and_snapshot_use_the_real_limit(model):
    from engine.config import EngineConfig, SamplingParams, WorkerConfig
    from engine.facade.devices import parse_devices
    from engine.facade.engine import Engine

    workers = parse_devices([SIM], WorkerConfig(model=model, max_context=64))
    with Engine(EngineConfig(workers=workers, worker_mode="thread")).start(timeout=60) as engine:
        handles = [engine.submit(f"prompt {i}", params=SamplingParams(max_tokens=20000)) for i in range(3)]
        room = 64 - len(engine.encode("prompt 0", None, None))
        assert handles[0].notice.startswith(f"max_tokens 20000 lowered to {room}")
        assert engine.routes[-1].candidates[0].decode_tokens <= 3 * room
        snap = engine.snapshot()
        assert {r.max_tokens for r in snap.requests} == {room}
        results = [h.result(30) for h in handles]
        assert all(len(r.token_ids) == room and r.notice for r in results)
        lowered = [line.text for line in engine.snapshot().log if "lowered" in line.text]
        assert len(lowered) == 1 and "×3 in" in lowered[0]


def test_the_kv_pool_caps_the_context(tiny_model_path):
    from engine.config import EngineConfig, SamplingParams, WorkerConfig
    from engine.facade.devices import parse_devices
    from engine.facade.engine import Engine

    model = str(tiny_model_path("qwen2"))
    workers = parse_devices([SIM], WorkerConfig(model=model, kv_cache_memory=4 * 8 * 1024))   # 4 pages
    with Engine(EngineConfig(workers=workers, worker_mode="thread")).start(timeout=60) as engine:
        result = engine.generate("hello", params=SamplingParams(max_tokens=200, ignore_eos=True))
        assert result.finish_reason == "length" and len(result.prompt_token_ids) + len(result.token_ids) == 64
        assert "context 64 tokens (all its KV pool holds" in " ".join(line.text for line in engine.snapshot().log)


def test_kv_dtype_is_checked_where_the_config_is_built():
    from engine.config import WorkerConfig
    from engine.errors import ConfigError
    with pytest.raises(ConfigError, match=r"`kv_dtype` must be one of auto, fp32, bf16, fp16, got 'fp8'"):
        WorkerConfig(kv_dtype="fp8").validate()


@pytest.mark.parametrize("kv_dtype,pages", [("fp32", 4), ("fp16", 8), ("bf16", 8)])
def test_a_16_bit_kv_store_holds_twice_the_pages_in_the_same_memory(tiny_model_path, kv_dtype, pages):
    from engine.config import EngineConfig, WorkerConfig
    from engine.facade.devices import parse_devices
    from engine.facade.engine import Engine

    model = str(tiny_model_path("qwen2"))
    workers = parse_devices(["cpu"], WorkerConfig(model=model, kv_cache_memory=4 * 8 * 1024, kv_dtype=kv_dtype,
                                                  calibrate=False, threads=1))
    with Engine(EngineConfig(workers=workers, worker_mode="thread")).start(timeout=120) as engine:
        w = engine.snapshot().workers[0]
        assert w.pages_total == pages


@pytest.mark.parametrize("flag, scenario", [("--llama-server", "batching"), ("--llama-cpp", "single")])
def test_a_missing_reference_program_is_one_line_before_any_run(tmp_path, no_weights, capsys, flag, scenario):
    missing = str(tmp_path / "no-such-program")
    with pytest.raises(SystemExit) as exit_:
        main(["bench", scenario, flag, missing])
    _, err = capsys.readouterr()
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert f"argument {flag}: '{missing}' is not an executable file" in err


@pytest.mark.parametrize("flags, fragment", [
    (["--port", "99999"], "--port 99999: the port must be 0..65535"),
    (["--port", "-1"], "--port -1: the port must be 0..65535"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--max-body", "lots"], "cannot read size 'lots'"),
])
def test_bad_server_flags_are_one_line_before_any_work(model, no_weights, capsys, flags, fragment):
    # unchecked, --port 99999 reaches socket.bind after the engine is built: an OverflowError traceback
    code = main(["serve", "--model", model, "--device", SIM, *flags])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert fragment in err and "Traceback" not in err, err


def test_bind_refuses_an_impossible_port_in_one_line():
    from engine.errors import ConfigError
    from engine.serve.server import bind

    with pytest.raises(ConfigError, match="cannot listen on 127.0.0.1:70000"):
        bind("127.0.0.1", 70000)


def test_an_unwritable_routing_log_is_one_line_before_any_work(model, no_weights, capsys):
    # unchecked, it is a FileNotFoundError traceback from the engine's constructor
    code = main(["generate", "hello", "--model", model, "--device", SIM,
                 "--routing-log", "/nonexistent-folder/routes.jsonl"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "--routing-log /nonexistent-folder/routes.jsonl: cannot append to it" in err, err


@pytest.mark.parametrize("flags, fragment", [
    (["batching", "--sizes", "abc"], "argument --sizes: 'abc': write positive request counts"),
    (["batching", "--sizes", "0,8"], "argument --sizes: '0,8': write positive request counts"),
    (["batching", "--runs", "0"], "argument --runs: '0' is not a positive whole number"),
    (["prefix", "--runs", "-2"], "argument --runs: '-2' is not a positive whole number"),
    (["single", "--models", " , "], "argument --models: name at least one model"),
])
def test_bad_bench_flags_are_one_line_before_any_run(no_weights, capsys, flags, fragment):
    # unchecked, these are a ValueError, TypeError or KeyError traceback, some after a first benchmark ran
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *flags])
    _, err = capsys.readouterr()
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert fragment in err, err


def test_an_out_file_in_a_missing_folder_is_refused_before_the_bench(no_weights, capsys):
    # unchecked, the report fails only after the whole benchmark, as an OSError traceback
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "batching", "--out", "/nonexistent-folder/report.json"])
    _, err = capsys.readouterr()
    assert exit_.value.code == 2 and "argument --out: cannot write '/nonexistent-folder/report.json'" in err


def test_an_unexpected_failure_is_one_line_and_exit_1(monkeypatch, capsys):
    import app.cli as cli

    def broken(args):
        raise RuntimeError("the llama-server exited with code 1 before it was healthy")
    monkeypatch.setattr(cli, "cmd_models", broken)
    monkeypatch.delenv("TOKENTOP_DEBUG", raising=False)
    assert main(["models"]) == 1
    err = capsys.readouterr().err
    assert err == ("tokentop: error: RuntimeError: the llama-server exited with code 1 before it was healthy "
                   "(run with TOKENTOP_DEBUG=1 for the traceback)\n")
    monkeypatch.setenv("TOKENTOP_DEBUG", "1")
    with pytest.raises(RuntimeError):
        main(["models"])


def test_more_threads_than_cores_is_warned_of(model, capsys):
    """--threads above the usable cores: OpenMP threads that wait for each other slow CPU decode
    many times over, so the worker's start says so (stderr for generate) rather than run slowly
    in silence."""
    import os

    cores = len(os.sched_getaffinity(0))
    assert main(["generate", "hello", "--model", model, "--threads", str(cores + 1), "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert f"tokentop: warning: worker 0 (cpu): --threads {cores + 1} is more than the {cores} cores" in err, err
    assert main(["generate", "hello", "--model", model, "--threads", "1", "--max-tokens", "2"]) == 0
    assert "warning" not in capsys.readouterr().err


# --- engine messages name fields; the command line shows flags (app/flags.py) -------------

@pytest.mark.parametrize("message, line", [
    ("raise `max_context`", "raise --max-context"),
    ("`kv_cache_memory=256MiB` or less", "--kv-cache-memory 256MiB or less"),
    ("`kv_cache_memory=1 KiB` is less", "--kv-cache-memory 1 KiB is less"),
    ("`device=sim:gpu0:prefill=1,decode=2`: bad", "--device sim:gpu0:prefill=1,decode=2: bad"),
    ("`ngram_min`/`ngram_max` need", "--ngram-min/--ngram-max need"),
    ("see `tokentop serve` or `nvtx`", "see `tokentop serve` or `nvtx`"),   # no field: left as is
    ("max_tokens must be > 0", "max_tokens must be > 0"),
])
def test_engine_messages_read_as_flags_on_the_command_line(message, line):
    from app.flags import as_flags

    assert as_flags(message) == line
    assert as_flags(line) == line   # idempotent: a message rendered twice reads the same


def test_every_mapped_field_is_a_setting_and_every_flag_a_real_flag():
    import argparse
    from dataclasses import fields

    from app.cli import build_dashboard_parser, build_parser
    from app.flags import FIELD_FLAGS
    from engine.config import EngineConfig, WorkerConfig
    from engine.serve.app import ServeConfig

    settings = {f.name for cls in (WorkerConfig, EngineConfig, ServeConfig) for f in fields(cls)}
    assert set(FIELD_FLAGS) <= settings, set(FIELD_FLAGS) - settings
    parsers = [build_dashboard_parser()] + [
        sub for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)
        for sub in action.choices.values()]
    flags = {flag for p in parsers for action in p._actions for flag in action.option_strings}
    assert set(FIELD_FLAGS.values()) <= flags, set(FIELD_FLAGS.values()) - flags


def test_an_engine_error_is_printed_with_flags_end_to_end(no_weights, capsys):
    """The engine says `page_size`; `tokentop generate` says --page-size."""
    from engine.config import WorkerConfig
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^`page_size` must be a power of two, got 3$"):
        WorkerConfig(page_size=3).validate()
    assert main(["generate", "hello", "--device", SIM, "--page-size", "3"]) == 2
    assert capsys.readouterr().err == "tokentop: error: --page-size must be a power of two, got 3\n"


@pytest.mark.parametrize("value, fragment", [
    ("abc", "argument --serve: cannot read 'abc' as [HOST:]PORT: write e.g. 8000 or 0.0.0.0:8000"),
    ("0.0.0.0:70000", "argument --serve: '0.0.0.0:70000': the port must be 0..65535"),
])
def test_a_bad_serve_address_names_the_flag(capsys, value, fragment):
    with pytest.raises(SystemExit) as exit_:
        main(["--device", SIM, "--serve", value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and fragment in err, err


@pytest.mark.parametrize("command", [["generate", "--prompt-file"], ["--burst-file"]], ids=["prompt", "burst"])
def test_a_file_flag_that_never_ends_or_never_opens_is_one_line(tmp_path, command):
    """--prompt-file /dev/zero and --burst-file /dev/zero grew to 6 GB in 10 s; a named pipe
    blocked forever. Run in a child: without the fix the test fails, the runner lives."""
    fifo = tmp_path / "input"
    os.mkfifo(fifo)
    for path, kind in (("/dev/zero", "a character device"), (str(fifo), "a named pipe")):
        code = f"import sys\nfrom app.cli import main\nsys.exit(main({[*command, path]!r}))\n"
        out = run_bounded(code, timeout_s=60, memory=2 << 30)
        assert out.returncode == 2 and out.stdout == "", out.stderr[-2000:]
        assert out.stderr.count("\n") == 1 and f"{path}: it is not a regular file (it is {kind})" in out.stderr


def test_a_prompt_above_the_size_limit_is_one_line(tmp_path, monkeypatch, capsys, no_weights):
    assert MAX_PROMPT_FILE_BYTES == 8 * 2**20
    big = tmp_path / "prompt.txt"
    with open(big, "wb") as f:
        f.truncate(MAX_PROMPT_FILE_BYTES + 1)
    assert main(["generate", "--prompt-file", str(big)]) == 2
    err = capsys.readouterr().err
    assert err == f"tokentop: error: cannot read --prompt-file {big}: it is larger than 8 MiB, the most " \
                  f"tokentop reads from such a file\n"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"x" * (MAX_PROMPT_FILE_BYTES + 1))))
    assert main(["generate", "--prompt-file", "-"]) == 2
    assert "cannot read --prompt-file -: it is larger than 8 MiB" in capsys.readouterr().err
