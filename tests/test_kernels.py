"""tokentop::qmatmul against the exact dequantized fp32 reference, on every ISA path this CPU runs.

The two bounds checked are derived in engine/kernels/__init__.py: against W x̂ (x̂ = the
activations as the kernel quantizes them) only fp32 rounding may differ, which pins every code,
scale and offset; against W x the activation rounding adds at most sum |w_i| d_g / 2. The activations' groups are
what the kernel quantizes them with: 32 weights, except the direct kernels and the AVX-512 packed
panels, which quantize them per 256 against K-quant weights (act_group).
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from engine import kernels
from engine.models import quant
from engine.models.gguf import TensorData, load_gguf
from engine.models.quant import dequantize
from tests.fixtures.tiny_gguf import random_blocks

pytestmark = pytest.mark.skipif(not kernels.available(), reason="quantized kernels could not be built")

TYPES = (T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
K_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)
EPS32 = 2.0 ** -24


def runnable_isas() -> list[str]:
    return list(kernels.ISA_NAMES[:kernels.best_isa() + 1]) if kernels.available() else []


def random_td(qtype: T, rows: int, cols: int, seed: int = 0) -> TensorData:
    """Random bytes in every field (all codes, signs and K-quant scales occur, Q8_0's -128 too),
    with finite fp16 scales of a realistic size."""
    rng = np.random.default_rng(seed)
    if qtype in K_TYPES:
        raw = random_blocks((rows, cols), qtype, rng)
    else:
        block, size = GGML_QUANT_SIZES[qtype]
        n = rows * cols // block
        b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
        b[:, 0:2] = (rng.uniform(0.5, 1.5, (n, 1)) * 0.02 / 16).astype(np.float16).view(np.uint8)
        raw = b
    return TensorData("w", qtype, (rows, cols), np.ascontiguousarray(raw).reshape(rows, -1))


def quantize_activations(x: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x̂ and the scale d per weight, exactly as the kernel computes them (fp32 ops, fp64 result)."""
    m, k = x.shape
    g = x.view(m, k // group, group)
    d = g.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    a = torch.round(g * inv).clamp(-127, 127)
    return (a.double() * d.double()).view(m, k), d.double().expand(-1, -1, group).reshape(m, k)


# calls of up to this many rows read the AVX-512 packed copies (quant_avx512_packed.inc's
# PACKED_MAX_ROWS), unless TOKENTOP_PACKED=0
PACKED_MAX_ROWS = 32


def packed_on() -> bool:
    return os.environ.get("TOKENTOP_PACKED") != "0"


def one_row_reads_packed(qtype: T) -> bool:
    """Whether an AVX-512 one-row call of qtype alone reads its packed copy (qkernels.cpp's
    packed_one_row): Q5_0, Q8_0, and the K-quants where transparent huge pages can be had."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read()
    except OSError:
        thp = ""
    return packed_on() and (qtype in (T.Q5_0, T.Q8_0) or (qtype in K_TYPES and ("[always]" in thp or "[madvise]" in thp)))


def act_group(qtype: T, m: int, isa: str | None = None, small_m: int = -1, big_m: int = -1) -> int:
    """The activation group the op takes for a call of m rows (qmatmul_op.cpp's dispatch): 256 for
    K-quant weights in the direct kernels (AVX2, AVX-512) and the AVX-512 packed panels, else 32.
    A wrong answer fails check's W x̂ bound."""
    isa = isa or kernels.isa_name()
    panel_rows = big_m if big_m >= 0 else 0 if small_m == 0 else max(panel_min_rows(isa) - 1, small_m) + 1
    panels = isa in ("avx512", "avx2") and 0 < panel_rows <= m
    direct = not panels and m <= (kernels.direct_rows(isa) if small_m < 0 else small_m)
    packed = panels and isa == "avx512" and m <= PACKED_MAX_ROWS and packed_on()
    return 256 if isa != "scalar" and (direct or packed) and qtype in K_TYPES else 32


def weight_bias(td: TensorData) -> torch.Tensor:
    """|b_i| in w_i = s * code_i - b_i (the offset and K-quant minimum the kernel subtracts)."""
    c = quant._unpack(td)
    b = c.scale * c.offset + (c.minus if c.minus is not None else 0)
    return torch.from_numpy(np.repeat(np.abs(b), c.group, axis=1)).double()


def check(y: torch.Tensor, td: TensorData, x: torch.Tensor, group: int = 32) -> None:
    w = dequantize(td).double()
    xhat, d = quantize_activations(x, group)
    k = x.shape[1]
    fp32_bound = (k / 16 + 32) * EPS32 * (xhat.abs() @ (w.abs() + 2 * weight_bias(td)).T)
    err_hat = (y.double() - xhat @ w.T).abs()
    assert (err_hat <= fp32_bound).all(), f"vs W x̂: worst excess {(err_hat - fp32_bound).max():.3g}"
    act_bound = (d @ w.abs().T) * (0.5 + 2.0 ** -17) + fp32_bound
    err = (y.double() - x.double() @ w.T).abs()
    assert (err <= act_bound).all(), f"vs W x: worst excess {(err - act_bound).max():.3g}"


def run(td_list: list[TensorData], x: torch.Tensor, isa: str | None = None, bias=None,
        small_m: int = -1, big_m: int = -1) -> torch.Tensor:
    ws = [torch.from_numpy(td.raw).reshape(-1) for td in td_list]
    return kernels.qmatmul(x, ws, [int(td.ggml_type) for td in td_list], [td.shape[0] for td in td_list],
                           bias, isa, small_m, big_m)


# The op's two kernels, each forced for every row count: the direct (decode) kernels read
# blocks straight into registers (AVX2 and AVX-512; the portable path has only the other),
# the row/tile kernels unpack weights first. small_m=-1 is the op's own choice by row count.
KERNEL_CHOICES = {"direct": 16, "tiles": 0, "auto": -1}


@pytest.mark.parametrize("kernel", KERNEL_CHOICES)
@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks_every_type_isa_and_row_count(qtype, isa, kernel):
    k = 768 if qtype in K_TYPES else 224      # 224 = 3.5 x 64: the half-width tail step too
    td = random_td(qtype, rows=37, cols=k, seed=int(qtype))
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(1))
    x[:, 5] *= 40                               # an outlier channel, as real activations have
    for m in range(1, 17):
        small_m = KERNEL_CHOICES[kernel]
        check(run([td], x[:m], isa, small_m=small_m), td, x[:m], act_group(qtype, m, isa, small_m))


def on_one_and_two_threads(td, x, isa, small_m):
    """The op's output with 1 and with 2 intra-op threads."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run([td], x, isa, small_m=small_m)
        torch.set_num_threads(2)
        return one, run([td], x, isa, small_m=small_m)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_direct_kernel_with_one_and_two_threads(qtype, isa):
    """Output rows split over threads at any row (odd N): same bits, still within the bound."""
    k = 512 if qtype in K_TYPES else 96
    td = random_td(qtype, rows=203, cols=k, seed=7 + int(qtype))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(6))
    one, two = on_one_and_two_threads(td, x, isa, small_m=4)
    check(one, td, x, act_group(qtype, 3, isa, small_m=4))
    assert torch.equal(one, two)
    # and a row's result does not depend on the other rows of its call (M = 1 vs M = 3)
    assert torch.equal(torch.cat([run([td], x[i:i + 1], isa, small_m=4) for i in range(3)]), one)


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_direct_kernel_rows_1_to_16_take_the_same_bits(qtype, isa):
    """The direct kernels serve a call of M rows in passes (of 8 or 4 rows, then the rest, on
    AVX-512; of 4 on AVX2) with each row's sums done the same way: every M from 1 to 16 gives each row the bits
    it has alone, on 1 and 2 threads, odd N and K with a lone last 32-block (Q4_0/Q5_0/Q8_0)."""
    k = 768 if qtype in K_TYPES else 224
    td = random_td(qtype, rows=45, cols=k, seed=11 + int(qtype))
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(8))
    x[:, 3] *= 40
    alone = torch.cat([run([td], x[i:i + 1], isa, small_m=16) for i in range(16)])
    for m in range(1, 17):
        one, two = on_one_and_two_threads(td, x[:m], isa, small_m=16)
        check(one, td, x[:m], act_group(qtype, m, isa, small_m=16))
        assert torch.equal(one, two), m
        if kernels.best_isa() >= 1 and isa != "scalar":
            assert torch.equal(one, alone[:m]), m


@pytest.mark.skipif("avx2" not in runnable_isas(), reason="needs a CPU that runs the AVX2 kernels")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_avx_vnni_direct_kernels_give_the_maddubs_bits(qtype, monkeypatch):
    """The AVX2 direct kernels' integer dot is vpdpbusd where the CPU has AVX-VNNI, maddubs and
    madd elsewhere (TOKENTOP_AVX_VNNI=0): the same exact integer sums, so the same bits, for
    every type, 1-4 rows and odd N. (Without AVX-VNNI both runs take maddubs.)"""
    k = 768 if qtype in K_TYPES else 224
    td = random_td(qtype, rows=45, cols=k, seed=23 + int(qtype))
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(4))
    x[:, 7] *= 40
    outs = {}
    for vnni in ("1", "0"):
        monkeypatch.setenv("TOKENTOP_AVX_VNNI", vnni)
        outs[vnni] = [run([td], x[:m], "avx2", small_m=4) for m in range(1, 5)]
    for m, (a, b) in enumerate(zip(outs["1"], outs["0"]), start=1):
        assert torch.equal(a, b), m
    check(outs["1"][3], td, x, act_group(qtype, 4, "avx2", small_m=4))


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_threads_taking_each_others_work_compute_every_row_once(isa, qtype):
    """Packed and direct calls hand out output rows as the threads come for them (qmatmul_op.cpp's
    parallel_steal: own share front to back, then the back half of another's), so the split
    differs from call to call. Every row of a two-matrix stack, its second matrix starting
    inside a tile, must come out with the one-thread bits on every call."""
    k = 256 if qtype in K_TYPES else 96
    tds = [random_td(qtype, rows=645, cols=k, seed=5), random_td(qtype, rows=333, cols=k, seed=6)]
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        for m in (1, 3, 8):
            torch.set_num_threads(1)
            one = run(tds, x[:m], isa)
            torch.set_num_threads(2)
            for _ in range(12):
                assert torch.equal(run(tds, x[:m], isa), one), m
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_and_threads_do_not_change_any_bit(isa, qtype):
    """With small_m=0 (what deterministic mode passes) one kernel serves every M, and each
    output is computed the same way whatever M or the split over threads: batch-invariant by
    construction. The default switches kernels at direct_rows() and is not."""
    k = 512 if qtype in K_TYPES else 96
    td = random_td(qtype, rows=101, cols=k)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(2))
    one, two = on_one_and_two_threads(td, x, isa, small_m=0)
    assert torch.equal(one, two)
    alone = torch.cat([run([td], x[i:i + 1], isa, small_m=0) for i in range(13)])
    assert torch.equal(one, alone)
    assert torch.equal(run([td], x[:5], isa, small_m=0), one[:5])


# The panel kernel (batches, prefill), forced for every row count with big_m=1: AVX-512 and
# AVX2 run it, the portable path keeps its tiles (the same checks then cover that fallback).
def panel_min_rows(isa: str | None = None) -> int:
    """The row count from which the op's default takes the panels (where the ISA has them):
    one more than the direct kernels take (4 on AVX2, 1 on AVX-512 with packed K-quants)."""
    return kernels.direct_rows(isa) + 1


@pytest.mark.skipif("avx512" not in runnable_isas(), reason="needs a CPU that runs both panel builds")
@pytest.mark.parametrize("vnni", ["1", "0"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_avx2_panels_give_the_avx512_panels_bits(qtype, vnni, monkeypatch):
    """The AVX2 panels (8-row tiles, maddubs/madd dots, Q8_0 through the sign trick; or AVX-VNNI's
    vpdpbusd where the CPU has it and TOKENTOP_AVX_VNNI is not 0) do the same integer sums and
    the same float steps per output as the AVX-512 ones (16-row tiles, vpdpbusd): the same bits,
    at every batch size and a part-filled last panel. (The AVX-512 panels built from the blocks:
    its packed K-quants keep a super-block's sum in integers, test_packed_k_quants_*.)"""
    monkeypatch.setenv("TOKENTOP_AVX_VNNI", vnni)
    monkeypatch.setenv("TOKENTOP_PACKED", "0")
    k = 768 if qtype in K_TYPES else 352
    td = random_td(qtype, rows=77, cols=k, seed=61 + int(qtype))
    for m in (5, 6, 8, 9, 13, 64):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        x[:, 9] *= 30
        assert torch.equal(run([td], x, "avx2", big_m=1), run([td], x, "avx512", big_m=1)), m


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_panel_kernel_every_type_isa_and_row_count(qtype, isa):
    """Odd N (a part-filled last panel and tile), odd M (every remainder of the 4-row blocks),
    K with a part-filled unpack chunk; outliers as real activations have."""
    k = 768 if qtype in K_TYPES else 224
    td = random_td(qtype, rows=45, cols=k, seed=11 + int(qtype))
    x = torch.randn(39, k, generator=torch.Generator().manual_seed(12))
    x[:, 3] *= 50
    x[7] = 0.0                                   # an all-zero row: d = 0 in every group
    for m in (1, 2, 3, 5, 6, 7, 13, 39):
        check(run([td], x[:m], isa, big_m=1), td, x[:m], act_group(qtype, m, isa, big_m=1))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_panel_tiles_built_from_blocks_decode_batch_sizes(qtype):
    """The panels build their interleaved codes straight from 16 rows' GGUF blocks. N = 77:
    two full panels, then one whose second 16-row tile is empty and whose first has 13 rows
    (the missing ones repeat a valid row and are not stored); 6-16 activation rows (the
    batched decode sizes), 1 and 2 threads: same bits, each row the same as in any other
    row count, all within the bound."""
    k = 768 if qtype in K_TYPES else 352        # 352: 11 blocks of 32
    td = random_td(qtype, rows=77, cols=k, seed=51 + int(qtype))
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(52))
    x[:, 9] *= 30
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run([td], x, big_m=1)
        torch.set_num_threads(2)
        two = run([td], x, big_m=1)
        for m in range(6, 16):
            assert torch.equal(run([td], x[16 - m:], big_m=1), two[16 - m:])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    check(two, td, x, act_group(qtype, 16, big_m=1))   # without panels, 16 rows may be direct


@pytest.mark.skipif("avx2" not in runnable_isas(), reason="needs a CPU with AVX2")
def test_avx2_q8_0_row_lanes_give_the_tile_bits(monkeypatch):
    """Q8_0 at 7-8 rows on AVX2 without VNNI takes the row-lane kernel (activation rows in the
    lanes, codes broadcast from the blocks, no tile build); other row counts take the tiles.
    Each row's integer sums and float steps are the same, so every row of a 2-8-row call has
    the bits of the same row in a 12-row call: N = 45 (a tail after the two-row passes), 1 and
    2 threads, an all-zero row."""
    monkeypatch.setenv("TOKENTOP_AVX_VNNI", "0")
    k = 352
    td = random_td(T.Q8_0, rows=45, cols=k, seed=71)
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(72))
    x[:, 5] *= 40
    x[3] = 0.0
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            tiles = run([td], x, "avx2", big_m=1)
            for m in range(2, 9):
                assert torch.equal(run([td], x[:m], "avx2", big_m=1), tiles[:m]), (t, m)
                assert torch.equal(run([td], x[12 - m:], "avx2", big_m=1), tiles[12 - m:]), (t, m)
    finally:
        torch.set_num_threads(threads)
    check(tiles, td, x)


@pytest.mark.parametrize("isa", runnable_isas())
def test_panel_kernel_stacked_types_threads_and_rows(isa, monkeypatch):
    """Stacked matrices of mixed types (boundaries inside a 32-row panel), bias, 1 and 2
    threads: same bits; every row as computed alone by the same kernel (the panels built from
    the blocks, which the packed copies' K-quants are not): same bits."""
    monkeypatch.setenv("TOKENTOP_PACKED", "0")
    parts = [random_td(T.Q4_K, 40, 512, 21), random_td(T.Q6_K, 37, 512, 22), random_td(T.Q8_0, 19, 512, 23)]
    bias = torch.randn(96)
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(24))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(parts, x, isa, bias=bias, big_m=1)
        torch.set_num_threads(2)
        two = run(parts, x, isa, bias=bias, big_m=1)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    col = 0
    for p in parts:
        check(one[:, col:col + p.shape[0]] - bias[col:col + p.shape[0]], p, x)
        col += p.shape[0]
    alone = torch.cat([run(parts, x[i:i + 1], isa, bias=bias, small_m=0, big_m=1) for i in (0, 33, 69)])
    assert torch.equal(alone, one[[0, 33, 69]])


@pytest.mark.parametrize("isa", runnable_isas())
def test_deterministic_mode_stays_batch_invariant_for_prefill_sized_calls(isa):
    """small_m=0 keeps one kernel (the tiles) for every row count, panels or not: a prompt's
    rows have the same bits in a 70-row call as one by one. The default takes the panels
    above direct_rows() where the ISA has them (and on AVX-512 for one K-quant row too)."""
    td = random_td(T.Q4_K, 33, 512, 31)
    first = panel_min_rows(isa)
    x = torch.randn(first + 6, 512, generator=torch.Generator().manual_seed(32))
    batch = run([td], x, isa, small_m=0)
    assert torch.equal(batch, torch.cat([run([td], x[i:i + 1], isa, small_m=0) for i in range(len(x))]))
    assert torch.equal(run([td], x, isa), run([td], x, isa, big_m=1))
    if first > 1:                # one-row calls: the direct kernel, or AVX-512's packed copy
        one_row_big_m = 1 if isa == "avx512" and one_row_reads_packed(T.Q4_K) else 0
        assert torch.equal(run([td], x[:first - 1], isa), run([td], x[:first - 1], isa, big_m=one_row_big_m))


def test_large_prefill_outputs_reuse_a_buffer_only_once_released():
    """Outputs of >= 32 MiB come from a pooled buffer: a result (or a view of it) still held is
    never overwritten by a later call; once released its buffer serves the next call."""
    td = random_td(T.Q4_K, 16384, 256, 41)
    x1 = torch.randn(512, 256, generator=torch.Generator().manual_seed(42))
    x2 = torch.randn(512, 256, generator=torch.Generator().manual_seed(43))
    y1 = run([td], x1)
    want = y1.clone()
    view = run([td], x2)[:, 5:9]                 # the base is dropped, the view keeps its buffer
    view_want = view.clone()
    y2 = run([td], x2)
    y3 = run([td], x1)
    assert torch.equal(y1, want) and torch.equal(view, view_want) and torch.equal(y3, want)
    assert torch.equal(y2[:, 5:9], view_want)
    ptr = y1.data_ptr()
    del y1
    assert torch.equal(run([td], x1), want)
    if kernels.isa_name() in ("avx512", "avx2"):   # the panels' pool: the released buffer again
        assert run([td], x2).data_ptr() == ptr
    check(y3[:64], td, x1[:64])


def test_isa_paths_agree_within_their_bounds():
    td = random_td(T.Q8_0, rows=33, cols=256)     # AVX2 takes Q8_0's sign trick: cover -128
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    for isa in runnable_isas():
        check(run([td], x, isa), td, x, act_group(T.Q8_0, 4, isa))


def test_stacked_matrices_of_mixed_types_with_bias():
    """32-wise and K-quant parts in one call, at row offsets inside a 16-row tile: each takes
    its own form of the activations (per 32 / per 256: the direct kernels, AVX-512's packed
    K-quants), quantized once for the call, and gives the bits it gives alone."""
    parts = [random_td(T.Q5_0, 24, 256, 1), random_td(T.Q4_K, 13, 256, 5), random_td(T.Q5_0, 8, 256, 2),
             random_td(T.Q8_0, 9, 256, 3), random_td(T.Q6_K, 7, 256, 6)]
    bias = torch.randn(61)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    fused = run(parts, x, bias=bias)
    alone = torch.cat([run([p], x) for p in parts], dim=1) + bias
    assert torch.equal(fused, alone)
    col = 0
    for p in parts:
        check(fused[:, col:col + p.shape[0]] - bias[col:col + p.shape[0]], p, x, act_group(p.ggml_type, 3))
        col += p.shape[0]


def test_bad_inputs_raise():
    td = random_td(T.Q4_0, 4, 64)
    w = torch.from_numpy(td.raw).reshape(-1)
    with pytest.raises(RuntimeError, match="bytes"):
        kernels.qmatmul(torch.randn(1, 64), [w[:-1]], [int(T.Q4_0)], [4])
    with pytest.raises(RuntimeError, match="multiple"):
        kernels.qmatmul(torch.randn(1, 48), [w], [int(T.Q4_0)], [4])
    with pytest.raises(RuntimeError, match="unsupported"):
        kernels.qmatmul(torch.randn(1, 64), [w], [int(T.Q2_K)], [4])


def test_fake_kernel_gives_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 64)
        y = torch.ops.tokentop.qmatmul(x, [torch.empty(72, dtype=torch.uint8)], [int(T.Q4_0)], [2], None, -1)
        assert y.shape == (5, 2)


