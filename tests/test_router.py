"""Router policies as pure functions of the load they are given (no engine, no workers)."""
import pytest

from engine.errors import ConfigError
from engine.facade.router import Router, WorkerLoad


def loads(*specs, **over):
    """WorkerLoads from (prefill_rate, decode_rate) pairs; `over` sets fields on every one."""
    return [WorkerLoad(worker=i, name=f"w{i}", prefill_rate=p, decode_rate=d, **over)
            for i, (p, d) in enumerate(specs)]


def test_round_robin_takes_turns_and_skips_dead_workers():
    router = Router("round-robin")
    ws = loads((1, 1), (1, 1), (1, 1))
    assert [router.choose(f"r{i}", 10, 10, ws).chosen for i in range(4)] == [0, 1, 2, 0]
    ws[1].alive = False
    assert [router.choose(f"s{i}", 10, 10, ws).chosen for i in range(3)] == [2, 0, 2]


def test_least_loaded_counts_running_and_waiting_and_breaks_ties_by_index():
    ws = loads((1, 1), (1, 1), (1, 1))
    ws[0].running, ws[1].waiting, ws[2].running = 2, 1, 1
    assert Router("least-loaded").choose("r", 10, 10, ws).chosen == 1
    assert Router("least-loaded").choose("r", 10, 10, loads((1, 1), (1, 1))).chosen == 0


def test_cost_is_seconds_of_prefill_plus_decode_work():
    # mini-vllm-rs's worked example (Apple M2 rates): the GPU's queue 60 prefill tokens and
    # 880 decode tokens counted with the incoming request scores 60/2551 + 880/293 = 3.027 s
    gpu = WorkerLoad(0, "gpu", 2551.0, 293.0, running=4, waiting=2, prefill_tokens=40, decode_tokens=752)
    cpu = WorkerLoad(1, "cpu", 73.0, 45.0)
    d = Router("cost").choose("r7", 516, 128, [gpu, cpu], cached={0: 496})
    g, c = d.candidates
    assert (g.prefill_tokens, g.decode_tokens, g.cached_tokens) == (60, 880, 496)
    assert g.score == pytest.approx(60 / 2551 + 880 / 293) == pytest.approx(3.027, abs=1e-3)
    assert c.score == pytest.approx(516 / 73 + 128 / 45)
    assert d.chosen == 0 and d.policy == "cost" and d.chosen_reuse == 496


def test_reuse_never_covers_the_whole_prompt():
    d = Router("cost").choose("r", 32, 1, loads((100, 10)), cached={0: 32})
    assert d.candidates[0].cached_tokens == 31 and d.candidates[0].prefill_tokens == 1


def test_forced_choice_is_recorded_as_forced_with_every_candidate_scored():
    d = Router("cost").choose("r", 100, 10, loads((1000, 100), (10, 1)), force=1)
    assert d.chosen == 1 and d.policy == "forced" and len(d.candidates) == 2
    assert d.to_json()["candidates"][1]["worker"] == 1


def test_no_live_worker_is_an_error():
    with pytest.raises(RuntimeError, match="no live worker"):
        Router("cost").choose("r", 10, 10, loads((1, 1), alive=False))


def test_an_unknown_policy_is_a_config_error_naming_the_setting():
    with pytest.raises(ConfigError, match="`router_policy`"):
        Router("random")
    router = Router("cost")
    with pytest.raises(ConfigError):
        router.set_policy("fastest")
    assert router.policy == "cost"


def test_cache_aware_reasons():
    router = Router("cache-aware")
    ws = loads((1000, 100), (1000, 100))
    assert router.choose("r", 100, 10, ws, cached={1: 64}).reason == "longest prefix"
    d = router.choose("r", 100, 10, ws)
    assert (d.chosen, d.reason) == (0, "miss")
    ws[1].decode_tokens = 1000          # 10 s of outstanding work on the cached worker
    d = router.choose("r", 100, 10, ws, cached={1: 64})
    assert (d.chosen, d.reason) == (0, "imbalanced")


def test_nominal_rates_are_flagged_on_the_candidate_and_labelled_in_the_routing_panel():
    from app.widgets.routing import format_candidate

    calibrated = WorkerLoad(0, "cpu", 400.0, 30.0)
    uncalibrated = WorkerLoad(1, "cuda:0", 100.0, 10.0, nominal=True)
    d = Router("cost").choose("r", 100, 10, [calibrated, uncalibrated])
    assert [c.nominal for c in d.candidates] == [False, True]
    assert "nominal" not in format_candidate(d.candidates[0], d, 200)
    wide, narrow = format_candidate(d.candidates[1], d, 200), format_candidate(d.candidates[1], d, 30)
    assert "nominal (not calibrated yet)" in wide and "nominal" in narrow   # kept beside the score


def test_an_uncalibrated_real_worker_routes_on_nominal_rates_and_says_so(tiny_model_path):
    from engine.config import EngineConfig, SamplingParams, WorkerConfig
    from engine.facade.devices import parse_devices
    from engine.facade.engine import Engine

    workers = parse_devices(["cpu", "sim:gpu0"], WorkerConfig(model=str(tiny_model_path("qwen2")),
                                                              calibrate=False))
    with Engine(EngineConfig(workers=workers, worker_mode="thread")).start(timeout=120) as engine:
        engine.submit("hello", params=SamplingParams(max_tokens=2)).result(30)
        cands = engine.snapshot().routing[-1].candidates
        assert [(c.name, c.nominal) for c in cands] == [("cpu", True), ("sim:gpu0", False)]
