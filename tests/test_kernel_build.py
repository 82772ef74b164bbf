"""The kernels' first-use build: what a killed or timed-out build leaves must not block the next.

These build a one-function C++ file the way engine.kernels builds the real ones (a child
process, torch's cpp_extension, ninja), which takes seconds instead of the kernels' ~25-75 s.
"""
from __future__ import annotations

import time

import pytest

from engine import kernels

pytestmark = pytest.mark.skipif(kernels._missing_tools() is not None, reason="no C++ compiler or ninja")

SOURCE = 'extern "C" int tokentop_build_probe() { return 7; }\n'


@pytest.fixture
def probe(tmp_path):
    src = tmp_path / "probe.cpp"
    src.write_text(SOURCE)
    return (src,), tmp_path / "cache" / "tokentop_probe"


def test_a_stale_torch_lock_from_a_killed_build_does_not_block_the_next(probe):
    """torch's cpp_extension waits for its `lock` file to vanish; a build killed mid-way (the
    time-out, a closed terminal) leaves it, and every later start waited out the whole time-out
    and then ran without kernels. Under the build's own flock that file is stale: removed."""
    sources, build_dir = probe
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()                 # what a killed build leaves behind
    t0 = time.monotonic()
    lib = kernels._compile("tokentop_probe", build_dir, sources, timeout=60)
    assert lib.exists() and not (build_dir / "lock").exists()
    assert time.monotonic() - t0 < 60


def test_a_build_past_its_time_out_says_so_and_the_next_start_builds(probe):
    sources, build_dir = probe
    with pytest.raises(RuntimeError, match="took over 0 s .* resumes"):
        kernels._compile("tokentop_probe", build_dir, sources, timeout=0.2)
    lib = kernels._compile("tokentop_probe", build_dir, sources, timeout=120)
    assert lib.exists()


def test_a_library_already_built_is_returned_without_a_rebuild(probe):
    sources, build_dir = probe
    lib = kernels._compile("tokentop_probe", build_dir, sources, timeout=120)
    mtime = lib.stat().st_mtime_ns
    assert kernels._compile("tokentop_probe", build_dir, sources, timeout=120) == lib
    assert lib.stat().st_mtime_ns == mtime


def test_first_use_serves_on_the_torch_fallback_then_switches_to_the_kernels(tiny_model_path, monkeypatch):
    """A fresh install must serve at once: the kernels build in the background (held back
    here until the test lets it finish), the worker answers on torch matmuls meanwhile, and a
    request that runs across the switch finishes whole; then the kernels run."""
    import threading

    from engine.config import EngineConfig, SamplingParams, WorkerConfig
    from engine.facade.engine import Engine
    from tests.waiting import wait_until

    if not kernels.available():
        pytest.skip(f"no kernels to switch to here: {kernels.status()['reason']}")
    release = threading.Event()
    real_compile = kernels._compile

    def held_compile(name, build_dir, *args, **kw):
        assert release.wait(60), "the test never released the build"
        return real_compile(name, build_dir, *args, **kw)   # already in the cache: returns at once

    monkeypatch.setattr(kernels, "_state", {"available": None, "reason": "", "build_s": None, "library": None})
    monkeypatch.setattr(kernels, "build_pending", lambda: True)   # as on a fresh install
    monkeypatch.setattr(kernels, "_compile", held_compile)
    model = str(tiny_model_path())   # quantized linears (Q4_K, Q8_0 ...), so the kernels have work
    config = EngineConfig(workers=(WorkerConfig(model=model, threads=1, calibrate=False),), worker_mode="thread")
    with Engine(config).start(timeout=60) as engine:
        view = engine.snapshot().workers[0]
        assert view.state == "ready" and view.kernels_building and view.kernels.startswith("dense")
        before = engine.generate("hello there", params=SamplingParams(max_tokens=6, ignore_eos=True))
        assert before.finish_reason == "length" and len(before.token_ids) == 6
        spanning = engine.submit("a request across the switch", params=SamplingParams(max_tokens=120, ignore_eos=True))
        wait_until(lambda: spanning._record.output_ids, 30, "the spanning request to stream")
        release.set()
        wait_until(lambda: not engine.snapshot().workers[0].kernels_building, 60, "the switch")
        view = engine.snapshot().workers[0]
        assert "gguf" in view.kernels and view.kernels_since > 0
        result = spanning.result(60)
        assert result.finish_reason == "length" and len(result.token_ids) == 120
        after = engine.generate("hello there", params=SamplingParams(max_tokens=6, ignore_eos=True))
        assert after.finish_reason == "length"
        assert any("switched to the quantized kernels" in line.text for line in engine.snapshot().log)
