"""tokentop compare: one burst under A, then B, on fresh engines (engine/facade/compare.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from app.bursts import default_prompts_dir, load_burst
from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.errors import ConfigError
from engine.facade.compare import (RequestOutcome, SideResult, compare, compare_outputs, configure,
                                   format_report, parse_settings, seeded)
from engine.facade.devices import parse_devices

SIM = ["sim:gpu0:prefill=20000,decode=2000", "sim:gpu1:prefill=10000,decode=1000"]


@dataclass
class Item:
    id: str
    prompt: str | None
    params: SamplingParams = field(default_factory=SamplingParams)
    messages: list | None = None


def sim_config(model, devices=SIM, **worker) -> EngineConfig:
    base = WorkerConfig(model=str(model), kv_cache_memory=16 * 2**20, **worker)
    return EngineConfig(workers=parse_devices(devices, base), worker_mode="thread")


@pytest.mark.parametrize("pairs, words", [
    (["single-flight"], "write KEY=VALUE"),
    (["flavour=mint"], "no setting 'flavour'; settings: policy, router-policy"),
    (["policy=lifo"], "policy takes one of fcfs, spf"),
    (["max-active=0"], "max-active takes a whole number of at least 1"),
    (["spec-tv-budget=lots"], "spec-tv-budget takes a number"),
])
def test_bad_settings_are_one_line(pairs, words):
    with pytest.raises(ConfigError, match=words) as err:
        parse_settings(pairs, "--a")
    assert "\n" not in str(err.value) and str(err.value).startswith("--a ")


def test_compare_names_each_setting_as_its_flag_from_the_one_map():
    """compare's keys are the command line's flags without the dashes: both come from
    engine/config.py's SETTING_NAMES, so a renamed flag renames the setting."""
    from app.flags import FIELD_FLAGS
    from engine.facade.compare import SETTINGS

    fields = {key: name for key, (kind, name, _) in SETTINGS.items() if kind != "force"}
    assert fields and all(FIELD_FLAGS[name] == f"--{key}" for key, name in fields.items()), fields
    assert [key for key, (kind, _, _) in SETTINGS.items() if kind == "force"] == ["worker"]


def test_settings_reach_the_workers_the_router_and_the_forced_worker(tiny_model_path):
    config = sim_config(tiny_model_path("qwen2"))
    settings = parse_settings(["policy=spf", "max-active=3", "router-policy=cache-aware", "prefix-cache=off",
                               "single-flight=at-completion", "spec-k=4", "worker=1"], "--b")
    side, force = configure(config, settings)
    assert force == 1 and side.router_policy == "cache-aware"
    assert all((w.policy, w.max_active, w.prefix_cache, w.single_flight, w.spec_k) ==
               ("spf", 3, "off", "at-completion", "4") for w in side.workers)
    with pytest.raises(ConfigError, match="worker=5: there are 2 workers"):
        configure(config, {"worker": 5})
    with pytest.raises(ConfigError, match=r"`speculate=draft` needs `draft_model=NAME\|PATH`"):
        configure(config, {"speculate": "draft"})


def test_both_sides_get_the_same_seeds():
    items = [Item("a", "x", SamplingParams(temperature=0.7)), Item("b", "y", SamplingParams(temperature=0.7, seed=5))]
    assert [p.seed for p in seeded(items)] == [1000, 5] == [p.seed for p in seeded(items)]


def test_single_flight_compare_on_sim_workers(tiny_model_path, tmp_path, capsys):
    """The seeds' single-flight experiment: 4 identical requests at once, cold caches, single
    flight off vs after-prefill, a step budget that can admit all four together."""
    from app.cli import main
    model = tiny_model_path("qwen2", context_length=8192)
    out = tmp_path / "report.json"
    code = main(["compare", str(default_prompts_dir() / "single_flight_4.jsonl"), "--a", "single-flight=off",
                 "--b", "single-flight=after-prefill", "--model", str(model), "--device", SIM[0],
                 "--kv-cache-memory", "16MiB", "--max-batched-tokens", "16384", "--worker-mode", "thread",
                 "--out", str(out)])
    printed, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out.read_text())
    a, b = report["a"], report["b"]
    assert a["label"] == "single-flight=off" and b["label"] == "single-flight=after-prefill"
    for side in (a, b):
        s = side["summary"]
        assert s["requests"] == s["ok"] == 4 and s["aggregate_tok_s"] > 0 and s["completion_s"] > 0
        assert s["ttft_p50"] <= s["ttft_p95"] <= s["ttft_p99"] and s["e2e_p99"] >= s["ttft_p99"]
        assert [r["id"] for r in side["requests"]] == ["sf4-1", "sf4-2", "sf4-3", "sf4-4"]
        assert all(r["finish_reason"] in ("stop", "length") and r["output_tokens"] > 0 for r in side["requests"])
    cached_a, cached_b = (sum(r["cached_tokens"] for r in side["requests"]) for side in (a, b))
    prompt = a["requests"][0]["prompt_tokens"]
    # with single flight every follower restores the note (without it, only those admitted after the
    # leader's pages were published do: a matter of timing)
    assert cached_b >= 3 * (prompt - 16) and cached_b >= cached_a, (cached_a, cached_b, prompt)
    assert report["outputs"] == {"compared": False, "why": "simulated workers produce placeholder text"}
    assert report["b_over_a"]["ttft_p50"] == pytest.approx(b["summary"]["ttft_p50"] / a["summary"]["ttft_p50"], rel=1e-3)
    for words in ("TTFT p50", "TTFT p99", "ITL p95", "end-to-end p99", "aggregate tok/s", "completion",
                  "A: single-flight=off", "B: single-flight=after-prefill", "sf4-3", "outputs: not compared"):
        assert words in printed, words
    assert f"report written to {out}" in err


