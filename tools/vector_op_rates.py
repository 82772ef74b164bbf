"""Throughput of the AVX2 integer-dot building blocks on this CPU, in cycles per loop iteration.

Why the AVX2 panels' dot runs below vpmaddubsw's peak: each case is a loop of inline asm with
no memory traffic beyond L1, timed against a chain of dependent scalar adds (1 cycle each) for
the clock. Compare a case's cycles with its count of vector operations. Needs g++ (builds a
throwaway binary in a temp folder):
  python tools/vector_op_rates.py
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path


def reg(i: int) -> str:
    return f"%%ymm{i}"


def bcast(off: int, r: int) -> str:
    return f"vbroadcastss {off}(%%rsp),{reg(r)}"


def maddubs(src: str, dst: int) -> str:
    return f"vpmaddubsw {src},%%ymm1,{reg(dst)}"


def dot_block(base: int, off: int, acc: int, loads: bool) -> list[str]:
    """One activation row's 4 code vectors as the panels do it: 4 maddubs, 3 int16 adds, a madd
    against ones and an int32 add into the row's sum."""
    out = []
    for i in range(4):
        if loads:
            out.append(bcast(off + 4 * i, base + i))
        out.append(maddubs(reg(base + i) if loads else "%%ymm0", base + i))
    out += [f"vpaddw {reg(base)},{reg(base + 1)},{reg(base)}", f"vpaddw {reg(base + 2)},{reg(base + 3)},{reg(base + 2)}",
            f"vpaddw {reg(base)},{reg(base + 2)},{reg(base)}", f"vpmaddwd %%ymm0,{reg(base)},{reg(base)}",
            f"vpaddd {reg(base)},{reg(acc)},{reg(acc)}"]
    return out


CASES = {
    "16 independent vpaddw (4 a cycle if 4 pipes)": [f"vpaddw %%ymm0,%%ymm1,{reg(2 + i % 12)}" for i in range(16)],
    "16 independent vpmaddubsw": [maddubs("%%ymm0", 2 + i % 12) for i in range(16)],
    "8 vpmaddubsw + 8 independent vpaddw": sum(([maddubs("%%ymm0", 2 + 2 * (i % 6)), f"vpaddw %%ymm0,%%ymm1,{reg(3 + 2 * (i % 5))}"]
                                                for i in range(8)), []),
    "8 vpmaddubsw, each + a dependent vpaddw": sum(([maddubs("%%ymm0", 2 + i), f"vpaddw {reg(2 + i)},%%ymm1,{reg(2 + i)}"]
                                                    for i in range(8)), []),
    "8 broadcast loads, each into a vpmaddubsw": sum(([bcast(4 * i, 3 + 2 * (i % 5)), maddubs(reg(3 + 2 * (i % 5)), 2 + 2 * (i % 6))]
                                                      for i in range(8)), []),
    "3 panel dot blocks, no loads (12 maddubs, 27 ops)": dot_block(2, 0, 14, False) + dot_block(6, 0, 15, False) + dot_block(10, 0, 13, False),
    "3 panel dot blocks with broadcast loads (12 maddubs)": dot_block(2, 0, 14, True) + dot_block(6, 16, 15, True) + dot_block(10, 32, 13, True),
}

SOURCE = r"""
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>
template <class F> double ns(F f, long n) {
    std::vector<double> t;
    for (int r = 0; r < 7; ++r) {
        auto t0 = std::chrono::steady_clock::now(); f(n);
        t.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / n);
    }
    std::sort(t.begin(), t.end()); return t[3];
}
int main() {
    const double add_ns = ns([](long n) { long x = 0; for (long i = 0; i < n; ++i)
        asm volatile("add $1,%0\n add $1,%0\n add $1,%0\n add $1,%0\n add $1,%0\n add $1,%0\n add $1,%0\n add $1,%0\n" : "+r"(x)); }, 20000000) / 8;
    std::printf("clock from a dependent add chain: %.2f GHz\n", 1 / add_ns);
CASES
}
"""
CLOBBER = ",".join(f'"xmm{i}"' for i in range(2, 16))


def main() -> None:
    lines = []
    for name, ops in CASES.items():
        body = "\\n".join(ops)
        lines.append(f'    std::printf("%-56s %6.2f cycles\\n", "{name}", ns([](long n) {{ for (long i = 0; i < n; ++i) '
                     f'asm volatile("{body}" ::: {CLOBBER}); }}, 4000000) / add_ns);')
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "rates.cpp", Path(tmp) / "rates"
        src.write_text(SOURCE.replace("CASES", "\n".join(lines)))
        subprocess.run(["g++", "-O2", "-mavx2", str(src), "-o", str(exe)], check=True)
        sys.stdout.write(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)


if __name__ == "__main__":
    main()
