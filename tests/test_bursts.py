"""Burst files: every shipped file loads; every kind of mistake names its file and line."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from app.bursts import MAX_BURST_FILE_BYTES, MAX_BURST_REQUESTS, BurstFileError, default_prompts_dir, list_burst_files, load_burst
from engine.bench.spec import CODE_TASK
from engine.config import SamplingParams
from engine.errors import InvalidRequest
from tests.fixtures.bounded import run_bounded

SHIPPED = ("code_refactor.jsonl", "creative_scene.jsonl", "identical.jsonl", "mixed.jsonl",
           "shared_document.jsonl", "single_flight_2.jsonl", "single_flight_4.jsonl", "single_flight_8.jsonl",
           "spec_code_edit.jsonl", "spec_creative.jsonl", "spec_refactor.jsonl", "warm_prefix_48.jsonl",
           "warm_prefix_8.jsonl",
           "warm_prefix_seed.jsonl")


def _write(tmp_path: Path, *lines: str, name: str = "b.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_every_shipped_file_loads():
    directory = default_prompts_dir()
    files = list_burst_files(directory)
    assert [f.name for f in files] == list(SHIPPED)
    for f in files:
        items = load_burst(f)
        assert items, f
        for item in items:
            assert (item.prompt is None) != (item.messages is None)
            assert item.params == item.params.validate()


def test_shipped_files_fit_their_experiments():
    directory = default_prompts_dir()
    identical = load_burst(directory / "identical.jsonl")
    assert len(identical) == 4 and len({i.prompt for i in identical}) == 1
    assert all(i.params.greedy for i in identical)

    shared = load_burst(directory / "shared_document.jsonl")
    assert len(shared) == 8
    prefix = shared[0].prompt[: shared[0].prompt.index("Q: ")]
    assert len(prefix) > 2000   # ~512 tokens of text
    assert all(i.prompt.startswith(prefix) for i in shared)
    assert len({i.prompt for i in shared}) == 8

    refactor = load_burst(directory / "code_refactor.jsonl")
    assert len(refactor) >= 3
    assert len({json.dumps(i.messages[:1]) for i in refactor}) == 1   # one shared system message


def test_compare_bursts_fit_the_experiments_they_repeat():
    """tokentop compare's files (sample_prompts/README.md): single flight with 2, 4 and 8
    identical greedy requests; routing with a warm ~512-token prefix, 8 and 48 requests of one
    prompt and exactly 128 tokens; speculation on a code edit and on bench spec's refactor
    (greedy) and a creative scene (sampled, three seeds)."""
    directory = default_prompts_dir()
    for n in (2, 4, 8):
        burst = load_burst(directory / f"single_flight_{n}.jsonl")
        assert len(burst) == n and len({i.prompt for i in burst}) == 1 and all(i.params.greedy for i in burst)
    seed, = load_burst(directory / "warm_prefix_seed.jsonl")
    for n in (8, 48):
        burst = load_burst(directory / f"warm_prefix_{n}.jsonl")
        assert len(burst) == n and len({i.prompt for i in burst}) == 1
        assert burst[0].prompt.startswith(seed.prompt) and len(burst[0].prompt) > len(seed.prompt)
        assert all(i.params.max_tokens == 128 and i.params.ignore_eos for i in burst)
    code, = load_burst(directory / "spec_code_edit.jsonl")
    assert code.params.greedy and code.messages[0]["role"] == "system"
    refactor, = load_burst(directory / "spec_refactor.jsonl")
    assert refactor.params.greedy and refactor.messages == [{"role": "user", "content": CODE_TASK}]
    creative = load_burst(directory / "spec_creative.jsonl")
    assert [i.params.seed for i in creative] == [1, 2, 3] and all(i.params.temperature == 0.7 for i in creative)


def test_fields_become_sampling_params_and_ids_default_to_line(tmp_path):
    path = _write(
        tmp_path,
        '{"prompt": "Hi", "max_tokens": 8, "temperature": 0.5, "top_k": 40, "stop": "\\n", "seed": 3}',
        "",
        '{"id": "chat", "messages": [{"role": "user", "content": "Hello"}], "stop": ["a", "b"], "ignore_eos": true}',
        name="demo.jsonl",
    )
    first, second = load_burst(path)
    assert first.id == "demo-1" and first.prompt == "Hi" and first.messages is None
    assert first.params == SamplingParams(max_tokens=8, temperature=0.5, top_k=40, stop=("\n",), seed=3)
    assert first.source == f"{path}:1"
    assert second.id == "chat" and second.messages == [{"role": "user", "content": "Hello"}]
    assert second.params.stop == ("a", "b") and second.params.ignore_eos is True
    assert second.source == f"{path}:3"


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "x", ', "not valid JSON"),
    ('["prompt"]', "expected a JSON object, got list"),
    ('{"max_tokens": 4}', "found neither"),
    ('{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}', "found both"),
    ('{"prompt": ""}', '"prompt" must be a non-empty string'),
    ('{"prompt": 12}', '"prompt" must be a non-empty string'),
    ('{"messages": []}', '"messages" must be a non-empty list'),
    ('{"messages": [{"role": "user"}]}', 'messages[0] must be an object with exactly "role" and "content"'),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "messages[0].role must be one of"),
    ('{"messages": [{"role": "user", "content": 5}]}', "messages[0].content must be a string"),
    ('{"prompt": "x", "id": 7}', '"id" must be a non-empty string'),
    ('{"prompt": "x", "max_tokens": "many"}', '"max_tokens" must be an integer, got "many"'),
    ('{"prompt": "x", "max_tokens": 12.5}', '"max_tokens" must be an integer'),
    ('{"prompt": "x", "max_tokens": true}', '"max_tokens" must be an integer, got true'),
    ('{"prompt": "x", "temperature": "hot"}', '"temperature" must be a number'),
    ('{"prompt": "x", "stop": [1]}', '"stop" must be a string or a list of strings'),
    ('{"prompt": "x", "ignore_eos": 1}', '"ignore_eos" must be true or false'),
    ('{"prompt": "x", "max_token": 5}', "unknown field max_token; accepted: id, prompt, messages"),
    ('{"prompt": "x", "temperature": -1}', "temperature must be 0 (greedy) or at least 1e-05"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens must be a positive integer"),
    ('{"prompt": "x", "stop": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested deeper than 64 levels"),
    ("[" * 100_000 + "]" * 100_000, "JSON nested deeper than 64 levels"),
    ('{"prompt": "x", "stop": ' + "[" * 60 + "]" * 60 + "}", '"stop" must be a string or a list of strings'),
    ('{"prompt": "x", "seed": "' + "9" * 5000 + '"}', '"seed" must be an integer, got "99999'),
])
def test_bad_line_names_file_and_line(tmp_path, line, message):
    path = _write(tmp_path, '{"prompt": "fine"}', line)
    with pytest.raises(BurstFileError) as err:
        load_burst(path)
    assert str(err.value).startswith(f"{path}:2: ")
    assert message in str(err.value)
    assert isinstance(err.value, InvalidRequest)


def test_duplicate_ids_empty_missing_and_undecodable_files(tmp_path):
    dup = _write(tmp_path, '{"id": "a", "prompt": "x"}', '{"id": "a", "prompt": "y"}', name="dup.jsonl")
    with pytest.raises(BurstFileError, match=r"dup.jsonl:2: id 'a' is already used on .*dup.jsonl:1"):
        load_burst(dup)
    with pytest.raises(BurstFileError, match="has no requests"):
        load_burst(_write(tmp_path, "", "   ", name="empty.jsonl"))
    with pytest.raises(BurstFileError, match="Burst file not found: .*nope.jsonl"):
        load_burst(tmp_path / "nope.jsonl")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"prompt": "café"}\n'.encode("latin-1"))
    with pytest.raises(BurstFileError, match="Cannot read burst file .*latin1.jsonl"):
        load_burst(latin1)


def test_a_burst_file_that_never_ends_or_never_opens_is_refused(tmp_path):
    """/dev/zero grew to 6 GB in 10 s and a named pipe blocked forever (the dashboard's dialog
    reads a typed path the same way). Run in a child: without the fix the test fails, the
    runner lives."""
    fifo = tmp_path / "burst.jsonl"
    os.mkfifo(fifo)
    code = ("from app.bursts import BurstFileError, load_burst\n"
            f"for path in ('/dev/zero', {str(fifo)!r}):\n"
            "    try:\n"
            "        load_burst(path)\n"
            "    except BurstFileError as e:\n"
            "        print(e)\n")
    out = run_bounded(code, timeout_s=30, memory=2 << 30)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [
        "Cannot read burst file /dev/zero: it is not a regular file (it is a character device)",
        f"Cannot read burst file {fifo}: it is not a regular file (it is a named pipe)"]


def test_a_burst_file_above_the_size_limit_is_refused(tmp_path):
    assert MAX_BURST_FILE_BYTES == 16 * 2**20
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.truncate(MAX_BURST_FILE_BYTES + 1)         # sparse: nothing is written
    with pytest.raises(BurstFileError, match=r"Cannot read burst file .*big\.jsonl: it is larger than 16 MiB"):
        load_burst(big)
    with open(big, "wb") as f:
        f.truncate(MAX_BURST_FILE_BYTES)             # at the limit: read (and refused for what it holds)
    with pytest.raises(BurstFileError, match=r"big\.jsonl:1: not valid JSON"):
        load_burst(big)


def test_list_burst_files_sorted_jsonl_only(tmp_path):
    for name in ("b.jsonl", "a.jsonl", "notes.md", "c.json"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "dir.jsonl").mkdir()
    assert [p.name for p in list_burst_files(tmp_path)] == ["a.jsonl", "b.jsonl"]


def test_a_burst_file_holds_at_most_its_request_cap(tmp_path):
    """10^6 one-line requests once queued for minutes and gigabytes: the cap stops the read."""
    assert MAX_BURST_REQUESTS == 10_000
    path = tmp_path / "many.jsonl"
    path.write_text('{"prompt": "a"}\n' * (MAX_BURST_REQUESTS + 1))
    with pytest.raises(BurstFileError, match=rf"many\.jsonl:10001: more than 10,000 requests .*--max-burst-requests"):
        load_burst(path)
    assert len(load_burst(path, max_requests=MAX_BURST_REQUESTS + 1)) == MAX_BURST_REQUESTS + 1
    three = _write(tmp_path, '{"prompt": "a"}', "", '{"prompt": "b"}', '{"prompt": "c"}', name="three.jsonl")
    with pytest.raises(BurstFileError, match=r"three\.jsonl:4: more than 2 requests"):
        load_burst(three, max_requests=2)


@pytest.mark.parametrize("argv", [["compare", "{path}"], ["--burst-file", "{path}"]], ids=["compare", "dashboard"])
def test_the_request_cap_is_a_flag_and_a_one_line_error(argv, tmp_path, capsys):
    from app.cli import main
    path = _write(tmp_path, *['{"prompt": "a"}'] * 3, name="three.jsonl")
    argv = [a.format(path=path) for a in argv]
    assert main([*argv, "--max-burst-requests", "2"]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "three.jsonl:3: more than 2 requests" in err and "Traceback" not in err
    nested = _write(tmp_path, '{"prompt": "a", "stop": ' + "[" * 5000 + "]" * 5000 + "}", name="nested.jsonl")
    assert main([a.replace(str(path), str(nested)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nested.jsonl:1: JSON nested deeper than 64 levels" in err
    assert "RecursionError" not in err and "Traceback" not in err
