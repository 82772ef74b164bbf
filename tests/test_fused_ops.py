"""The fused per-layer C++ ops (engine/kernels/fused_ops.cpp) against their torch definitions
(engine/models/fused.py TORCH, the no-compiler path), and the torch definitions against plain
formulas; plus the chunked top-k of the lm_head refinement."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine import kernels
from engine.models.decoder import top_candidates
from engine.models.fused import FUSED, TORCH, ops_for

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="kernel library could not be built")
TOL = dict(atol=2e-5, rtol=2e-5)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_ops_for_picks_torch_without_kernels_or_off_cpu():
    assert ops_for("cpu", use_kernels=False) is TORCH
    assert ops_for("cuda:0") is TORCH
    assert ops_for("cpu") is (FUSED if kernels.available() else TORCH)


@needs_kernels
@pytest.mark.parametrize("T", [1, 5, 40])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(T, with_delta):
    g = _gen(T)
    x = torch.randn(T, 136, generator=g) * 3
    d = torch.randn(T, 136, generator=g) if with_delta else None
    w = torch.randn(136, generator=g)
    x_ref, x_fused = x.clone(), x.clone()
    ref = TORCH.add_rms_norm(x_ref, d, w, 1e-6)
    out = FUSED.add_rms_norm(x_fused, d, w, 1e-6)
    torch.testing.assert_close(x_fused, x_ref, atol=0, rtol=0)      # the residual add, in place
    torch.testing.assert_close(out, ref, **TOL)
    plain = (x_ref / torch.sqrt((x_ref ** 2).mean(-1, keepdim=True) + 1e-6)) * w
    torch.testing.assert_close(ref, plain, **TOL)


@needs_kernels
@pytest.mark.parametrize("act", [0, 1])
@pytest.mark.parametrize("T,F_", [(1, 96), (3, 37), (20, 64)])
def test_act_mul(act, T, F_):
    gu = torch.randn(T, 2 * F_, generator=_gen(F_)) * 4
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0])   # saturated and zero inputs
    ref = TORCH.act_mul(gu, act)
    torch.testing.assert_close(FUSED.act_mul(gu, act), ref, **TOL)
    gate, up = gu[:, :F_], gu[:, F_:]
    plain = (gate * torch.sigmoid(gate) if act == 0
             else 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))) * up
    torch.testing.assert_close(ref, plain, **TOL)


@needs_kernels
@pytest.mark.parametrize("act", [0, 1])
def test_act_mul_vector_part_and_tail_give_the_same_bits(act):
    """The C++ op runs 8 values at a time, then the rest one by one: the same operations per
    value, so a value gives the same bits in either part (here values 0-4 repeated at 32-36)."""
    F_ = 37
    gu = torch.randn(2, 2 * F_, generator=_gen(5)) * 4
    gu[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    for half in (0, F_):
        gu[:, half + 32:half + 37] = gu[:, half:half + 5]
    out = FUSED.act_mul(gu, act)
    assert torch.equal(out[:, 32:37], out[:, :5])


def _rope_tables(T: int, hd: int, interleaved: bool, g) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.rand(T, hd // 2, generator=g) * 6.28
    c, s = ang.cos(), ang.sin()
    if interleaved:
        return c.repeat_interleave(2, -1), torch.stack((-s, s), -1).flatten(-2)
    return torch.cat((c, c), -1), torch.cat((-s, s), -1)


@needs_kernels
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 6])
def test_rope_store_kv(interleaved, qk_norm, dtype, T):
    g = _gen(T)
    H, KV, hd, slots_n = 6, 2, 32, 50
    qkv = torch.randn(T, (H + 2 * KV) * hd, generator=g)
    cos, sin = _rope_tables(T, hd, interleaved, g)
    norm = torch.randn(H + KV, hd, generator=g) if qk_norm else None
    slots = torch.randperm(slots_n, generator=g)[:T]
    stores = {name: (torch.randn(slots_n, KV, hd, generator=_gen(1)).to(dtype),
                     torch.randn(slots_n, KV, hd, generator=_gen(2)).to(dtype)) for name in ("ref", "fused")}
    ref = TORCH.rope_store_kv(qkv, cos, sin, norm, 1e-6, 0.125, H, KV, interleaved, *stores["ref"], slots)
    out = FUSED.rope_store_kv(qkv, cos, sin, norm, 1e-6, 0.125, H, KV, interleaved, *stores["fused"], slots)
    torch.testing.assert_close(out, ref, **TOL)
    tol = TOL if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)   # one rounding to the store
    for a, b in zip(stores["fused"], stores["ref"]):
        torch.testing.assert_close(a.float(), b.float(), **tol)
        untouched = torch.ones(slots_n, dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(a[untouched], b[untouched])   # only the rows' own slots are written

    # the torch definition against rotate-half written out (NeoX pairing, no QK-norm)
    if not interleaved and not qk_norm:
        x = qkv[:, :(H + KV) * hd].view(T, H + KV, hd)
        half = hd // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        c = cos[:, None]
        s = torch.cat([sin[:, half:], sin[:, half:]], -1)[:, None]   # unsigned sin
        plain = x * c + rot * s
        torch.testing.assert_close(ref, plain[:, :H] * 0.125, **TOL)
        if dtype == torch.float32:
            torch.testing.assert_close(stores["ref"][0][slots], plain[:, H:], **TOL)


def _naive_attention(q, k_store, v_store, slots, lengths, softcap):
    B, H, hd = q.shape
    G = H // k_store.shape[1]
    out = torch.empty(B, H, hd, dtype=torch.float64)
    for b in range(B):
        idx = slots[b, :int(lengths[b])]
        for h in range(H):
            k = k_store[idx, h // G].double()
            v = v_store[idx, h // G].double()
            s = k @ q[b, h].double()
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            out[b, h] = torch.softmax(s, 0) @ v
    return out.reshape(B, H * hd).float()


@needs_kernels
@pytest.mark.parametrize("hd", [64, 128, 40])   # 64 and 128: the constant-size clones
@pytest.mark.parametrize("softcap", [0.0, 20.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, threads", [((8, 2), 1), ((8, 2), 2), ((12, 2), 2), ((14, 2), 2),
                                            ((3, 3), 2), ((6, 2), 2)])
def test_decode_attention(hd, softcap, dtype, heads, threads):
    """heads (H, KV): group sizes 4, 6 and 7 (the bundled models) and 1 take the compile-time
    blocked kernel at hd 64 and 128, group size 3 and hd 40 the runtime-size loops."""
    g = _gen(hd)
    (H, KV), B, S = heads, 3, 300
    q = torch.randn(B, H, hd, generator=g) / math.sqrt(hd) * 3
    k_store = torch.randn(S, KV, hd, generator=g).to(dtype)
    v_store = torch.randn(S, KV, hd, generator=g).to(dtype)
    lengths = torch.tensor([1, 37, 129])
    slots = torch.zeros(B, 129, dtype=torch.int64)
    for b, n in enumerate(lengths.tolist()):
        slots[b, :n] = torch.randperm(S, generator=g)[:n]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = FUSED.decode_attention(q, k_store, v_store, slots, lengths, softcap)
        ref = TORCH.decode_attention(q, k_store, v_store, slots, lengths, softcap)
        alone = [FUSED.decode_attention(q[b:b + 1], k_store, v_store, slots[b:b + 1, :n], lengths[b:b + 1],
                                        softcap) for b, n in enumerate(lengths.tolist())]
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(ref, _naive_attention(q, k_store, v_store, slots, lengths, softcap), **TOL)
    # batch-invariant to the bit: a row alone, without its batch-mates' padding, is the same row
    assert torch.equal(out, torch.cat(alone))


@needs_kernels
@pytest.mark.parametrize("isa", ["avx2", "scalar"])
@pytest.mark.parametrize("hd, heads", [(128, (12, 2)), (64, (14, 2))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_attention_on_each_instruction_set(isa, hd, heads, dtype, monkeypatch):
    """TOKENTOP_KERNEL_ISA forces the AVX2 build of the blocked kernel (8-float vectors) or the
    runtime-size loops ("scalar") on a CPU that has more; each matches the reference."""
    monkeypatch.setenv("TOKENTOP_KERNEL_ISA", isa)
    g = _gen(hd)
    (H, KV), S = heads, 200
    q = torch.randn(2, H, hd, generator=g) / math.sqrt(hd) * 3
    k_store = torch.randn(S, KV, hd, generator=g).to(dtype)
    v_store = torch.randn(S, KV, hd, generator=g).to(dtype)
    lengths = torch.tensor([23, 150])
    slots = torch.stack([torch.randperm(S, generator=g)[:150] for _ in range(2)])
    out = FUSED.decode_attention(q, k_store, v_store, slots, lengths, 0.0)
    torch.testing.assert_close(out, _naive_attention(q, k_store, v_store, slots, lengths, 0.0), **TOL)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_attention_reads_every_16_bit_value_exactly(dtype):
    """Every fp16 / bf16 bit pattern (subnormals, signed zeros, Inf, NaN) as a V row of a sequence
    whose one key has softmax weight 1: the output is the value converted to fp32, bit for bit
    (the op converts 16-bit K/V with its own vectorizable code, not c10's)."""
    hd = 64
    n = 65536 // hd
    v_store = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype).view(n, 1, hd)
    k_store = torch.zeros(n, 1, hd, dtype=dtype)
    out = FUSED.decode_attention(torch.zeros(n, 1, hd), k_store, v_store, torch.arange(n).view(n, 1),
                                 torch.ones(n, dtype=torch.long), 0.0)
    want = v_store.float().view(n, hd)
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[~want.isnan()], want[~want.isnan()])