def test_env_var_caps_the_isa():
    code = "from engine import kernels; kernels.load(); print(kernels.isa_name())"
    env = dict(os.environ, TOKENTOP_KERNEL_ISA="scalar")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "scalar"


def test_real_tensors_of_the_bundled_model(real_model_path):
    gf = load_gguf(real_model_path)
    by_type: dict[T, TensorData] = {}
    for td in gf.tensors.values():
        if len(td.shape) == 2 and td.ggml_type in TYPES:
            by_type.setdefault(td.ggml_type, td)
    assert {T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K} <= set(by_type)
    for qtype, td in by_type.items():
        sub = TensorData(td.name, qtype, (45, td.shape[1]), td.raw[:45])   # odd N
        x = torch.randn(6, td.shape[1], generator=torch.Generator().manual_seed(5))
        x[:, 7] *= 30
        for isa in runnable_isas():
            for small_m in KERNEL_CHOICES.values():
                check(run([sub], x, isa, small_m=small_m), sub, x, act_group(qtype, 6, isa, small_m))
                check(run([sub], x[:1], isa, small_m=small_m), sub, x[:1], act_group(qtype, 1, isa, small_m))


def test_every_kernel_file_keys_the_build(tmp_path, monkeypatch):
    """An edit to any source or included file gives a new build key, so a stale build of an
    edited kernel is never loaded from the cache (the AVX2 panels' file once was left out)."""
    import re
    import shutil
    src = kernels._DIR
    included = {name for f in src.iterdir() if f.suffix in (".cpp", ".h", ".inc")
                for name in re.findall(r'#include "([^"]+)"', f.read_text())}
    assert included and included <= set(kernels.DEPENDS), included - set(kernels.DEPENDS)
    copy = tmp_path / "kernels"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(kernels, "_DIR", copy)
    before = kernels._build_key()
    for name in sorted(included) + list(kernels.SOURCES):
        path = copy / name
        text = path.read_text()
        path.write_text(text + "\n// edited\n")
        assert kernels._build_key() != before, f"{name} does not key the build"
        path.write_text(text)
    assert kernels._build_key() == before


