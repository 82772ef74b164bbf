"""Dequantization (bit-exact vs gguf-py), weight forms, kernel choice and batch invariance."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from engine.errors import ModelError
from engine.models import quant
from engine.models.gguf import TensorData, load_gguf
from engine import kernels
from engine.models.quant import (SUPPORTED_TYPES, LinearPolicy, dequantize, dequantize_rows,
                                 make_embedding, make_linear)
from engine.models.gguf import DENSE_FALLBACK_TYPES
from tests.fixtures.tiny_gguf import RANDOM_BLOCK_TYPES, quantize, random_blocks

BLOCK_TYPES = (T.Q8_0, T.Q5_0, T.Q4_0, T.BF16, T.F16, T.F32)
K_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)
FP32 = LinearPolicy(activation_dtype=torch.float32)


def make_td(qtype: T, rows: int = 48, cols: int = 256, seed: int = 0, name: str = "w") -> TensorData:
    """A TensorData of random weights: quantized by gguf-py, or random blocks (K-quants, Q2_K,
    Q3_K, IQ4_NL, IQ4_XS: gguf-py has no quantizer for them)."""
    rng = np.random.default_rng(seed)
    if qtype in RANDOM_BLOCK_TYPES:
        data = random_blocks((rows, cols), qtype, rng)
    else:
        data = quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype, rng)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
    return TensorData(name, qtype, (rows, cols), raw)


def reference(td: TensorData) -> np.ndarray:
    return gguf.quants.dequantize(td.raw, td.ggml_type).reshape(td.shape)


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_is_bit_exact(qtype):
    td = make_td(qtype)
    ours = dequantize(td).numpy()
    assert ours.shape == td.shape and ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), reference(td).view(np.uint32))


def test_dequantize_chunks_and_dtypes(monkeypatch):
    td = make_td(T.Q5_0, rows=200, cols=64)
    whole = dequantize(td)
    monkeypatch.setattr(quant, "_CHUNK_WEIGHTS", 64 * 32)      # 32-row chunks
    assert torch.equal(dequantize(td), whole)
    assert torch.equal(dequantize(td, torch.bfloat16), whole.to(torch.bfloat16))
    assert torch.equal(dequantize(td, torch.float16), whole.to(torch.float16))


def test_dequantize_real_file_tensors(tiny_model_path):
    gf = load_gguf(tiny_model_path("qwen2", hidden=256, ffn=512, n_heads=4, head_dim=64))
    types = set()
    for td in gf.tensors.values():
        assert np.array_equal(dequantize(td).numpy().reshape(-1), reference(td).reshape(-1)), td.name
        types.add(td.ggml_type)
    # the K-quant tiny model's mix holds every type but the dense-fallback ones
    assert types == set(SUPPORTED_TYPES) - set(DENSE_FALLBACK_TYPES)


def test_unsupported_type():
    td = TensorData("blk.0.ffn_down.weight", T.IQ2_XXS, (4, 256), np.zeros((4, 66), np.uint8))
    for build in (lambda: dequantize(td), lambda: make_linear(td, bias=None, policy=LinearPolicy()),
                  lambda: make_embedding(td)):
        with pytest.raises(ModelError, match=r"'blk\.0\.ffn_down\.weight' has type IQ2_XXS, which tokentop "
                                             r"cannot load \(supported: F32, F16, BF16, Q4_0, .*, IQ4_XS\); "
                                             r"use a GGUF quantized to one of those types"):
            build()


@pytest.mark.parametrize("qtype", DENSE_FALLBACK_TYPES, ids=lambda t: t.name)
def test_dense_fallback_types_run_as_a_dense_copy(qtype):
    """No kernel reads these types: the layer holds the dequantized weight (policy's dense
    dtype), and embeddings dequantize only the rows looked up."""
    td = make_td(qtype, rows=40)
    policy = LinearPolicy(activation_dtype=torch.float32)
    lin = make_linear(td, bias=None, policy=policy)
    assert lin.gguf is None and lin.kernel_forms() == {"dense-float32": 1}
    assert torch.equal(lin.dense, torch.from_numpy(reference(td)))
    x = torch.randn(3, 256)
    torch.testing.assert_close(lin(x), x @ torch.from_numpy(reference(td)).T, rtol=1e-5, atol=1e-5)
    bf16 = make_linear(td, bias=None, policy=LinearPolicy(dense_dtype=torch.bfloat16))
    assert bf16.dense.dtype == torch.bfloat16 and bf16.gguf is None
    ids = torch.tensor([3, 0, 39])
    assert torch.equal(make_embedding(td)(ids), torch.from_numpy(reference(td))[ids])


needs_kernels = pytest.mark.skipif(not kernels.available(), reason="quantized kernels could not be built")


@needs_kernels
@pytest.mark.parametrize("qtype", quant.KERNEL_TYPES, ids=lambda t: t.name)
def test_quantized_types_run_on_their_gguf_bytes(qtype):
    """No unpacked or dense copy: the layer's weight is the file's bytes (a view, not a copy)."""
    td = make_td(qtype, rows=40, seed=3)
    lin = make_linear(td, bias=None, policy=LinearPolicy())
    tiles = {"gguf-tiles"} if kernels.direct_rows() else set()    # the portable ISA has one kernel
    lanes = {"gguf-lanes"} if tiles and qtype == T.Q8_0 and kernels.lane_rows() else set()   # AVX2's 7-8 rows
    assert lin.dense is None and set(lin.kernel_forms()) == {"gguf"} | tiles | lanes
    assert lin.gguf.tensors[0].data_ptr() == td.raw.ctypes.data and lin.gguf.nbytes == td.raw.nbytes
    x = torch.randn(3, td.shape[1])
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (3, 40)
    ref = x.double() @ dequantize(td).double().T
    # int8 activations per 32 values: |error| <= sum |w| * max|x_group| / 254 (engine/kernels)
    d = x.abs().reshape(3, -1, 32).amax(-1).repeat_interleave(32, 1).double() / 127
    assert ((y.double() - ref).abs() <= d @ dequantize(td).abs().double().T * 0.51 + 1e-6).all()


def test_float_types_and_no_kernels_use_a_dense_copy(monkeypatch):
    td = make_td(T.F16)
    lin = make_linear(td, bias=None, policy=LinearPolicy(torch.float32))
    assert lin.gguf is None and lin.kernel_forms() == {"dense-float32": 1} and lin.exact
    q = make_td(T.Q5_0)
    off = make_linear(q, bias=None, policy=LinearPolicy(torch.float32, use_kernels=False))
    assert off.gguf is None and torch.equal(off.dense, dequantize(q))
    monkeypatch.setattr(kernels, "available", lambda: False)      # no compiler: the same
    assert make_linear(q, bias=None, policy=LinearPolicy(torch.float32)).gguf is None


@needs_kernels
def test_kernel_choice_by_rows():
    td = make_td(T.Q5_0)
    lin = make_linear(td, bias=None, policy=LinearPolicy(dense_threshold=16))
    assert lin.gguf is not None and lin.dense is not None
    assert [lin.kernel_for(t) for t in (1, 15, 16, 512)] == ["gguf", "gguf", "dense", "dense"]
    x = torch.randn(20, 256).to(torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x.to(lin.dense.dtype), lin.dense).to(torch.bfloat16))
    only_gguf = make_linear(td, bias=None, policy=LinearPolicy())
    assert only_gguf.dense is None and only_gguf.kernel_for(4096) == "gguf"


@needs_kernels
def test_deterministic_mode_keeps_one_kernel():
    td = make_td(T.Q8_0)
    lin = make_linear(td, bias=None, policy=LinearPolicy(dense_threshold=16, deterministic=True))
    assert lin.dense is None and {lin.kernel_for(t) for t in (1, 16, 4096)} == {"gguf"}
    # and only the tile kernel: the direct decode kernel's bits differ from the tiles'
    assert lin.small_m == 0 and set(lin.kernel_forms()) == {"gguf"}
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(0))
    assert torch.equal(lin(x[:1]), lin(x)[:1])
    f16 = make_linear(make_td(T.F16), bias=None, policy=LinearPolicy(deterministic=True))
    assert f16.gguf is None and {f16.kernel_for(t) for t in (1, 4096)} == {"dense"}



def rows_are_batch_invariant(f, x: torch.Tensor, batch_sizes=(2, 5, 8, 33)) -> bool:
    alone = torch.cat([f(x[i:i + 1]) for i in range(max(batch_sizes))])
    return all(torch.equal(f(x[:m]), alone[:m]) for m in batch_sizes)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
def test_batch_invariance_of_each_kernel(dtype):
    td = make_td(T.Q5_0, rows=96, cols=512, seed=5)
    x = torch.randn(33, 512).to(dtype)
    if kernels.available():
        gguf = make_linear(td, bias=None, policy=LinearPolicy(dtype, deterministic=True))
        assert rows_are_batch_invariant(gguf, x)
    for dense_dtype in (dtype, torch.float32):      # dense GEMM needs (and gets) one row per call
        dense = make_linear(td, bias=None, policy=LinearPolicy(dtype, dense_threshold=1, deterministic=True,
                                                               dense_dtype=dense_dtype, use_kernels=False))
        assert dense.dense.dtype == dense_dtype and dense.rowwise
        assert rows_are_batch_invariant(dense, x)


def test_plain_fp32_gemm_is_not_batch_invariant_which_is_why_rowwise_exists():
    w = torch.randn(256, 512)
    x = torch.randn(33, 512)
    assert not rows_are_batch_invariant(lambda a: F.linear(a, w), x)


@needs_kernels
def test_switching_kernels_changes_rows_but_deterministic_mode_does_not():
    td = make_td(T.Q8_0, rows=64, cols=512, seed=6)
    x = torch.randn(33, 512).to(torch.bfloat16)
    switching = make_linear(td, bias=None, policy=LinearPolicy(dense_threshold=4))
    assert not rows_are_batch_invariant(switching, x)    # gguf below 4 rows, dense from 4
    det = make_linear(td, bias=None, policy=LinearPolicy(dense_threshold=4, deterministic=True))
    assert rows_are_batch_invariant(det, x)
    if kernels.direct_rows():       # the GGUF op alone switches too: direct kernel, then tiles
        # (fp32 activations: bf16 outputs may round both kernels' sums to the same values).
        # Q4_0: on AVX2 the two Q8_0 kernels happen to add in the same order (same bits).
        gguf = make_linear(make_td(T.Q4_0, rows=64, cols=512, seed=6), bias=None, policy=LinearPolicy(torch.float32))
        assert not rows_are_batch_invariant(gguf, torch.randn(33, 512, generator=torch.Generator().manual_seed(0)))


def test_stacked_tensors_with_mixed_types_and_bias():
    parts = [make_td(T.Q5_0, rows=64, seed=7, name="q"), make_td(T.Q4_K, rows=32, seed=8, name="k"),
             make_td(T.Q8_0, rows=40, seed=9, name="v")]
    biases = [TensorData(f"b{i}", T.F32, (p.shape[0],),
                         np.random.default_rng(i).standard_normal(p.shape[0]).astype(np.float32).view(np.uint8))
              for i, p in enumerate(parts)]
    x = torch.randn(3, 256)
    for policy in (LinearPolicy(torch.float32), LinearPolicy(torch.float32, use_kernels=False)):
        fused = make_linear(parts, bias=biases, policy=policy)
        assert fused.out_features == 136
        alone = torch.cat([make_linear(p, bias=b, policy=policy)(x) for p, b in zip(parts, biases)], dim=1)
        torch.testing.assert_close(fused(x), alone, rtol=1e-5, atol=1e-5)


def test_bias_size_mismatch():
    with pytest.raises(ModelError, match="bias for w has 3 values, expected 48"):
        make_linear(make_td(T.Q8_0), bias=torch.zeros(3), policy=LinearPolicy())


def test_vocab_not_a_multiple_of_16(tiny_model_path):
    gf = load_gguf(tiny_model_path("qwen2"))
    head = gf.tensor("output.weight")
    assert head.shape[0] % 16 != 0
    lin = make_linear(head, bias=None, policy=LinearPolicy(torch.float32))
    x = torch.randn(2, head.shape[1])
    y = lin(x)
    assert y.shape == (2, head.shape[0])
    torch.testing.assert_close(y, x @ dequantize(head).T, rtol=0.02, atol=0.02)


def test_leading_dimensions_are_kept():
    lin = make_linear(make_td(T.Q4_0), bias=None, policy=LinearPolicy())
    assert lin(torch.randn(2, 3, 256).to(torch.bfloat16)).shape == (2, 3, 48)


def test_dense_only_path_used_for_cuda_builds_the_dense_weight():
    td = make_td(T.Q4_K)
    lin = quant._make_dense_only_linear("w", [td], None, LinearPolicy(dense_threshold=None))
    assert lin.gguf is None and lin.kernel_for(1) == "dense"
    assert torch.equal(lin.dense, dequantize(td, LinearPolicy().dense_weight_dtype))
    assert LinearPolicy(device="cuda:1").on_cuda and not LinearPolicy().on_cuda
    assert LinearPolicy(device="cuda:1").dense_weight_dtype == torch.bfloat16


def test_embedding_rows(tiny_model_path):
    gf = load_gguf(tiny_model_path("gemma3"))
    td = gf.tensor("token_embd.weight")
    emb = make_embedding(td)
    ids = torch.tensor([[0, 5, 263], [5, 5, 1]])
    out = emb(ids)
    assert out.shape == (2, 3, td.shape[1]) and out.dtype == torch.float32
    assert torch.equal(out, dequantize(td)[ids])
    assert torch.equal(make_embedding(td, dtype=torch.bfloat16)(ids), dequantize(td, torch.bfloat16)[ids])
    assert torch.equal(dequantize_rows(td, torch.tensor([7])), dequantize(td)[7:8])
    with pytest.raises(IndexError, match="out of range"):
        emb(torch.tensor([td.shape[0]]))


def test_dense_copy_dtype(monkeypatch):
    td = make_td(T.Q5_0)
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(quant, "cpu_has_native_bf16", lambda: native)
        quant.preferred_dense_dtype.cache_clear()
        assert LinearPolicy().dense_weight_dtype == expected
        assert make_linear(td, bias=None, policy=LinearPolicy(use_kernels=False)).dense.dtype == expected
    quant.preferred_dense_dtype.cache_clear()
    assert LinearPolicy(torch.float16).dense_weight_dtype == torch.float16
    lin = make_linear(td, bias=torch.ones(48), policy=LinearPolicy(dense_dtype=torch.float32, use_kernels=False))
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    y = lin(x)
    assert y.dtype == torch.bfloat16
    # the bias inside the same fp32 linear: added afterwards instead, the fp32 sums round
    # differently and ~1% of random inputs land on the other side of a bf16 rounding
    assert torch.equal(y, F.linear(x.float(), dequantize(td), torch.ones(48)).to(torch.bfloat16))


@pytest.mark.realmodel
@pytest.mark.slow
def test_real_model_builds_every_linear(real_model_path):
    """All 0.5B linears on their GGUF bytes, fused q/k/v and gate/up; one token each."""
    gf = load_gguf(real_model_path)
    c = gf.config
    policy = LinearPolicy()
    x = torch.randn(1, c.hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for i in range(c.n_layers):
        p = f"blk.{i}."
        qkv = make_linear([gf.tensor(p + f"attn_{n}.weight") for n in "qkv"],
                          bias=[gf.tensor(p + f"attn_{n}.bias") for n in "qkv"], policy=policy)
        gate_up = make_linear([gf.tensor(p + "ffn_gate.weight"), gf.tensor(p + "ffn_up.weight")],
                              bias=None, policy=policy)
        down = make_linear(gf.tensor(p + "ffn_down.weight"), bias=None, policy=policy)
        o = make_linear(gf.tensor(p + "attn_output.weight"), bias=None, policy=policy)
        assert qkv(x).shape == (1, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim)
        assert o(x).shape == (1, c.hidden)
        assert down(gate_up(x)[:, :c.ffn_dim]).isfinite().all()
        assert (down.gguf is None) == (not kernels.available())
    head_td = gf.tensor("output.weight")
    head = make_linear(head_td, bias=None, policy=policy)
    y = head(x).float()
    ref = x.float() @ dequantize(head_td).T
    # the chosen row is the reference's best up to the measured error (random input: near-ties)
    assert ref[0, y.argmax()] >= ref.max() - 2 * (y - ref).abs().max()
    assert ((y - ref).norm() / ref.norm()) < 0.01


@pytest.mark.skipif(not kernels.available() or kernels.isa_name() != "avx512",
                    reason="the packed copies are AVX-512's")
def test_pack_for_batches_packs_at_load_what_batches_read():
    """pack_for_batches makes the packed copies of the layers that many-row calls take (so the
    first prefill does not pay for them), not of deterministic mode's (its tiles read the GGUF
    blocks), and the layers compute what they computed before."""
    layers = torch.nn.ModuleList([
        make_linear(make_td(T.Q4_K, rows=64, cols=512, seed=1), bias=None, policy=FP32),
        make_linear(make_td(T.Q8_0, rows=64, cols=512, seed=2), bias=None, policy=FP32),
        make_linear(make_td(T.Q6_K, rows=48, cols=512, seed=3), bias=None,
                    policy=LinearPolicy(activation_dtype=torch.float32, deterministic=True))])
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(4))
    keep = make_linear(make_td(T.Q5_K, rows=16, cols=256, seed=5), bias=None, policy=FP32)
    quant.pack_for_batches(keep)          # packing lets go of the copies of matrices freed before
    before = kernels.packed_bytes()
    held = quant.pack_for_batches(layers)
    # the Q4_K layer's copy (2304 bytes per tile and super-block) and the Q8_0 one's (544 per
    # tile and block), not the deterministic Q6_K layer's
    assert held - before == 64 // 16 * 512 // 256 * 2304 + 64 // 16 * 512 // 32 * 544
    assert kernels.packed_bytes() == held                     # a later call packs nothing more
    with torch.inference_mode():
        ys = [layer(x) for layer in layers]
    assert kernels.packed_bytes() == held
    assert all(torch.isfinite(y).all() for y in ys)
