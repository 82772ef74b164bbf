"""Dequantization (bit-exact vs gguf-py), exact int4 planes, kernel choice and batch invariance."""
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
from engine.models.quant import (INT4_EXACT_TYPES, SUPPORTED_TYPES, LinearPolicy, dequantize,
                                 dequantize_rows, make_embedding, make_linear)
from tests.fixtures.tiny_gguf import quantize, random_k_blocks

BLOCK_TYPES = (T.Q8_0, T.Q5_0, T.Q4_0, T.BF16, T.F16, T.F32)
K_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)
FP32 = LinearPolicy(activation_dtype=torch.float32)


def make_td(qtype: T, rows: int = 48, cols: int = 256, seed: int = 0, name: str = "w") -> TensorData:
    """A TensorData of random weights: quantized by gguf-py, or random K-quant blocks."""
    rng = np.random.default_rng(seed)
    if qtype in K_TYPES:
        data = random_k_blocks((rows, cols), qtype, rng)
    else:
        data = quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype, rng)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
    return TensorData(name, qtype, (rows, cols), raw)


def reference(td: TensorData) -> np.ndarray:
    return gguf.quants.dequantize(td.raw, td.ggml_type).reshape(td.shape)


def effective_weight(lin, k: int, cols: int | None = None) -> torch.Tensor:
    """W[:, :cols] as the layer computes it: feed identity rows (fp32: exact products by 1)."""
    return lin(torch.eye(k, dtype=torch.float32)[:cols]).T


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
    assert types == set(SUPPORTED_TYPES)    # the K-quant tiny model holds every supported type


def test_unsupported_type():
    td = TensorData("blk.0.ffn_down.weight", T.Q2_K, (4, 256), np.zeros((4, 84), np.uint8))
    for build in (lambda: dequantize(td), lambda: make_linear(td, bias=None, policy=LinearPolicy()),
                  lambda: make_embedding(td)):
        with pytest.raises(ModelError, match=r"'blk\.0\.ffn_down\.weight' has type Q2_K.*supported: "
                                             r"F32, F16, BF16, Q8_0, Q5_0, Q4_0, Q4_K, Q5_K, Q6_K"):
            build()