def test_without_a_compiler_the_model_falls_back_with_one_log_line(tmp_path):
    """A fresh cache and no g++ on PATH: load() says why in one warning, linears go dense."""
    code = ("import logging; logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
            "from engine import kernels\n"
            "from engine.models.quant import LinearPolicy, make_linear\n"
            "from tests.test_quant import make_td\n"
            "from gguf import GGMLQuantizationType as T\n"
            "lin = make_linear(make_td(T.Q4_K), bias=None, policy=LinearPolicy())\n"
            "print('forms', sorted(lin.kernel_forms()), kernels.describe())\n")
    env = dict(os.environ, TOKENTOP_CACHE_DIR=str(tmp_path), PATH=str(tmp_path),
               PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    warnings = [ln for ln in out.stderr.splitlines() if ln.startswith("WARNING")]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0] and "dense torch" in warnings[0]
    assert "forms ['dense-" in out.stdout and "unavailable (no C++ compiler" in out.stdout


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("m", (1, 7, 23))   # 23: the panels on AVX-512
def test_half_activations_are_converted_in_the_op(dtype, m):
    """bf16/fp16 x: the same as converting to fp32 before and y back after (bias included)."""
    td = random_td(T.Q4_K, rows=19, cols=256, seed=9)
    bias = torch.randn(19)
    x = torch.randn(m, 256).to(dtype)
    y = run([td], x, bias=bias)
    assert y.dtype == dtype
    assert torch.equal(y, run([td], x.float(), bias=bias).to(dtype))
    assert run([td], x[:0], bias=bias).dtype == dtype


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_rows_dot_is_the_exact_dot_with_dequantized_rows(qtype):
    """The decoder's exact refinement of its top logits: h . dequantize(W[id]) for a few ids,
    the dequantization ggml's (gguf-py's reader agrees with it, test_quant), the sum in fp32."""
    if not kernels.available():
        pytest.skip("kernel library could not be built")
    td = random_td(qtype, 300, 512, seed=7)
    h = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 300, (3, 32), generator=torch.Generator().manual_seed(2))
    w = torch.from_numpy(np.ascontiguousarray(td.raw))
    got = torch.ops.tokentop.gguf_rows_dot(h, w, int(qtype), ids)
    rows = dequantize(td).double()[ids]                       # [3, 32, 512]
    want = (rows * h.double()[:, None]).sum(-1)
    bound = 512 * EPS32 * (rows.abs() * h.double().abs()[:, None]).sum(-1)   # fp32 summation
    assert ((got.double() - want).abs() <= bound + 1e-30).all()
    # each (row, id) alone gives the same bits: nothing depends on the batch
    alone = torch.ops.tokentop.gguf_rows_dot(h[1:2].contiguous(), w, int(qtype), ids[1:2].contiguous())
    assert torch.equal(alone, got[1:2])
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.tokentop.gguf_rows_dot(h[:1].contiguous(), w, int(qtype), torch.tensor([[300]]))