def test_forced_baseline_against_the_cost_router(tiny_model_path):
    """The routing experiment's shape: every request forced onto the fast worker vs routed."""
    items = load_burst(default_prompts_dir() / "warm_prefix_8.jsonl")
    warm = load_burst(default_prompts_dir() / "warm_prefix_seed.jsonl")
    config = sim_config(tiny_model_path("qwen2", context_length=8192), max_active=4)
    report = compare(config, items, {"worker": 0}, {"router-policy": "cost"}, interval_s=0.01, warm=warm)
    assert report["a"]["summary"]["requests_per_worker"] == {"0": 8}
    assert report["warm_up_requests"] == 1
    # warm caches on both workers: every measured request restores the note's pages
    assert all(r["cached_tokens"] >= 2000 for side in ("a", "b") for r in report[side]["requests"])
    assert "after 1 warm-up request(s) per worker" in format_report(report)


def test_greedy_outputs_on_real_workers_are_compared(tiny_model_path):
    model = tiny_model_path("qwen2")
    config = EngineConfig(workers=(WorkerConfig(model=str(model), threads=1, calibrate=False, max_active=1),),
                          worker_mode="thread")
    items = [Item(f"q{i}", f"prompt number {i}", SamplingParams(max_tokens=4)) for i in range(2)]
    report = compare(config, items, {"policy": "fcfs"}, {"policy": "spf"})
    assert report["outputs"] == {"compared": True, "greedy_requests": 2, "identical": True, "differing": []}
    assert "outputs: identical on all 2 greedy requests" in format_report(report)


def test_differing_outputs_are_named():
    def side(tokens):
        return SideResult("A", {}, [RequestOutcome(f"q{i}", 0, "length", None, 3, 0, 2, 0.1, 0.01, 0.2, True, t)
                                    for i, t in enumerate(tokens)], 1.0,
                          [{"index": 0, "name": "cpu", "device": "cpu", "simulated": False, "state": "ready"}])
    got = compare_outputs(side([[1, 2], [3, 4]]), side([[1, 2], [3, 5]]))
    assert got == {"compared": True, "greedy_requests": 2, "identical": False, "differing": ["q1"]}


def test_compare_command_errors_are_one_line(tmp_path, capsys):
    from app.cli import main
    burst = default_prompts_dir() / "single_flight_2.jsonl"
    for argv, words in [(["--a", "nope=1"], "no setting 'nope'"),
                        (["--b", "max-active=x"], "max-active takes"),
                        (["--interval-ms", "-5"], "--interval-ms must be >= 0")]:
        code = main(["compare", str(burst), *argv, "--device", "sim:a:prefill=1,decode=1"])
        out, err = capsys.readouterr()
        assert code == 2 and err.count("\n") == 1 and words in err and "Traceback" not in err
    code = main(["compare", str(tmp_path / "missing.jsonl"), "--device", "sim:a:prefill=1,decode=1"])
    out, err = capsys.readouterr()
    assert code == 2 and "Burst file not found" in err and err.count("\n") == 1


