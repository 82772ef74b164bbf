"""engine/worker/prefetch.py: where the packed kernels prefetch, measured once per machine and
model, cached, and overridden by hand. The timings are faked here: what is tested is the choice
made from them, the cache and the precedence (the bits are test_kernels.py's)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from engine.worker import prefetch


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """A model of 64 MiB of packed layers on an AVX-512 machine with a 32 MiB cache, a private
    cache dir, no prefetch choice in the environment, and measure() counted."""
    monkeypatch.setenv("TOKENTOP_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(prefetch.ENV, raising=False)
    monkeypatch.setattr(prefetch, "_set_here", None)
    layers = [SimpleNamespace(gguf=SimpleNamespace(nbytes=32 << 20)) for _ in range(2)]
    monkeypatch.setattr(prefetch, "_packed_layers", lambda model: layers)
    monkeypatch.setattr(prefetch.kernels, "isa_name", lambda: "avx512")
    monkeypatch.setattr(prefetch.kernels, "build_key", lambda: "build1")
    monkeypatch.setattr("engine.cpuinfo.last_level_cache_bytes", lambda: 32 << 20)
    model_file = tmp_path / "m.gguf"
    model_file.write_bytes(b"x" * 100)
    calls = []

    def measure(model):
        calls.append(model)
        return {"l1_s": 0.02, "l2_s": 0.015, "choice": "l2"}

    monkeypatch.setattr(prefetch, "measure", measure)
    return SimpleNamespace(path=str(model_file), calls=calls, layers=layers, tmp=tmp_path)


def test_the_first_load_measures_and_the_next_reads_the_cache(setup):
    assert prefetch.choose("model", setup.path) == "l2"
    assert len(setup.calls) == 1
    assert prefetch.os.environ[prefetch.ENV] == "l2"
    entry, = json.loads(prefetch.cache_path().read_text()).values()
    assert entry["choice"] == "l2"
    assert prefetch.choose("model", setup.path) == "l2"
    assert len(setup.calls) == 1                       # cached: not measured again
    assert prefetch.choose("model", setup.path, recalibrate=True) == "l2"
    assert len(setup.calls) == 2


def test_another_model_file_or_kernel_build_is_measured_anew(setup, monkeypatch):
    prefetch.choose("model", setup.path)
    (setup.tmp / "m.gguf").write_bytes(b"x" * 101)     # another file under the same name
    prefetch.choose("model", setup.path)
    monkeypatch.setattr(prefetch.kernels, "build_key", lambda: "build2")
    prefetch.choose("model", setup.path)
    assert len(setup.calls) == 3
    assert len(json.loads(prefetch.cache_path().read_text())) == 3


def test_a_value_set_by_hand_wins_and_nothing_is_measured(setup, monkeypatch):
    monkeypatch.setenv(prefetch.ENV, "l1")
    assert prefetch.choose("model", setup.path) == "l1"
    assert setup.calls == []
    assert prefetch.os.environ[prefetch.ENV] == "l1"


def test_a_corrupt_cache_is_measured_again_and_rewritten(setup):
    prefetch.cache_path().write_text('{"truncated')
    assert prefetch.choose("model", setup.path) == "l2"
    assert len(setup.calls) == 1
    prefetch.cache_path().write_text(json.dumps({"k": 1}))   # valid JSON, no entry of ours
    prefetch.choose("model", setup.path)
    assert len(setup.calls) == 2


def test_weights_that_fit_in_the_cache_keep_l1_unmeasured(setup):
    for layer in setup.layers:
        layer.gguf.nbytes = 8 << 20
    assert prefetch.choose("model", setup.path) == "l1"
    assert setup.calls == []


def test_a_later_model_of_this_process_is_chosen_again(setup, monkeypatch):
    """The value this module set is not mistaken for one set by hand."""
    prefetch.choose("model", setup.path)
    for layer in setup.layers:
        layer.gguf.nbytes = 8 << 20
    assert prefetch.choose("small model", setup.path) == "l1"


@pytest.mark.parametrize("l2_share, want", [(0.80, "l2"), (0.99, "l1"), (1.10, "l1")])
def test_l2_is_taken_only_when_clearly_faster(l2_share, want, monkeypatch):
    """measure() alternates the two ways (ABBA), times each after a warming pass, compares
    the rounds' ratios and leaves the environment as it found it."""
    monkeypatch.setenv(prefetch.ENV, "l1")
    seen = []

    def fake_time(calls):
        seen.append(prefetch.os.environ[prefetch.ENV])
        return 0.010 * (l2_share if seen[-1] == "l2" else 1.0)

    monkeypatch.setattr(prefetch, "_packed_layers", lambda model: [])
    monkeypatch.setattr(prefetch, "_time_once", fake_time)
    got = prefetch.measure("model", rounds=4)
    assert got["choice"] == want
    assert seen == ["l1"] * 2 + ["l2"] * 4 + ["l1"] * 4 + ["l2"] * 4 + ["l1"] * 2
    assert prefetch.os.environ[prefetch.ENV] == "l1"


def test_the_measurement_times_one_row_and_two(monkeypatch):
    """One row is decode's common case: measure() times every packed layer at 1 row and at 2
    (timed at 2 rows alone, the choice missed a one-row speed-up of 1.10x)."""
    from types import SimpleNamespace
    layers = [SimpleNamespace(gguf=SimpleNamespace(tensors=[], types=[12], rows=[64]), in_features=k, small_m=-1)
              for k in (256, 512)]
    seen = []

    def fake_time(calls):
        seen.append(sorted((x.shape[0], x.shape[1]) for _, x in calls))
        return 0.010

    monkeypatch.setattr(prefetch, "_packed_layers", lambda model: layers)
    monkeypatch.setattr(prefetch, "_time_once", fake_time)
    prefetch.measure("model", rounds=2)
    assert seen and all(s == [(1, 256), (1, 512), (2, 256), (2, 512)] for s in seen)