@pytest.mark.skipif("avx512" not in runnable_isas(), reason="the packed panels are AVX-512's")
@pytest.mark.parametrize("qtype", (T.Q4_0, T.Q5_0, T.Q8_0), ids=lambda t: t.name)
def test_packed_panels_give_the_gguf_panels_bits(qtype, monkeypatch):
    """AVX-512 packs each matrix once (16-row tiles, codes at their GGUF width) and its panels
    read that copy: for the 32-weight block types the same integer sums and float steps as
    panels built from the blocks at every call, so the same bits. N = 77 (a last tile of 13
    rows and an empty one), stacked behind a matrix of 19 rows (starts inside a tile), 1-64
    rows, 1 and 2 threads."""
    k = 768
    td = random_td(qtype, rows=77, cols=k, seed=81 + int(qtype))
    head = random_td(T.Q8_0, rows=19, cols=k, seed=82)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (1, 2, 5, 8, 13, 64):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                x[:, 9] *= 30
                for parts in ([td], [head, td]):
                    monkeypatch.setenv("TOKENTOP_PACKED", "0")
                    built = run(parts, x, "avx512", big_m=1)
                    monkeypatch.setenv("TOKENTOP_PACKED", "1")
                    assert torch.equal(run(parts, x, "avx512", big_m=1), built), (t, m, len(parts))
    finally:
        torch.set_num_threads(threads)
    check(run([td], x, "avx512", big_m=1), td, x)