def test_compare_figures_agree_with_bench_on_the_same_burst(tiny_model_path):
    """`tokentop compare` and `tokentop bench batching` on the same scenario (8 requests at once,
    32 tokens each to the end, one worker) agree on the burst's aggregate tok/s within noise.
    The worker is simulated (a timed wait at its declared rate, labelled so in the report), so
    the scenario's throughput is known: 400 tok/s."""
    from statistics import median

    from engine.bench.common import timed_burst
    from engine.facade.engine import Engine

    config = sim_config(tiny_model_path("qwen2", context_length=8192), ["sim:gpu0:prefill=20000,decode=400"],
                        max_active=8)
    n, out_tokens = 8, 32
    with Engine(config).start(timeout=60) as engine:
        timed_burst(engine, 2, 8, True, "warm")
        bench = median(n * out_tokens / timed_burst(engine, n, out_tokens, True, f"run {r}") for r in range(3))
    items = [Item(f"q{i}", f"request {i}: write out the numbers from one to a hundred",
                  SamplingParams(max_tokens=out_tokens, ignore_eos=True)) for i in range(n)]
    report = compare(config, items, {"policy": "fcfs"}, {"policy": "spf"})
    assert report["workers"][0]["simulated"]
    for side in ("a", "b"):
        s = report[side]["summary"]
        assert s["ok"] == n and s["output_tokens"] == n * out_tokens
        assert s["aggregate_tok_s"] == pytest.approx(bench, rel=0.1), (side, s["aggregate_tok_s"], bench)
    assert bench == pytest.approx(400, rel=0.15)


def test_no_side_is_measured_on_the_torch_fallback():
    """A worker building its kernels (first use) serves on torch matmuls: compare waits for it."""
    from types import SimpleNamespace

    from engine.errors import TokentopError
    from engine.facade.compare import wait_for_kernels

    class Engine:
        def __init__(self, building_for: int):
            self.polls, self.building_for = 0, building_for

        def snapshot(self):
            self.polls += 1
            return SimpleNamespace(workers=[SimpleNamespace(index=0, state="ready", kernels_building=False),
                                            SimpleNamespace(index=1, state="ready",
                                                            kernels_building=self.polls <= self.building_for)])
    said = []
    engine = Engine(building_for=3)
    wait_for_kernels(engine, said.append, poll_s=0)
    assert engine.polls == 4 and said == ["waiting for worker(s) 1 to build their kernels (first use)"]
    with pytest.raises(TokentopError, match="still on the torch fallback"):
        wait_for_kernels(Engine(building_for=10**9), said.append, limit_s=0, poll_s=0)


def test_speculation_acceptance_is_recorded_per_request_and_explained(tiny_model_path):
    model = tiny_model_path("qwen2")
    config = EngineConfig(workers=(WorkerConfig(model=str(model), threads=1, calibrate=False, deterministic=True),),
                          worker_mode="thread")
    prompts = ["zebra " * 20, "one two three four one two three four one two"]
    items = [Item(f"q{i}", p, SamplingParams(max_tokens=24, ignore_eos=True)) for i, p in enumerate(prompts)]
    report = compare(config, items, {"speculate": "off"}, {"speculate": "ngram", "spec-k": "4"})
    assert report["outputs"]["identical"]
    assert all(r["acceptance_rate"] is None and r["speculate"] is None for r in report["a"]["requests"])
    b = report["b"]["requests"]
    assert all(r["speculate"] == "ngram" and r["draft_tokens"] > 0 for r in b)
    for r in b:
        assert r["acceptance_rate"] == round(r["accepted_tokens"] / r["draft_tokens"], 4)
        assert r["mean_accepted_length"] == round(1 + r["accepted_tokens"] / r["spec_rounds"], 3)
    sb = report["b"]["summary"]
    assert sb["draft_tokens"] == sum(r["draft_tokens"] for r in b) and sb["acceptance_rate"] > 0
    assert report["a"]["summary"]["acceptance_rate"] is None
    text = format_report(report)
    assert "acceptance" in text and "accepted length" in text
    assert f"B: {sb['acceptance_rate']:.0%} of {sb['draft_tokens']} drafted tokens accepted" in text
    assert "A: no drafts" in text