def test_int4_kernel_formula():
    """The CPU kernel computes w = (q - 8) * scale + zero per 32-group, scales_and_zeros [K/32, N, 2]."""
    rng = np.random.default_rng(1)
    n, k = 32, 64
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    s = rng.uniform(0.5, 2, (k // 32, n)).astype(np.float32)
    z = rng.standard_normal((k // 32, n)).astype(np.float32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 1)
    sz = torch.from_numpy(np.stack([s, z], -1))
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k), packed, 32, sz)
    w = (q.astype(np.float32) - 8) * np.repeat(s.T, 32, axis=1) + np.repeat(z.T, 32, axis=1)
    np.testing.assert_allclose(y.T.numpy(), w, rtol=1e-6, atol=1e-6)


def test_packer_reproduces_torch_layout_on_this_cpu():
    """Whatever the CPU's row block, the packer in use equals torch's own op on the whole matrix."""
    block = quant.int4_row_block()
    assert block >= 16 and block & (block - 1) == 0
    q = np.random.default_rng(2).integers(0, 16, (4 * block, 320), dtype=np.uint8)
    assert np.array_equal(quant._pack_rows()(q), quant._pack_rows_torch(q))


@pytest.mark.parametrize("block", (32, 64))
def test_numpy_packer_generalizes_over_the_row_block(block):
    """The numpy layout for a block b pairs row j with row j + b/2; torch's op on a CPU whose
    block is b must agree (checked for the block of this CPU, the other one is a layout fact)."""
    q = np.random.default_rng(3).integers(0, 16, (2 * block, 64), dtype=np.uint8)
    packed = quant._pack_rows_np(q, block)
    first = packed[:block].reshape(64, block // 2)         # block 0: for each k, block/2 bytes
    assert np.array_equal((first & 0x0F).T, q[:block // 2])
    assert np.array_equal((first >> 4).T, q[block // 2:block])
    if block == quant.int4_row_block():
        assert np.array_equal(packed, quant._pack_rows_torch(q))


def test_row_block_is_learned_from_torch(monkeypatch):
    """A (simulated) CPU whose layout packs 128-row blocks: the probe finds 128, not a known list."""
    def pack_in_128_row_blocks(q):       # a partial block is packed as one short block
        return quant._pack_rows_np(q, 128 if len(q) % 128 == 0 else len(q))
    monkeypatch.setattr(quant, "_pack_rows_torch", pack_in_128_row_blocks)
    quant.int4_row_block.cache_clear()
    try:
        assert quant.int4_row_block() == 128
    finally:
        quant.int4_row_block.cache_clear()


@pytest.mark.parametrize("chunk", (32, 96, 672, 61), ids=lambda c: f"chunk{c}")
def test_chunked_packing_equals_whole_matrix_packing(chunk):
    """The int4 layout bug: pieces of 32*odd rows scrambled AVX-512's 64-row blocks. Feeding the
    packer in pieces of any size (an odd tail included) must equal torch packing the whole."""
    n, k = 700, 64
    q = np.random.default_rng(4).integers(0, 16, (n, k), dtype=np.uint8)
    zeros = np.zeros((n, k // 32), np.float32)
    packer = quant._Int4Packer(n, k, planes=1)
    for a in range(0, n, chunk):
        packer.add((q[a:a + chunk], zeros[a:a + chunk], zeros[a:a + chunk]))
    weight = packer.finish(torch.float32)
    n_pad = weight.packed.shape[0]
    assert n_pad % quant.int4_row_block() == 0 and n_pad >= n
    whole = np.concatenate([q, np.full((n_pad - n, k), 8, np.uint8)])
    assert np.array_equal(weight.packed.numpy(), quant._pack_rows_torch(whole))


@pytest.mark.parametrize("piece", (32, 96), ids=lambda c: f"piece{c}")
def test_row_chunks_are_whole_row_blocks(monkeypatch, piece):
    """_row_chunks cuts at whole row blocks even when the weight budget would cut elsewhere."""
    monkeypatch.setattr(quant, "_CHUNK_WEIGHTS", piece * 1536)
    block = quant.int4_row_block()
    chunks = quant._row_chunks(1000, 1536)
    assert all((c.stop - c.start) % block == 0 for c in chunks[:-1])
    assert chunks[-1].stop == 1000


@pytest.mark.parametrize("qtype", INT4_EXACT_TYPES, ids=lambda t: t.name)
def test_int4_planes_reproduce_dequantize_exactly_in_fp32(qtype):
    td = make_td(qtype, rows=40)                   # 40 rows: padded to 64 for the packer
    lin = make_linear(td, bias=None, policy=LinearPolicy(torch.float32, dense_threshold=None))
    assert lin.dense is None and lin.int4.planes == (1 if qtype in (T.Q4_0, T.Q4_K) else 2)
    w = effective_weight(lin, td.shape[1])
    ref = dequantize(td)
    if qtype in (T.Q4_K, T.Q5_K):
        # (q - 8)*s + (8s - m) rounds once more than ggml's s*q - m: within an ulp of the terms
        bound = 2 * torch.finfo(torch.float32).eps * (ref.abs() + 16 * quant._unpack(td).scale.max())
        assert ((w - ref).abs() <= bound).all()
    else:
        assert torch.equal(w, ref)


@pytest.mark.parametrize("qtype", INT4_EXACT_TYPES, ids=lambda t: t.name)
def test_int4_planes_in_bf16_lose_only_scale_rounding(qtype):
    td = make_td(qtype, rows=64, seed=3)
    lin = make_linear(td, bias=None, policy=LinearPolicy(dense_threshold=None))
    x = torch.randn(3, td.shape[1]).to(torch.bfloat16)
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 64)
    ref = x.float() @ dequantize(td).T
    # weights carry bf16-rounded scales (relative 2^-8), the output one more bf16 rounding
    budget = 2 ** -8 * (x.float().abs() @ dequantize(td).abs().T) * 2 + 2 ** -8 * ref.abs()
    if qtype in (T.Q4_K, T.Q5_K):   # plus the rounding of the zero 8s - dmin*m
        c = quant._unpack(td)
        zero = torch.from_numpy(np.abs(8 * c.scale - c.minus)).repeat_interleave(32, 1)
        budget += 2 ** -8 * (x.float().abs() @ zero.T)
    assert ((y.float() - ref).abs() <= budget).all()


def test_q6_k_stays_dense_in_faithful_mode_and_becomes_int4_in_fast_mode():
    td = make_td(T.Q6_K)
    faithful = make_linear(td, bias=None, policy=LinearPolicy(dense_threshold=None))
    assert faithful.int4 is None and faithful.kernel_for(1) == "dense"
    assert torch.equal(faithful.dense, dequantize(td, LinearPolicy().dense_weight_dtype))
    fast = make_linear(td, bias=None, policy=LinearPolicy(weights="fast", dense_threshold=None))
    assert fast.int4 is not None and fast.int4.planes == 1 and fast.dense is None


@pytest.mark.parametrize("qtype", (T.Q5_0, T.Q8_0, T.Q6_K, T.Q5_K), ids=lambda t: t.name)
def test_fast_mode_requantizes_to_one_plane_with_bounded_error(qtype):
    td = make_td(qtype, rows=64, seed=4)
    lin = make_linear(td, bias=None, policy=LinearPolicy(torch.float32, weights="fast", dense_threshold=None))
    assert lin.int4.planes == 1
    w, ref = effective_weight(lin, td.shape[1]), dequantize(td)
    groups = ref.reshape(64, -1, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15       # the 4-bit step of each group
    err = (w - ref).reshape(64, -1, 32).abs().amax(-1)
    assert (err <= step / 2 * 1.01 + 1e-7).all()
    assert (w - ref).abs().max() > 0                     # lossy, and labelled as such


def test_fast_mode_keeps_4_bit_types_exact():
    for qtype in (T.Q4_0, T.Q4_K):
        td = make_td(qtype)
        fast = make_linear(td, bias=None, policy=LinearPolicy(torch.float32, weights="fast", dense_threshold=None))
        faithful = make_linear(td, bias=None, policy=LinearPolicy(torch.float32, dense_threshold=None))
        assert torch.equal(fast.int4.packed, faithful.int4.packed)
        assert torch.equal(fast.int4.scales_zeros, faithful.int4.scales_zeros)


def test_kernel_choice_by_rows():
    td = make_td(T.Q5_0)
    lin = make_linear(td, bias=None, policy=LinearPolicy(dense_threshold=16))
    assert lin.int4 is not None and lin.dense is not None
    assert [lin.kernel_for(t) for t in (1, 15, 16, 512)] == ["int4", "int4", "dense", "dense"]
    x = torch.randn(20, 256).to(torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x.to(lin.dense.dtype), lin.dense).to(torch.bfloat16))
    assert torch.equal(lin(x[:4]), lin.int4.matmul(x[:4]))
    only_dense = make_linear(td, bias=None, policy=LinearPolicy(dense_threshold=1))
    assert only_dense.int4 is None and only_dense.kernel_for(1) == "dense"
    only_int4 = make_linear(td, bias=None, policy=LinearPolicy(dense_threshold=None))
    assert only_int4.dense is None and only_int4.kernel_for(4096) == "int4"


def test_deterministic_mode_keeps_one_kernel():
    td = make_td(T.Q8_0)
    lin = make_linear(td, bias=None, policy=LinearPolicy(dense_threshold=16, deterministic=True))
    assert lin.dense is None and {lin.kernel_for(t) for t in (1, 16, 4096)} == {"int4"}
    q6 = make_linear(make_td(T.Q6_K), bias=None, policy=LinearPolicy(deterministic=True))
    assert q6.int4 is None and {q6.kernel_for(t) for t in (1, 4096)} == {"dense"}


def rows_are_batch_invariant(f, x: torch.Tensor, batch_sizes=(2, 5, 8, 33)) -> bool:
    alone = torch.cat([f(x[i:i + 1]) for i in range(max(batch_sizes))])
    return all(torch.equal(f(x[:m]), alone[:m]) for m in batch_sizes)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
def test_batch_invariance_of_each_kernel(dtype):
    td = make_td(T.Q5_0, rows=96, cols=512, seed=5)
    x = torch.randn(33, 512).to(dtype)
    int4 = make_linear(td, bias=None, policy=LinearPolicy(dtype, dense_threshold=None))
    assert rows_are_batch_invariant(int4, x)
    # GEMM is not batch-invariant on every CPU (fp32 on AVX2, fp16 on AVX-512 were not), so
    # deterministic mode runs one row per call whatever the dense dtype
    for dense_dtype in (dtype, torch.float32):
        dense = make_linear(td, bias=None, policy=LinearPolicy(dtype, dense_threshold=1, deterministic=True,
                                                               dense_dtype=dense_dtype))
        assert dense.dense.dtype == dense_dtype and dense.rowwise
        assert rows_are_batch_invariant(dense, x)


def test_plain_fp32_gemm_is_not_batch_invariant_which_is_why_rowwise_exists():
    w = torch.randn(256, 512)
    x = torch.randn(33, 512)
    assert not rows_are_batch_invariant(lambda a: F.linear(a, w), x)


def test_switching_kernels_changes_rows_but_deterministic_mode_does_not():
    td = make_td(T.Q8_0, rows=64, cols=512, seed=6)
    x = torch.randn(33, 512).to(torch.bfloat16)
    switching = make_linear(td, bias=None, policy=LinearPolicy(dense_threshold=4))
    assert not rows_are_batch_invariant(switching, x)    # int4 below 4 rows, dense from 4
    det = make_linear(td, bias=None, policy=LinearPolicy(dense_threshold=4, deterministic=True))
    assert rows_are_batch_invariant(det, x)


def test_stacked_tensors_with_mixed_types_and_bias():
    parts = [make_td(T.Q5_0, rows=64, seed=7, name="q"), make_td(T.Q4_K, rows=32, seed=8, name="k"),
             make_td(T.Q8_0, rows=40, seed=9, name="v")]
    biases = [TensorData(f"b{i}", T.F32, (p.shape[0],),
                         np.random.default_rng(i).standard_normal(p.shape[0]).astype(np.float32).view(np.uint8))
              for i, p in enumerate(parts)]
    x = torch.randn(3, 256)
    for policy in (LinearPolicy(torch.float32, dense_threshold=None), LinearPolicy(torch.float32, dense_threshold=1)):
        fused = make_linear(parts, bias=biases, policy=policy)
        assert fused.out_features == 136
        alone = torch.cat([make_linear(p, bias=b, policy=policy)(x) for p, b in zip(parts, biases)], dim=1)
        torch.testing.assert_close(fused(x), alone, rtol=1e-5, atol=1e-5)
    assert make_linear(parts, bias=None, policy=LinearPolicy(dense_threshold=None)).int4.planes == 2


def test_bias_size_mismatch():
    with pytest.raises(ModelError, match="bias for w has 3 values, expected 48"):
        make_linear(make_td(T.Q8_0), bias=torch.zeros(3), policy=LinearPolicy())


def test_vocab_not_a_multiple_of_16_is_padded(tiny_model_path):
    gf = load_gguf(tiny_model_path("qwen2"))
    head = gf.tensor("output.weight")
    assert head.shape[0] % 16 != 0
    lin = make_linear(head, bias=None, policy=LinearPolicy(torch.float32, dense_threshold=None))
    x = torch.randn(2, head.shape[1])
    y = lin(x)
    assert y.shape == (2, head.shape[0])
    torch.testing.assert_close(y, x @ dequantize(head).T, rtol=1e-5, atol=1e-5)


def test_leading_dimensions_are_kept():
    lin = make_linear(make_td(T.Q4_0), bias=None, policy=LinearPolicy())
    assert lin(torch.randn(2, 3, 256).to(torch.bfloat16)).shape == (2, 3, 48)


def test_dense_only_path_used_for_cuda_builds_the_dense_weight():
    td = make_td(T.Q4_K)
    lin = quant._make_dense_only_linear("w", [td], None, LinearPolicy(dense_threshold=None))
    assert lin.int4 is None and lin.kernel_for(1) == "dense"
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
        assert make_linear(td, bias=None, policy=LinearPolicy()).dense.dtype == expected
    quant.preferred_dense_dtype.cache_clear()
    assert LinearPolicy(torch.float16).dense_weight_dtype == torch.float16
    lin = make_linear(td, bias=torch.ones(48), policy=LinearPolicy(dense_threshold=1, dense_dtype=torch.float32))
    x = torch.randn(4, 256).to(torch.bfloat16)
    y = lin(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, (F.linear(x.float(), dequantize(td)) + 1).to(torch.bfloat16))


def test_policy_validation():
    with pytest.raises(ModelError, match="weights must be 'faithful' or 'fast'"):
        LinearPolicy(weights="turbo")


@pytest.mark.realmodel
def test_real_model_int4_planes_match_dequantize(real_model_path):
    """Every int4-exact type of the real 0.5B, 64 rows each: the split reproduces the GGUF values."""
    gf = load_gguf(real_model_path)
    seen = {}
    for td in gf.tensors.values():
        if td.ggml_type in INT4_EXACT_TYPES and td.ggml_type not in seen:
            seen[td.ggml_type] = TensorData(td.name, td.ggml_type, (64, td.shape[1]), td.raw[:64])
    assert set(seen) == {T.Q5_0, T.Q8_0, T.Q4_K}
    for qtype, td in seen.items():
        lin = make_linear(td, bias=None, policy=LinearPolicy(torch.float32, dense_threshold=None))
        w, ref = effective_weight(lin, td.shape[1], cols=512), dequantize(td)[:, :512]
        if qtype == T.Q4_K:
            torch.testing.assert_close(w, ref, rtol=0, atol=4 * torch.finfo(torch.float32).eps * ref.abs().max())
        else:
            assert torch.equal(w, ref), td.name


@pytest.mark.realmodel
@pytest.mark.slow
def test_real_model_builds_every_linear(real_model_path):
    """All 0.5B linears as int4 (dense only for Q6_K), fused q/k/v and gate/up; one token each."""
    gf = load_gguf(real_model_path)
    c = gf.config
    policy = LinearPolicy(dense_threshold=None)
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
        assert (down.int4 is None) == (gf.tensor(p + "ffn_down.weight").ggml_type == T.Q6_K)
    head_td = gf.tensor("output.weight")
    head = make_linear(head_td, bias=None, policy=policy)
    y = head(x).float()
    ref = x.float() @ dequantize(head_td).T
    # the chosen row is the reference's best up to the measured error (random input: near-ties)
    assert ref[0, y.argmax()] >= ref.max() - 2 * (y - ref).abs().max()
    assert ((y - ref).norm() / ref.norm()) < 0.01