@pytest.mark.skipif("avx512" not in runnable_isas(), reason="the packed panels are AVX-512's")
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_packed_k_quants_keep_each_super_block_in_integers(qtype, monkeypatch):
    """The packed K-quants (1-32 rows by default) quantize the activations per 256, as the
    direct kernels do, and sum a super-block in integers: within the bound of W x̂ for those
    activations; every row has the same bits whatever the call's row count, block of 8 rows,
    thread count, or a stack in front of the matrix that starts it inside a 16-row tile (2 rows
    or more; N = 77: a last tile of 13 rows and an empty one). Real-scale activations too (x * 1e-3), and
    an all-zero row."""
    k = 768
    td = random_td(qtype, rows=77, cols=k, seed=83 + int(qtype))
    head = random_td(T.Q8_0, rows=19, cols=k, seed=84)
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(85))
    x[:, 9] *= 30
    x[4] = 0.0
    x[20:] *= 1e-3
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = run([td], x, "avx512")
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (1, 2, 3, 8, 9, 13, 32):
                for start in (0, 32 - m):
                    rows = x[start:start + m]
                    assert torch.equal(run([td], rows, "avx512"), full[start:start + m]), (t, m, start)
                    if m > 1 or one_row_reads_packed(qtype):   # (else one row takes the direct kernels)
                        stacked = run([head, td], rows, "avx512")
                        assert torch.equal(stacked[:, 19:], full[start:start + m]), (t, m, start, "stacked")
    finally:
        torch.set_num_threads(threads)
    check(full, td, x, 256)
    assert (full[4] == 0).all()
    # with TOKENTOP_PACKED=0 the same calls build their panels (32-wise activations)
    monkeypatch.setenv("TOKENTOP_PACKED", "0")
    check(run([td], x[:8], "avx512", big_m=1), td, x[:8], 32)