def test_rounds_alternate_the_sides_and_take_medians_of_each_rounds_ratio(monkeypatch):
    """--rounds N: A B, B A, A B, ...; each side's summary is the median of its runs, B/A the
    median of the rounds' own ratios (a drifting machine slows both runs of a round alike)."""
    import engine.facade.compare as cmp

    calls = []
    # completion seconds per run, in call order: the machine slows down from round to round
    seconds = {"A": iter([1.0, 2.0, 4.0]), "B": iter([0.8, 2.5, 5.0])}
    tokens = {"A": iter([[5, 6], [5, 6], [5, 6]]), "B": iter([[5, 6], [5, 7], [5, 6]])}

    def fake_side(name, config, settings, items, **kw):
        calls.append(name)
        req = RequestOutcome("q0", 0, "length", None, 3, 0, 2, 0.1, 0.01, 0.2, True, next(tokens[name]))
        return SideResult(name, settings, [req], next(seconds[name]),
                          [{"index": 0, "name": "cpu", "device": "cpu", "simulated": False, "state": "ready"}])

    monkeypatch.setattr(cmp, "run_side", fake_side)
    monkeypatch.setattr(cmp, "configure", lambda config, settings: (config, None))
    report = compare(None, [Item("q0", "x")], {"speculate": "off"}, {"speculate": "suffix"}, rounds=3)
    assert calls == ["A", "B", "B", "A", "A", "B"]
    rounds = report["rounds"]
    assert rounds["count"] == 3 and rounds["order"] == ["AB", "BA", "AB"]
    # aggregate tok/s = 2 tokens / completion: B/A per round = A's seconds / B's seconds
    assert rounds["b_over_a_runs"]["aggregate_tok_s"] == [1.25, 0.8, 0.8]
    assert report["b_over_a"]["aggregate_tok_s"] == 0.8          # the median round
    assert rounds["b_over_a_runs"]["completion_s"] == [0.8, 1.25, 1.25]
    assert report["a"]["summary"]["completion_s"] == 2.0 and report["b"]["summary"]["completion_s"] == 2.5
    assert report["a"]["summary"]["ok"] == 1 and isinstance(report["a"]["summary"]["ok"], int)
    # the second round's greedy outputs differed: not identical, though rounds 1 and 3 were
    assert report["outputs"] == {"compared": True, "greedy_requests": 1, "identical": False,
                                 "differing": ["q0"], "rounds": 3}
    text = format_report(report)
    assert "3 rounds, alternated (AB BA AB)" in text
    assert "aggregate tok/s B/A by round: 1.250 0.800 0.800" in text
    assert "request (round 1)" in text


def test_one_round_is_the_plain_report(monkeypatch):
    import engine.facade.compare as cmp

    def fake_side(name, config, settings, items, **kw):
        req = RequestOutcome("q0", 0, "length", None, 3, 0, 2, 0.1, 0.01, 0.2, True, [1, 2])
        return SideResult(name, settings, [req], 1.0 if name == "A" else 2.0,
                          [{"index": 0, "name": "cpu", "device": "cpu", "simulated": False, "state": "ready"}])

    monkeypatch.setattr(cmp, "run_side", fake_side)
    monkeypatch.setattr(cmp, "configure", lambda config, settings: (config, None))
    report = compare(None, [Item("q0", "x")], {}, {"policy": "spf"})
    assert "rounds" not in report and report["b_over_a"]["completion_s"] == 2.0
    assert report["outputs"] == {"compared": True, "greedy_requests": 1, "identical": True, "differing": []}
    text = format_report(report)
    assert "rounds" not in text and "by round" not in text and "in every round" not in text
    with pytest.raises(ConfigError, match="the number of rounds must be at least 1"):
        compare(None, [Item("q0", "x")], {}, {}, rounds=0)


def test_compare_command_takes_rounds(tiny_model_path, tmp_path, capsys):
    from app.cli import main
    model = tiny_model_path("qwen2", context_length=8192)
    out = tmp_path / "report.json"
    code = main(["compare", str(default_prompts_dir() / "single_flight_2.jsonl"), "--a", "policy=fcfs",
                 "--b", "policy=spf", "--model", str(model), "--device", SIM[0], "--kv-cache-memory", "16MiB",
                 "--worker-mode", "thread", "--rounds", "2", "--out", str(out)])
    printed, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["rounds"]["order"] == ["AB", "BA"] and len(report["rounds"]["b_over_a_runs"]["aggregate_tok_s"]) == 2
    assert "round 2 of 2, B: starting the engine" in err and "by round:" in printed
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "x.jsonl", "--rounds", "0"])
    assert exit_.value.code == 2 and "--rounds" in capsys.readouterr().err


def test_a_figure_some_runs_lack_is_the_median_of_the_runs_that_have_it():
    """A speculating side whose first run drafted nothing: its acceptance is that of the runs
    that drafted, and the report prints it (it raised on None)."""
    from engine.facade.compare import _speculation_line, median_summary

    runs = [{"draft_tokens": 0, "acceptance_rate": None, "mean_accepted_length": None, "ok": 3},
            {"draft_tokens": 12, "acceptance_rate": 0.5, "mean_accepted_length": 2.0, "ok": 3},
            {"draft_tokens": 8, "acceptance_rate": 0.75, "mean_accepted_length": 3.0, "ok": 3}]
    summary = median_summary(runs)
    assert summary == {"draft_tokens": 8, "acceptance_rate": 0.625, "mean_accepted_length": 2.5, "ok": 3}
    assert _speculation_line("B", summary) == "B: 62% of 8 drafted tokens accepted, 2.50 tokens per verify round"
