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