@pytest.mark.skipif("avx512" not in runnable_isas(), reason="the packed panels are AVX-512's")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_prefetching_into_l2_gives_the_same_bits(qtype, monkeypatch):
    """TOKENTOP_PACKED_PREFETCH=l2 (engine/worker/prefetch.py) changes only where the packed
    kernels prefetch the next panel, never what they compute: 1-32 rows, 1 and 2 threads."""
    k = 768
    td = random_td(qtype, rows=77, cols=k, seed=101 + int(qtype))
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (1, 2, 8, 32):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                monkeypatch.setenv("TOKENTOP_PACKED_PREFETCH", "l1")
                into_l1 = run([td], x, "avx512")
                monkeypatch.setenv("TOKENTOP_PACKED_PREFETCH", "l2")
                assert torch.equal(run([td], x, "avx512"), into_l1), (t, m)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif("avx512" not in runnable_isas(), reason="the packed panels are AVX-512's")
@pytest.mark.parametrize("qtype", (T.Q5_0, T.Q8_0, *K_TYPES), ids=lambda t: t.name)
def test_one_row_calls_read_the_packed_copy(qtype, monkeypatch):
    """On AVX-512 a one-row call of Q5_0, Q8_0 or K-quant matrices alone takes the panels over
    their packed copy by default (the K-quants where the copy can have 2 MiB pages): the packed
    bits, which differ from the direct kernel's.
    TOKENTOP_PACKED=0 gives the direct kernel back, and a call that stacks them with another
    type keeps it."""
    if not one_row_reads_packed(qtype):
        pytest.skip("transparent huge pages are off: one-row K-quant calls keep the direct kernel")
    k = 768
    td = random_td(qtype, rows=77, cols=k, seed=95 + int(qtype))
    other = random_td(T.Q4_0, rows=32, cols=k, seed=96)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(97))
    panels, direct = run([td], x, "avx512", big_m=1), run([td], x, "avx512", small_m=16)
    assert not torch.equal(panels, direct)
    assert torch.equal(run([td], x, "avx512"), panels)
    check(run([td], x, "avx512"), td, x, act_group(qtype, 1, "avx512"))
    assert torch.equal(run([td, other], x, "avx512"), run([td, other], x, "avx512", small_m=16))
    monkeypatch.setenv("TOKENTOP_PACKED", "0")
    assert torch.equal(run([td], x, "avx512"), direct)


