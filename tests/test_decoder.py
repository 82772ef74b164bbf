"""Decoder on tiny random GGUF models: against an independent naive implementation, and the
invariants of the flat-batch contract (batching, chunking, paging, sliding window)."""
from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.models.batch import ForwardBatch, KVStore, SeqSlice
from engine.models.decoder import Decoder
from engine.models.gguf import load_gguf
from engine.models.quant import LinearPolicy

# exact: dense fp32 weights and activations (no GGUF kernels, whose activations are int8)
FP32 = LinearPolicy(activation_dtype=torch.float32, use_kernels=False)
FP32_DET = LinearPolicy(activation_dtype=torch.float32, deterministic=True, use_kernels=False)
# the production path: GGUF kernels (bf16 only where a dense form remains)
BF16 = LinearPolicy(activation_dtype=torch.bfloat16)
BF16_DET = LinearPolicy(activation_dtype=torch.bfloat16, deterministic=True)


# ---- an independent, naive reference: gguf-py's reader and dequantizer, plain loops ----------

class NaiveModel:
    """Dense fp32, full causal attention recomputed from scratch for the whole sequence.

    Shares no code with the engine: tensors come from gguf.GGUFReader and gguf.quants, the
    architecture switches are spelled out here from the llama.cpp conventions.
    """

    def __init__(self, path: Path):
        r = gguf.GGUFReader(str(path))
        self.arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
        md = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.")}
        a = self.arch
        self.n_layers = md[f"{a}.block_count"]
        self.hidden = md[f"{a}.embedding_length"]
        self.n_heads = md[f"{a}.attention.head_count"]
        self.n_kv = md[f"{a}.attention.head_count_kv"]
        self.head_dim = md.get(f"{a}.attention.key_length", self.hidden // self.n_heads)
        self.eps = md[f"{a}.attention.layer_norm_rms_epsilon"]
        self.base = md[f"{a}.rope.freq_base"]
        self.window = md.get(f"{a}.attention.sliding_window")
        self.w = {}
        for t in r.tensors:
            shape = [int(x) for x in reversed(t.shape)]
            self.w[t.name] = torch.from_numpy(
                np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(shape)

    def sliding(self, layer: int) -> bool:
        return self.arch == "gemma3" and (layer + 1) % 6 != 0

    def rope(self, x: torch.Tensor, pos: int, base: float) -> torch.Tensor:
        """x: [heads, head_dim] at one position; llama 3's rope_freqs divide each frequency."""
        d = self.head_dim
        out = x.clone()
        factors = self.w.get("rope_freqs.weight", torch.ones(d // 2))
        for i in range(d // 2):
            theta = pos * base ** (-2.0 * i / d) / float(factors[i])
            c, s = math.cos(theta), math.sin(theta)
            a, b = (2 * i, 2 * i + 1) if self.arch == "llama" else (i, i + d // 2)
            out[:, a] = x[:, a] * c - x[:, b] * s
            out[:, b] = x[:, b] * c + x[:, a] * s
        return out

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab] logits at every position."""
        gemma = self.arch == "gemma3"
        n, H, KV, d = len(tokens), self.n_heads, self.n_kv, self.head_dim
        x = self.w["token_embd.weight"][tokens].clone()
        if gemma:
            x = x * math.sqrt(self.hidden)
        for i in range(self.n_layers):
            p = f"blk.{i}."
            h = self.norm(x, p + "attn_norm.weight")
            proj = {}
            if p + "attn_qkv.weight" in self.w:    # phi3: rows [q | k | v]
                fused = (h @ self.w[p + "attn_qkv.weight"].T).split([H * d, KV * d, KV * d], dim=-1)
                proj = {m: y.reshape(n, -1, d) for m, y in zip("qkv", fused)}
            for m in "qkv" if not proj else "":
                y = h @ self.w[p + f"attn_{m}.weight"].T
                if p + f"attn_{m}.bias" in self.w:
                    y = y + self.w[p + f"attn_{m}.bias"]
                proj[m] = y.view(n, -1, d)
            q, k, v = proj["q"], proj["k"], proj["v"]
            if p + "attn_q_norm.weight" in self.w:   # gemma3, qwen3
                q = self.norm(q, p + "attn_q_norm.weight")
                k = self.norm(k, p + "attn_k_norm.weight")
            base = 10000.0 if gemma and self.sliding(i) else self.base
            q = torch.stack([self.rope(q[t], t, base) for t in range(n)])
            k = torch.stack([self.rope(k[t], t, base) for t in range(n)])
            att = torch.zeros(n, H, d)
            for t in range(n):
                for hh in range(H):
                    kh = hh // (H // KV)
                    lo = max(0, t - self.window + 1) if self.sliding(i) else 0
                    scores = (k[lo:t + 1, kh] @ q[t, hh]) / math.sqrt(d)
                    att[t, hh] = torch.softmax(scores, 0) @ v[lo:t + 1, kh]
            a = att.reshape(n, H * d) @ self.w[p + "attn_output.weight"].T
            if gemma:
                a = self.norm(a, p + "post_attention_norm.weight")
            x = x + a
            h = self.norm(x, p + "ffn_norm.weight")
            if p + "ffn_gate.weight" in self.w:
                g, u = h @ self.w[p + "ffn_gate.weight"].T, h @ self.w[p + "ffn_up.weight"].T
            else:                                     # phi3: rows [gate | up]
                g, u = (h @ self.w[p + "ffn_up.weight"].T).chunk(2, dim=-1)
            g = torch.nn.functional.gelu(g, approximate="tanh") if gemma else torch.nn.functional.silu(g)
            m = (g * u) @ self.w[p + "ffn_down.weight"].T
            if gemma:
                m = self.norm(m, p + "post_ffw_norm.weight")
            x = x + m
        x = self.norm(x, "output_norm.weight")
        head = self.w.get("output.weight", self.w["token_embd.weight"])
        return x @ head.T


# ---- helpers: drive the decoder like the engine does -----------------------------------------

def step(model: Decoder, kv: KVStore, seqs: list[tuple[list[int], int, torch.Tensor]],
         contiguous: bool = False) -> torch.Tensor:
    """One forward over several sequences. Each is (all its tokens so far, how many are new,
    its slots for every position); returns the logits of each sequence's last token."""
    ids, pos, write, slices, rows = [], [], [], [], []
    for tokens, n_new, slots in seqs:
        ctx = len(tokens)
        start = len(ids)
        ids += tokens[ctx - n_new:]
        pos += range(ctx - n_new, ctx)
        write.append(slots[ctx - n_new:ctx])
        cs = int(slots[0]) if contiguous else None
        slices.append(SeqSlice(start, n_new, ctx, slots[:ctx], cs))
        rows.append(start + n_new - 1)
    batch = ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.cat(write), slices, torch.tensor(rows))
    return model(batch, kv)


def prefill_all_rows(model: Decoder, kv: KVStore, tokens: list[int], slots: torch.Tensor) -> torch.Tensor:
    n = len(tokens)
    batch = ForwardBatch(torch.tensor(tokens), torch.arange(n), slots[:n],
                         [SeqSlice(0, n, n, slots[:n])], torch.arange(n))
    return model(batch, kv)


def tokens_for(n: int, seed: int = 0, vocab: int = 250) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory) -> Path:
    from tests.fixtures.tiny_gguf import write_tiny_model
    return write_tiny_model(tmp_path_factory.mktemp("dec") / "qwen.gguf", "qwen2", n_layers=2)


# ---- against the naive reference -------------------------------------------------------------

ARCH_CASES = {   # write_tiny_model's arguments
    "qwen2": dict(arch="qwen2", n_layers=2),
    "llama": dict(arch="llama", n_layers=2),
    # Llama 3.2: frequency factors in rope_freqs.weight (original context short enough that
    # the factors differ across the head), lm_head tied to the embeddings
    "llama3": dict(arch="llama", n_layers=2, tied=True,
                   llama3_rope=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_context_length=64)),
    # six layers: five sliding (window 4) and one global, as gemma3's 5:1 pattern
    "gemma3": dict(arch="gemma3", n_layers=6, n_heads=4, n_kv_heads=1, head_dim=32, sliding_window=4),
    # QK-norm without qkv biases, heads wider than hidden / n_heads (as Qwen3-0.6B's)
    "qwen3": dict(arch="qwen3", n_layers=2, head_dim=32),
    # fused attn_qkv and ffn_up; a window in the metadata that llama.cpp (and so tokentop) ignores
    "phi3": dict(arch="phi3", n_layers=2, n_kv_heads=4, sliding_window=4),
}


@pytest.mark.parametrize("ops", ["torch", "fused"])
@pytest.mark.parametrize("arch", list(ARCH_CASES))
def test_matches_naive_reference(tiny_model_path, arch, ops):
    """Dense fp32 linears, with the per-layer work in torch or in the fused C++ ops."""
    from engine import kernels
    from engine.models.fused import FUSED

    if ops == "fused" and not kernels.available():
        pytest.skip("kernel library could not be built")
    path = tiny_model_path(**ARCH_CASES[arch])
    naive = NaiveModel(path).logits(tokens := tokens_for(12, seed=1))
    model = Decoder.from_gguf(load_gguf(path), FP32)
    if ops == "fused":
        model.ops = FUSED
    kv = model.new_kv_store(64)
    slots = torch.arange(64)

    # a prefill of every row at once, then the same positions decoded one by one (past the window)
    full = prefill_all_rows(model, kv, tokens, slots)
    torch.testing.assert_close(full, naive, atol=2e-4, rtol=1e-4)

    kv = model.new_kv_store(64)
    step(model, kv, [(tokens[:5], 5, slots)])
    for t in range(6, len(tokens) + 1):
        got = step(model, kv, [(tokens[:t], 1, slots)])[0]
        torch.testing.assert_close(got, naive[t - 1], atol=2e-4, rtol=1e-4)


def test_naive_reference_is_sensitive_to_arch_switches(tiny_model_path):
    """Guard against the two implementations agreeing by sharing a mistake: the llama rope
    pairing differs from NeoX's, so running llama weights through a NeoX decoder must differ."""
    path = tiny_model_path(**ARCH_CASES["llama"])
    naive = NaiveModel(path)
    tokens = tokens_for(8, seed=2)
    want = naive.logits(tokens)
    naive.arch = "qwen2"                       # same weights, NeoX pairing
    assert (naive.logits(tokens) - want).abs().max() > 1e-3


# ---- the flat-batch contract -----------------------------------------------------------------

def _three_sequences():
    """A: prefill chunk of 5 on top of 3 cached; B and C: decodes with different context lengths."""
    a, b, c = tokens_for(8, seed=3), tokens_for(11, seed=4), tokens_for(4, seed=5)
    slots = torch.randperm(96, generator=torch.Generator().manual_seed(0))
    return (a, 5, slots[0:32]), (b, 1, slots[32:64]), (c, 1, slots[64:96])


def _prime(model: Decoder, kv: KVStore, seq) -> None:
    """Compute the cached part of a sequence (everything before its new tokens)."""
    tokens, n_new, slots = seq
    if len(tokens) > n_new:
        step(model, kv, [(tokens[:len(tokens) - n_new], len(tokens) - n_new, slots)])


@pytest.mark.parametrize("order", [(1, 0, 2), (1, 2, 0), (0, 1, 2)],
                         ids=["decodes-around-prefill", "decodes-first", "prefill-first"])
@pytest.mark.parametrize("policy", [FP32, BF16, FP32_DET, BF16_DET],
                         ids=["fp32", "bf16", "fp32-deterministic", "bf16-deterministic"])
def test_flat_batch_equals_each_sequence_alone(tiny_qwen, policy, order):
    model = Decoder.from_gguf(load_gguf(tiny_qwen), policy)
    seqs = [_three_sequences()[i] for i in order]
    kv = model.new_kv_store(96)
    for s in seqs:
        _prime(model, kv, s)
    together = step(model, kv, seqs)
    alone = torch.stack([step(model, kv, [s])[0] for s in seqs])
    if policy.deterministic:
        assert torch.equal(together, alone)
    else:
        tol = 1e-5 if policy.activation_dtype == torch.float32 else 5e-2
        torch.testing.assert_close(together, alone, atol=tol, rtol=tol)


def test_batched_decodes_equal_alone(tiny_qwen):
    """Several decodes of different lengths share one padded attention; padding must be masked."""
    model = Decoder.from_gguf(load_gguf(tiny_qwen), FP32)
    kv = model.new_kv_store(128)
    seqs = [(tokens_for(n, seed=n), 1, torch.arange(32 * i, 32 * i + 32)) for i, n in enumerate((3, 17, 9, 30))]
    for s in seqs:
        _prime(model, kv, s)
    together = step(model, kv, seqs)
    alone = torch.stack([step(model, kv, [s])[0] for s in seqs])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_chunked_prefill_equals_one_shot(tiny_model_path, arch):
    path = tiny_model_path(**ARCH_CASES[arch])
    model = Decoder.from_gguf(load_gguf(path), FP32)
    tokens = tokens_for(23, seed=6)
    slots = torch.arange(32)
    one_shot = step(model, model_kv := model.new_kv_store(32), [(tokens, len(tokens), slots)])
    kv = model.new_kv_store(32)
    for start in range(0, len(tokens), 7):
        end = min(start + 7, len(tokens))
        chunked = step(model, kv, [(tokens[:end], end - start, slots)])
    torch.testing.assert_close(chunked, one_shot, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv.k[0][:23], model_kv.k[0][:23], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", [FP32, BF16], ids=["fp32", "bf16"])
def test_paged_equals_contiguous_exactly(tiny_qwen, policy):
    model = Decoder.from_gguf(load_gguf(tiny_qwen), policy)
    tokens = tokens_for(20, seed=7)
    shuffled = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:32]
    outs = []
    for slots, contiguous in ((shuffled, False), (torch.arange(16, 48), True)):
        kv = model.new_kv_store(64)
        got = [step(model, kv, [(tokens[:12], 12, slots)], contiguous)]
        got += [step(model, kv, [(tokens[:t], 1, slots)], contiguous) for t in range(13, 21)]
        outs.append(torch.cat(got))
    assert torch.equal(outs[0], outs[1])


def test_sliding_window_hides_old_tokens(tiny_model_path):
    """One sliding layer, window 4: the last token sees itself and the 3 before it, nothing older."""
    path = tiny_model_path("gemma3", n_layers=1, n_heads=2, n_kv_heads=1, head_dim=32, sliding_window=4)
    model = Decoder.from_gguf(load_gguf(path), FP32)
    assert model.config.is_sliding(0)
    tokens = tokens_for(10, seed=8)
    slots = torch.arange(16)

    def last_logits(toks: list[int], chunk: int) -> torch.Tensor:
        kv = model.new_kv_store(16)
        step(model, kv, [(toks[:-chunk], len(toks) - chunk, slots)])
        return step(model, kv, [(toks, chunk, slots)])[0]

    for chunk in (1, 3):      # the decode path and the prefill path
        base = last_logits(tokens, chunk)
        outside = tokens.copy()
        outside[-5] = (outside[-5] + 1) % 250          # 4 positions before the last: outside
        assert torch.equal(last_logits(outside, chunk), base)
        inside = tokens.copy()
        inside[-4] = (inside[-4] + 1) % 250            # 3 positions before: inside
        assert not torch.allclose(last_logits(inside, chunk), base)


def test_global_layer_sees_past_the_window(tiny_model_path):
    """With gemma3's 6th layer global, an old token does reach the last position."""
    path = tiny_model_path(**ARCH_CASES["gemma3"])
    model = Decoder.from_gguf(load_gguf(path), FP32)
    assert not model.config.is_sliding(5)
    tokens = tokens_for(16, seed=9)
    changed = tokens.copy()
    changed[0] = (changed[0] + 1) % 250
    slots = torch.arange(16)
    a = step(model, model.new_kv_store(16), [(tokens, 16, slots)])
    b = step(model, model.new_kv_store(16), [(changed, 16, slots)])
    assert not torch.allclose(a, b)


def test_logits_only_for_requested_rows(tiny_qwen):
    model = Decoder.from_gguf(load_gguf(tiny_qwen), FP32)
    tokens = tokens_for(6, seed=10)
    kv = model.new_kv_store(8)
    batch = ForwardBatch(torch.tensor(tokens), torch.arange(6), torch.arange(6),
                         [SeqSlice(0, 6, 6, torch.arange(6))], torch.tensor([2, 5]))
    out = model(batch, kv)
    assert out.shape == (2, model.config.vocab_size) and out.dtype == torch.float32
    every = prefill_all_rows(model, model.new_kv_store(8), tokens, torch.arange(8))
    torch.testing.assert_close(out, every[[2, 5]], atol=1e-5, rtol=1e-5)


def test_kv_store_geometry(tiny_qwen):
    model = Decoder.from_gguf(load_gguf(tiny_qwen), FP32)
    kv = model.new_kv_store(40)
    c = model.config
    assert len(kv.k) == c.n_layers and kv.k[0].shape == (40, c.n_kv_heads, c.head_dim)
    assert kv.k[0].dtype == torch.float32


def _rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssAnon from /proc (Linux)")
def test_cpu_kv_store_is_resident_only_where_written():
    """--kv-cache-memory is a cap: a CPU store's untouched slots cost no resident memory, read
    as zeros, and each layer's K and V are separate memory."""
    layers, slots, heads, hd = 24, 65536, 2, 64          # 24 x 2 x 16 MiB = 768 MiB of fp32 K/V
    before = _rss_anon_mib()
    kv = KVStore(layers, slots, heads, hd, dtype=torch.float32)
    assert _rss_anon_mib() - before < 16
    assert len(kv.k) == len(kv.v) == layers and kv.k[3].shape == (slots, heads, hd)
    assert float(kv.v[layers - 1][-1].abs().sum()) == 0.0 and float(kv.k[0][:64].abs().sum()) == 0.0
    for t in kv.k[:4] + kv.v[:4]:                         # 8 x 4096 slots x 512 B = 16 MiB
        t[:4096] = 1.0
    grown = _rss_anon_mib() - before
    assert 14 < grown < 40, grown
    assert float(kv.k[4][:4096].abs().sum()) == 0.0 and float(kv.k[0][4096:8192].abs().sum()) == 0.0
    assert float(kv.v[0][:4096].sum()) == 4096 * heads * hd


@pytest.mark.parametrize("kv_dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)], ids=["fp16", "bf16"])
def test_half_precision_kv_store_follows_fp32(tiny_qwen, kv_dtype, tol):
    """K and V rounded to 16 bits when stored, read back as fp32: prefill then decodes stay
    close to the fp32 store's logits, and in deterministic mode a step's rows are still
    exactly the same batched or alone."""
    model = Decoder.from_gguf(load_gguf(tiny_qwen), FP32)
    tokens = tokens_for(20, seed=11)
    slots = torch.arange(32)
    outs = {}
    for dtype in (torch.float32, kv_dtype):
        kv = model.new_kv_store(32, dtype=dtype)
        assert kv.k[0].dtype == dtype
        got = [step(model, kv, [(tokens[:12], 12, slots)])]
        got += [step(model, kv, [(tokens[:t], 1, slots)]) for t in range(13, 21)]
        outs[dtype] = torch.cat(got)
    assert not torch.equal(outs[kv_dtype], outs[torch.float32])      # the store really rounds
    scale = outs[torch.float32].abs().max()
    assert (outs[kv_dtype] - outs[torch.float32]).abs().max() <= tol * scale

    det = Decoder.from_gguf(load_gguf(tiny_qwen), BF16_DET)
    kv = det.new_kv_store(96, dtype=kv_dtype)
    seqs = _three_sequences()
    for s in seqs:
        _prime(det, kv, s)
    assert torch.equal(step(det, kv, list(seqs)), torch.stack([step(det, kv, [s])[0] for s in seqs]))


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("cached,new", [(0, 9), (6, 9), (20, 4)])
def test_fused_and_explicit_attention_paths_agree(window, cached, new):
    """Chunks take torch's fused attention; the explicit bmm/softmax path serves single queries
    and logit soft-capping. A cap far above the scores leaves them unchanged, which forces the
    explicit path on the same masks: both must agree."""
    from engine.models.attention import attend, plan_attention

    g = torch.Generator().manual_seed(cached + new)
    k_store, v_store = torch.randn(64, 2, 8, generator=g), torch.randn(64, 2, 8, generator=g)
    q = torch.randn(new, 6, 8, generator=g)
    ctx = cached + new
    slots = torch.randperm(64, generator=g)[:ctx]
    batch = ForwardBatch(torch.zeros(new, dtype=torch.long), torch.arange(cached, ctx), slots[cached:],
                         [SeqSlice(0, new, ctx, slots)], torch.tensor([new - 1]))
    plan = plan_attention(batch, window)
    torch.testing.assert_close(attend(q, k_store, v_store, plan),
                               attend(q, k_store, v_store, plan, softcap=1e6), atol=1e-5, rtol=1e-5)


def test_rope_linear_scaling_and_frequency_factors():
    from engine.models.rope import RotaryTable

    plain = RotaryTable(16, 10000.0, capacity=8)
    linear = RotaryTable(16, 10000.0, scaling={"type": "linear", "factor": 2.0}, capacity=8)
    # linear scaling: position 2p turns like position p did (the table grows on demand)
    torch.testing.assert_close(linear.lookup(torch.tensor([6, 40]))[0], plain.lookup(torch.tensor([3, 20]))[0])
    # llama3-style factors divide each frequency; a factor of 2 everywhere is linear scaling again
    factors = RotaryTable(16, 10000.0, freq_factors=torch.full((8,), 2.0), capacity=8)
    torch.testing.assert_close(factors.lookup(torch.tensor([6]))[1], plain.lookup(torch.tensor([3]))[1])


def test_unsupported_rope_scaling_is_refused_clearly():
    from engine.errors import ModelError
    from engine.models.rope import RotaryTable

    with pytest.raises(ModelError, match="yarn"):
        RotaryTable(16, 10000.0, scaling={"type": "yarn", "factor": 4.0})


def test_batched_decode_attention_reads_only_its_rows():
    """Attention must not copy the whole KV store (indexing a transposed view of it would, every
    layer): what a decode step allocates depends on its contexts, not the store size."""
    from torch.profiler import ProfilerActivity, profile

    from engine.models.attention import attend, plan_attention

    store = torch.zeros(200_000, 2, 8)                 # 12.8 MB per tensor
    seqs = [SeqSlice(0, 1, 10, torch.arange(10)), SeqSlice(1, 1, 7, torch.arange(100, 107))]
    batch = ForwardBatch(torch.zeros(2, dtype=torch.long), torch.tensor([9, 6]), torch.tensor([9, 106]),
                         seqs, torch.arange(2))
    plan = plan_attention(batch, None)
    assert plan.decode is not None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        attend(torch.randn(2, 6, 8), store, store, plan)
    allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    assert allocated < 1_000_000, f"decode attention allocated {allocated:,} bytes"


@pytest.mark.parametrize("policy", [BF16, BF16_DET], ids=["default", "deterministic"])
@pytest.mark.parametrize("arch", list(ARCH_CASES))
def test_decode_steps_in_one_call_equal_the_per_layer_path(tiny_model_path, arch, policy):
    """A step of decode rows only runs every layer in one C++ call (tokentop.DecodeLayers):
    the same ops as Block.forward, so the logits and the K/V written are bit for bit the same.
    Contexts run past gemma's window (4), so its sliding layers read their own plan."""
    from engine import kernels

    if not kernels.available():
        pytest.skip("kernel library could not be built")
    # the kernel's block types only: a float tensor gets a dense form, which keeps the per-layer path
    T = gguf.GGMLQuantizationType
    kinds = {"attn_q": T.Q8_0, "attn_k": T.Q4_0, "attn_v": T.Q5_0, "attn_qkv": T.Q8_0, "attn_output": T.Q4_0,
             "ffn_gate": T.Q5_0, "ffn_up": T.Q8_0, "ffn_down": T.Q4_0}
    path = tiny_model_path(**ARCH_CASES[arch], types=kinds)
    seqs = [(tokens_for(n, seed=n), torch.arange(32 * i, 32 * i + 32)) for i, n in enumerate((3, 9, 6))]

    def decode(one_call: bool, rows: int):
        model = Decoder.from_gguf(load_gguf(path), policy)
        if not one_call:
            model._layers = False          # what _decode_layers() caches when it cannot serve
        kv = model.new_kv_store(128)
        out = []
        for tokens, slots in seqs[:rows]:
            step(model, kv, [(tokens, len(tokens), slots)])
        for extra in range(8):
            grown = [(tokens + tokens_for(extra + 1, seed=99)[: extra + 1], 1, slots) for tokens, slots in seqs[:rows]]
            out.append(step(model, kv, grown))
        return model, torch.cat(out), kv

    for rows in (1, 3):
        fast, got, kv_fast = decode(True, rows)
        assert fast._decode_layers() is not None, "the one-call path was not taken"
        _, want, kv_ref = decode(False, rows)
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(kv_fast.k + kv_fast.v, kv_ref.k + kv_ref.v))


def test_full_trace_detail_keeps_the_one_call_path_and_records_its_layers(tiny_model_path):
    """At full trace detail a decode step still runs every layer in one C++ call (the same bits
    as untraced), and the clock readings it takes become the per-layer scopes: per layer one
    `layer` holding attn (qkv, attention, output) and mlp (gate-up, down), nested, in order."""
    from engine import kernels, trace
    from tests.trace_checks import check_nesting

    if not kernels.available():
        pytest.skip("kernel library could not be built")
    T = gguf.GGMLQuantizationType
    kinds = {"attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q8_0, "attn_output": T.Q4_0,
             "ffn_gate": T.Q4_0, "ffn_up": T.Q4_0, "ffn_down": T.Q4_0}
    path = tiny_model_path("qwen2", n_layers=3, types=kinds)
    tokens, slots = tokens_for(6, seed=3), torch.arange(32)

    class Counted:    # counts the one-call runs
        def __init__(self, layers):
            self.layers, self.calls = layers, 0

        def run(self, *args):
            self.calls += 1
            return self.layers.run(*args)

    def decode(detail: str):
        model = Decoder.from_gguf(load_gguf(path), BF16)
        kv = model.new_kv_store(64)
        step(model, kv, [(tokens, len(tokens), slots)])            # prefill: the per-layer path
        model._layers = counted = Counted(model._decode_layers())
        tracer = trace.Tracer("test", detail=detail, window_s=None)
        previous = trace.set_tracer(tracer)
        try:
            out = [step(model, kv, [(tokens + [7] * (n + 1), 1, slots)]) for n in range(3)]
        finally:
            trace.set_tracer(previous)
        return torch.cat(out), counted.calls, tracer.ring()

    want, calls_off, _ = decode("off")
    got, calls_full, events = decode("full")
    assert calls_off == calls_full == 3                    # full detail kept the one-call path
    assert torch.equal(got, want)
    spans = [e for e in events if e["ph"] == "X"]
    assert not check_nesting(events)
    layers = sorted((e for e in spans if e["name"] == "layer"), key=lambda e: e["ts"])
    assert [e["args"]["i"] for e in layers] == [0, 1, 2] * 3
    models = [e for e in spans if e["name"] == "model"]
    assert len(models) == 3
    for layer in layers:
        inside = [e for e in spans if layer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= layer["ts"] + layer["dur"]
                  and e is not layer]
        inside.sort(key=lambda e: (e["ts"], -e["dur"]))
        assert [(e["name"], e.get("args", {}).get("op")) for e in inside] == [
            ("attn", None), ("qmatmul", "attention-qkv"), ("attention", None), ("qmatmul", "attention-output"),
            ("mlp", None), ("qmatmul", "mlp-gate-up"), ("qmatmul", "mlp-down")]
        assert all(e["dur"] > 0 for e in inside if e["name"] == "qmatmul")
        # each layer lies inside its step's model scope
        assert any(m["ts"] <= layer["ts"] and layer["ts"] + layer["dur"] <= m["ts"] + m["dur"] for m in models)


def test_decode_layers_are_not_used_with_dense_forms(tiny_qwen):
    """Dense fp32 linears (no GGUF kernel) keep the per-layer path."""
    model = Decoder.from_gguf(load_gguf(tiny_qwen), FP32)
    assert model._decode_layers() is None
