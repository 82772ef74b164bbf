"""The model file's mapping in 2 MiB pages (engine/models/huge_pages.py)."""
from __future__ import annotations

import numpy as np
import pytest

from engine.models import huge_pages


@pytest.fixture
def big_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 24 << 20, dtype=np.uint8).tobytes())
    return path


def _calls(monkeypatch, held):
    """Record the madvise / fadvise calls; pmd_mapped_bytes answers from `held` in turn."""
    calls = []

    class FakeLibc:
        def madvise(self, addr, size, advice):
            calls.append(("madvise", advice))
            return 0

    answers = iter(held)
    monkeypatch.setattr(huge_pages, "_libc", lambda: FakeLibc())
    monkeypatch.setattr(huge_pages, "offered", lambda: True)
    monkeypatch.setattr(huge_pages, "pmd_mapped_bytes", lambda data: next(answers))
    monkeypatch.setattr(huge_pages.os, "posix_fadvise", lambda fd, o, n, a: calls.append(("fadvise", a)))
    return calls


def test_a_file_cached_in_small_pages_is_dropped_and_read_in_again(big_file, monkeypatch):
    data = np.memmap(big_file, mode="c")
    calls = _calls(monkeypatch, [0, data.nbytes])
    state = huge_pages.back_with_huge_pages(data, big_file)
    assert state.startswith("2 MiB pages") and "read in again" in state
    M = huge_pages
    assert calls == [("madvise", M.MADV_HUGEPAGE), ("madvise", M.MADV_POPULATE_READ),
                     ("madvise", M.MADV_DONTNEED), ("fadvise", M.os.POSIX_FADV_DONTNEED),
                     ("madvise", M.MADV_POPULATE_READ)]


def test_a_file_already_in_huge_pages_is_only_faulted_in(big_file, monkeypatch):
    data = np.memmap(big_file, mode="c")
    calls = _calls(monkeypatch, [data.nbytes])
    state = huge_pages.back_with_huge_pages(data, big_file)
    assert state.startswith("2 MiB pages") and "read in again" not in state
    assert [c[1] for c in calls] == [huge_pages.MADV_HUGEPAGE, huge_pages.MADV_POPULATE_READ]


def test_small_files_and_tokentop_weights_4k_are_left_alone(big_file, tmp_path, monkeypatch):
    small = tmp_path / "small.bin"
    small.write_bytes(b"\0" * (1 << 20))
    calls = _calls(monkeypatch, [])
    assert huge_pages.back_with_huge_pages(np.memmap(small, mode="c"), small).startswith("4 KiB")
    monkeypatch.undo()
    monkeypatch.setenv("TOKENTOP_WEIGHTS", "4k")
    assert not huge_pages.offered()
    assert huge_pages.back_with_huge_pages(np.memmap(big_file, mode="c"), big_file).startswith("4 KiB")
    assert calls == []


@pytest.mark.skipif(not huge_pages.offered(), reason="no transparent huge pages on this system")
def test_the_real_calls_keep_the_bytes_and_report_what_the_kernel_did(big_file):
    data = np.memmap(big_file, mode="c")
    before = np.array(data[:: 4096])
    state = huge_pages.back_with_huge_pages(data, big_file)
    assert np.array_equal(np.array(data[:: 4096]), before)    # dropping and re-reading kept every byte
    held = huge_pages.pmd_mapped_bytes(data)
    assert held is not None and f"{held / data.nbytes:.0%}" in state