@pytest.mark.skipif("avx512" not in runnable_isas(), reason="the packed K-quant panels are AVX-512's")
def test_packed_copies_follow_their_matrices():
    """A packed copy lives as long as its matrix's storage: a new storage over the same bytes
    (a new matrix at a freed one's address) gets its own copy, never the old one's (the cache
    holds storages weakly), and the freed storage's copy is let go."""
    k, rows = 512, 64
    size = rows // 16 * k // 256 * 2304                 # Q4_K: 2304 bytes per tile and super-block
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(91))
    first, second = random_td(T.Q4_K, rows, k, seed=92), random_td(T.Q4_K, rows, k, seed=93)
    buf = first.raw.copy().reshape(-1)
    w = torch.from_numpy(buf)
    y_first = kernels.qmatmul(x, [w], [int(T.Q4_K)], [rows], None, "avx512", -1, 1)
    held = kernels.packed_bytes()
    assert held >= size
    del w
    buf[:] = second.raw.reshape(-1)                     # the same address, a new storage
    w = torch.from_numpy(buf)
    y = kernels.qmatmul(x, [w], [int(T.Q4_K)], [rows], None, "avx512", -1, 1)
    check(y, second, x, act_group(T.Q4_K, 8, "avx512", big_m=1))
    assert not torch.equal(y, y_first)
    assert kernels.packed_bytes() <= held               # the first storage's copy went
    alias = torch.from_numpy(buf)                       # two live storages over one buffer
    assert torch.equal(kernels.qmatmul(x, [alias], [int(T.Q4_K)], [rows], None, "avx512", -1, 1), y)
    assert torch.equal(kernels.qmatmul(x, [w], [int(T.Q4_K)], [rows], None, "avx512", -1, 1), y)
