"""The model file's mapping backed by 2 MiB pages of the page cache, where Linux can.

The quantized kernels stream every weight once per decode step straight from the file
mapping. Mapped in 4 KiB pages, that stream takes a TLB miss every 4 KiB and the hardware
prefetchers stop at each page boundary. Linux (6.x, on filesystems with large folios such as
ext4 and xfs) keeps a file's page cache in 2 MiB folios and maps them with one entry each when
they were read in through a mapping advised MADV_HUGEPAGE; a file first read some other way
(written, copied, read with read()) sits in small folios, and stays so while cached.

`back_with_huge_pages` advises the mapping, faults it in, and when most of it still came back
in small pages, drops the file's cached pages and faults it in again (from disk, once: later
starts find the 2 MiB folios in the cache). Nothing is copied: the weights stay the file's
pages, shared with every process that maps the same file. What it gains: docs/kernels.md,
"Measurements behind defaults". TOKENTOP_WEIGHTS=4k leaves the mapping as it is.
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
import sys
import time

import numpy as np

log = logging.getLogger("tokentop.huge_pages")

MADV_DONTNEED, MADV_HUGEPAGE, MADV_POPULATE_READ = 4, 14, 22
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
ENOUGH = 0.5          # of the mapping in 2 MiB pages: below this, read the file in again
MIN_BYTES = 16 << 20  # smaller files (the tests' tiny models) are left alone


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def offered() -> bool:
    """Whether this system maps memory in 2 MiB pages on request (Linux, THP not 'never')."""
    if os.environ.get("TOKENTOP_WEIGHTS", "").lower() == "4k" or not sys.platform.startswith("linux"):
        return False
    try:
        with open(THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def pmd_mapped_bytes(data: np.ndarray) -> int | None:
    """Bytes of `data`'s mapping held in 2 MiB pages (FilePmdMapped in /proc/self/smaps)."""
    lo, hi = data.ctypes.data, data.ctypes.data + data.nbytes
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
                if m:
                    start, end = int(m.group(1), 16), int(m.group(2), 16)
                    inside = start < hi and end > lo
                elif inside and line.startswith("FilePmdMapped:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return None
    return total


def back_with_huge_pages(data: np.ndarray, path: str | os.PathLike) -> str:
    """Advise `data` (a read mapping of the file at `path`) for 2 MiB pages and fault it in;
    returns what happened, for the start-up log and `tokentop models`."""
    if not offered():
        return "4 KiB pages (TOKENTOP_WEIGHTS=4k, or no transparent huge pages here)"
    libc, addr, size = _libc(), data.ctypes.data, data.nbytes
    if size < MIN_BYTES:
        return "4 KiB pages (a file this small gains nothing)"
    if libc.madvise(addr, size, MADV_HUGEPAGE) != 0:
        return f"4 KiB pages (madvise: {os.strerror(ctypes.get_errno())})"
    t0 = time.perf_counter()

    def populate() -> bool:
        return libc.madvise(addr, size, MADV_POPULATE_READ) == 0

    if not populate():
        return "4 KiB pages (this kernel cannot populate a mapping: Linux 5.14 or newer)"
    held = pmd_mapped_bytes(data) or 0
    reread = False
    if held < ENOUGH * size:
        # the cache holds the file in small folios: drop them (only pages nobody maps go) and
        # read the file in again through this advised mapping
        log.info("reading %s into 2 MiB pages of the page cache (once)", os.fspath(path))
        libc.madvise(addr, size, MADV_DONTNEED)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        populate()
        held, reread = pmd_mapped_bytes(data) or 0, True
    took = time.perf_counter() - t0
    share = held / size if size else 0.0
    state = "2 MiB pages" if share >= ENOUGH else "mostly 4 KiB pages (this filesystem keeps small folios)"
    return (f"{state}: {share:.0%} of the file's mapping in 2 MiB pages "
            f"({'read in again, ' if reread else ''}{took:.1f} s)")