@needs_kernels
def test_fused_ops_refuse_bad_slots_and_shapes():
    q = torch.randn(1, 4, 16)
    store = torch.zeros(10, 2, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        FUSED.decode_attention(q, store, store, torch.tensor([[3, 10]]), torch.tensor([2]), 0.0)
    with pytest.raises(RuntimeError, match="outside"):
        FUSED.decode_attention(q, store, store, torch.tensor([[3, 4]]), torch.tensor([3]), 0.0)
    qkv = torch.randn(1, (4 + 2 * 2) * 16)
    cos = sin = torch.ones(1, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        FUSED.rope_store_kv(qkv, cos, sin, None, 1e-6, 1.0, 4, 2, False, store, store.clone(), torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="fp32"):
        FUSED.act_mul(torch.randn(2, 8, dtype=torch.bfloat16), 0)


@needs_kernels
def test_fused_ops_have_fake_implementations():
    """Meta/fake kernels: the ops can sit inside torch.compile graphs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 8)
        assert FUSED.add_rms_norm(x, None, torch.empty(8), 1e-6).shape == (3, 8)
        assert FUSED.act_mul(torch.empty(3, 8), 0).shape == (3, 4)
        store = torch.empty(10, 2, 4)
        q = FUSED.rope_store_kv(torch.empty(3, (4 + 4) * 4), torch.empty(3, 4), torch.empty(3, 4), None, 1e-6,
                                1.0, 4, 2, False, store, store, torch.zeros(3, dtype=torch.int64))
        assert q.shape == (3, 4, 4)
        o = FUSED.decode_attention(torch.empty(2, 4, 4), store, store, torch.zeros(2, 5, dtype=torch.int64),
                                   torch.ones(2, dtype=torch.int64), 0.0)
        assert o.shape == (2, 16)


@pytest.mark.parametrize("V", [151936, 262144, 5000, 1000, 64 * 32 + 1])
def test_top_candidates_is_topk(V):
    g = _gen(V)
    logits = torch.randn(4, V, generator=g)
    logits[1, :] = logits[1, :].round()            # many ties: any tie-break is topk's set up to ties
    logits[2, -40:] = 10.0 + torch.arange(40.0)    # the winners all in the last (padded) chunk
    got = top_candidates(logits, 32)
    want = logits.topk(32, dim=-1)
    assert got.shape == (4, 32)
    for r in range(4):
        assert len(set(got[r].tolist())) == 32
        # the same values as topk's (the same ids where there are no ties)
        torch.testing.assert_close(logits[r, got[r]].sort().values, want.values[r].sort().values, atol=0, rtol=0)
    for r in (0, 2, 3):
        assert set(got[r].tolist()) == set(want.indices[r].tolist())


@needs_kernels
@pytest.mark.parametrize("V", [151936, 262144, 5000, 64 * 32 + 1, 64 * 32, 40])
def test_top_candidates_op_is_topk(V):
    """The C++ top_candidates (the decoder's refinement on the CPU): each row's k largest
    logits, largest first, ties to the lowest index; NaN ranks below every number."""
    kernels.load()
    g = _gen(V)
    logits = torch.randn(5, V, generator=g)
    logits[1, :] = logits[1, :].round()              # many ties
    logits[2, -20:] = 10.0 + torch.arange(20.0)      # winners in the last (maybe short) chunk
    logits[3, ::3] = float("nan")
    logits[3, 1::3] = float("-inf")
    logits[4, :] = float("nan")                      # nothing to rank: still k distinct ids
    got = torch.ops.tokentop.top_candidates(logits, 32)
    assert got.shape == (5, 32) and got.dtype == torch.int64
    for r in (0, 2):
        assert torch.equal(got[r], logits[r].topk(32).indices)
    # ties: the k largest values, and among equal values the lowest ids first
    order = sorted(range(V), key=lambda i: (-float(logits[1, i]), i))[:32]
    assert got[1].tolist() == order
    ranked = logits[3].masked_fill(logits[3].isnan(), float("-inf"))
    torch.testing.assert_close(ranked[got[3]], ranked.topk(32).values, atol=0, rtol=0)
    for r in range(5):
        assert len(set(got[r].tolist())) == 32 and 0 <= int(got[r].min()) and int(got[r].max()) < V


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_top_candidates_rows_do_not_depend_on_the_batch(threads):
    kernels.load()
    logits = torch.randn(8, 151936, generator=_gen(11)) * 4
    logits[3] = logits[3].round()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = torch.ops.tokentop.top_candidates(logits, 32)
        alone = torch.cat([torch.ops.tokentop.top_candidates(logits[r:r + 1].contiguous(), 32) for r in range(8)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, alone)
    assert set(together[0].tolist()) == set(top_candidates(logits[:1], 32)[0].tolist())   # torch's form


@needs_kernels
@pytest.mark.parametrize("isa", ["native", "avx2", "scalar"])
def test_vector_builds_agree_and_read_unaligned_rows(isa, monkeypatch):
    """The activation products, greedy_pick and top_candidates run in 16-float vectors on
    AVX-512 and 8-float ones elsewhere (vec_math.h TT_BY_WIDTH; TOKENTOP_KERNEL_ISA caps the
    build). Each build matches torch, on rows 4 bytes past an aligned start: a vector type
    passed to a template loses its aligned(4), and a plain dereference then assumes (and on
    a misaligned row faults on) full vector alignment."""
    kernels.load()
    if isa != "native":
        monkeypatch.setenv("TOKENTOP_KERNEL_ISA", isa)

    def unaligned(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.numel() + 1)[1:].view(t.shape)
        return out.copy_(t)

    gu = unaligned(torch.randn(3, 2 * 53, generator=_gen(1)) * 4)
    assert gu.data_ptr() % 8 != 0
    for act in (0, 1):
        torch.testing.assert_close(FUSED.act_mul(gu, act), TORCH.act_mul(gu, act), **TOL)
    logits = unaligned(torch.randn(3, 5003, generator=_gen(2)) * 4)
    ids, lp, ok = torch.ops.tokentop.greedy_pick(logits)
    assert bool(ok.all()) and torch.equal(ids, logits.argmax(-1))
    want = torch.log_softmax(logits.double(), -1).gather(1, ids.view(-1, 1)).view(-1).float()
    torch.testing.assert_close(lp, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.ops.tokentop.top_candidates(logits, 32), logits.topk(32, dim=-1).indices)


@needs_kernels
@pytest.mark.parametrize("V", [151936, 1000, 65, 1])
def test_greedy_pick_matches_the_full_sampler(V, monkeypatch):
    from engine.worker import sampling
    from engine.config import SamplingParams

    kernels.load()
    g = _gen(V)
    logits = torch.randn(5, V, generator=g) * 4
    logits[1] = logits[1].round()                 # ties: the lowest id wins
    logits[2, : V // 2] = float("-inf")           # masked tokens
    logits[3, -1] = 50.0                          # the max in the last (partial) block
    asking = [sampling.RequestSampler(SamplingParams(max_tokens=1, temperature=0.0, return_logprobs=r == 3))
              for r in range(5)]
    silent = [sampling.RequestSampler(SamplingParams(max_tokens=1, temperature=0.0)) for _ in range(5)]
    fast, fast_silent = sampling._plain_greedy(logits, asking), sampling._plain_greedy(logits, silent)
    assert fast is not None and fast_silent is not None
    monkeypatch.setattr(sampling, "_plain_greedy", lambda *a: None)
    full = sampling.sample(logits, asking)
    assert torch.equal(fast.tokens, full.tokens) and torch.equal(fast_silent.tokens, full.tokens)
    assert torch.equal(fast.tokens, logits.argmax(-1))
    # one request in the step returns logprobs: every row gets its logprob; none does: none
    torch.testing.assert_close(fast.logprobs, full.logprobs, atol=1e-5, rtol=1e-5)
    assert bool(fast_silent.logprobs.isnan().all())


@needs_kernels
@pytest.mark.parametrize("first,second", [(1500, 5000), (1023, 1024), (1024, 151935), (0, 151935), (151934, 151935)])
def test_greedy_pick_finds_the_first_max_across_chunks(first, second):
    """greedy_pick scans a row in chunks of 1024 logits (the max of each chunk, then the first
    index of the row's max in the first chunk holding it): two equal maxima on either side of a
    chunk boundary, or in the partial last chunk, give the lower id, and the logprob is the
    full log-softmax's."""
    kernels.load()
    logits = torch.randn(1, 151936, generator=_gen(3)) * 4
    logits[0, first] = logits[0, second] = 60.0
    ids, lp, ok = torch.ops.tokentop.greedy_pick(logits)
    assert bool(ok[0]) and int(ids[0]) == first
    torch.testing.assert_close(lp[0], torch.log_softmax(logits[0].double(), -1)[first].float(), atol=1e-6, rtol=1e-6)
    logits[0, first] = 59.0                       # now the second one is the only max
    ids, lp, ok = torch.ops.tokentop.greedy_pick(logits)
    assert int(ids[0]) == second
    torch.testing.assert_close(lp[0], torch.log_softmax(logits[0].double(), -1)[second].float(), atol=1e-6, rtol=1e-6)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_pick_rows_do_not_depend_on_the_batch(threads):
    kernels.load()
    g = _gen(8)
    logits = torch.randn(8, 151936, generator=g) * 4
    logits[5, 100:200] = float("nan")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ids, lp, ok = torch.ops.tokentop.greedy_pick(logits)
        alone = [torch.ops.tokentop.greedy_pick(logits[r:r + 1].contiguous()) for r in range(8)]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(ids, torch.cat([a[0] for a in alone]))
    lp_alone = torch.cat([a[1] for a in alone])
    assert torch.equal(lp[ok], lp_alone[ok])   # the NaN row is flagged, its logprob not compared
    assert ok.tolist() == [r != 5 for r in range(8)] and ok.tolist() == torch.cat([a[2] for a in alone]).tolist()
    assert torch.equal(ids[ok], logits[ok].argmax(-1))
    # without the logprobs (no exp-sum) the same ids, and the NaN row still flagged
    ids_only, lp_none, ok_only = torch.ops.tokentop.greedy_pick(logits, False)
    assert torch.equal(ids_only, ids) and torch.equal(ok_only, ok) and bool(lp_none.isnan().all())


@needs_kernels
def test_greedy_pick_leaves_unusable_rows_and_other_requests_to_the_full_sampler():
    from engine.worker import sampling
    from engine.config import SamplingParams

    kernels.load()
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    logits = torch.randn(2, 300)
    logits[1, 7] = float("nan")
    samplers = [sampling.RequestSampler(greedy) for _ in range(2)]
    assert sampling._plain_greedy(logits, samplers) is None
    res = sampling.sample(logits, samplers)
    assert 1 in res.errors and "NaN" in str(res.errors[1]) and int(res.tokens[0]) == int(logits[0].argmax())
    logits[1, 7] = 0.0
    for other in (SamplingParams(max_tokens=1, temperature=0.7),
                  SamplingParams(max_tokens=1, temperature=0.0, logprobs=3),
                  SamplingParams(max_tokens=1, temperature=0.0, repetition_penalty=1.3)):
        assert sampling._plain_greedy(logits, [sampling.RequestSampler(greedy),
                                               sampling.RequestSampler(other)]) is None
