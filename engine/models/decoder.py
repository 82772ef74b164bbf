"""One decoder-only transformer for qwen2, qwen3, llama, gemma3 and phi3; the differences are
config switches (engine/models/gguf.py's ModelConfig).

Numerics: the residual stream, norms, rotary, attention and the KV store are fp32. Linear
layers get fp32 inputs and give fp32 outputs; each casts to what the kernel it picks for the
call wants (the GGUF kernel quantizes rows to int8 per 32 values itself; a dense copy: its
dtype), so a dense fp32 layer never rounds its activations to bf16 and back. A forward step takes a flat batch of several sequences
(engine/models/batch.py) and returns fp32 logits for the requested rows only: the lm_head is
a quarter of a decode step, wasted on prompt rows. The work between the linear layers (norms,
residual adds, rope and K/V writes, decode attention, the gated activation) is four C++ ops
per layer (engine/models/fused.py), or the same in plain torch where they are not built. A
step of decode rows only runs all layers in one C++ call (tokentop.DecodeLayers, the same ops
in the same order, so the same bits, without the Python between the layers).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import AttentionPlan, attend, plan_attention
from engine.models.batch import ForwardBatch, KVStore
from engine.models.fused import ACTIVATIONS, FUSED, FusedOps, TorchOps, ops_for
from engine.models.gguf import GGUFFile, ModelConfig
from engine.models.huge_pages import back_with_huge_pages
from engine.models.quant import LinearPolicy, dequantize, dequantize_rows, make_embedding, make_linear
from engine.models.rope import RotaryTable
from engine.trace import get_tracer

log = logging.getLogger("tokentop.decoder")

# DecodeLayers' clock readings per layer, in its order (engine/kernels/decode_layers.cpp Mark)
MARKS = ("layer", "qkv", "qkv end", "attention", "attention end", "o end", "attn end", "gate-up",
         "gate-up end", "down", "down end", "mlp end", "layer end")

# Candidates whose logits are recomputed in fp32 when the lm_head runs in bf16 (see _refine).
REFINED_CANDIDATES = 32

class Block(nn.Module):
    """Pre-norm attention + gated MLP, with the optional QK-norm (gemma3, qwen3) and post-norms
    (gemma3); phi3's fused attn_qkv and ffn_up are already the stacked layouts used here."""

    def __init__(self, gf: GGUFFile, i: int, policy: LinearPolicy):
        super().__init__()
        c = gf.config
        p = f"blk.{i}."

        def linear(*names: str, bias: bool = False) -> nn.Module:
            # several matrices with the same input become one call (q/k/v, gate/up)
            weights = [gf.tensor(p + n + ".weight") for n in names]
            biases = [gf.tensor(p + n + ".bias") for n in names] if bias else None
            return make_linear(weights, bias=biases, policy=policy)

        def norm(name: str) -> torch.Tensor:
            return dequantize(gf.tensor(p + name + ".weight")).to(policy.device)

        self.layer = i
        self.eps = c.norm_eps
        self.n_heads, self.n_kv, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.sliding = c.is_sliding(i)
        self.attn_softcap = c.attn_logit_softcap
        self.act = ACTIVATIONS.index(c.activation)
        self.attn_scale = c.attn_scale

        self.attn_norm = norm("attn_norm")
        qkv = ("attn_qkv",) if c.fused_qkv else ("attn_q", "attn_k", "attn_v")
        self.qkv_proj = linear(*qkv, bias=c.qkv_bias)
        self.o_proj = linear("attn_output")
        self.qkv_proj.op, self.o_proj.op = "attention-qkv", "attention-output"
        # gemma's QK-norm: one weight row per head of the fused [q heads | k heads] block
        self.qk_norm = (torch.cat([norm("attn_q_norm").expand(c.n_heads, -1),
                                   norm("attn_k_norm").expand(c.n_kv_heads, -1)])
                        if c.qk_norm else None)
        self.post_attn_norm = norm("post_attention_norm") if c.post_norms else None
        self.ffn_norm = norm("ffn_norm")
        self.gate_up_proj = linear("ffn_up") if c.fused_gate_up else linear("ffn_gate", "ffn_up")
        self.down_proj = linear("ffn_down")
        self.gate_up_proj.op, self.down_proj.op = "mlp-gate-up", "mlp-down"
        self.post_ffn_norm = norm("post_ffw_norm") if c.post_norms else None
        self._linears = None

    def linears(self) -> tuple:
        """qkv, o, gate|up and down as functions of 2-D x (QuantLinear.direct_call where it
        has one), bound on first use: after the start-up self-check has run the modules."""
        if self._linears is None:
            mods = (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)
            self._linears = tuple(m.direct_call() or m for m in mods)
        return self._linears

    def forward(self, x: torch.Tensor, kv: KVStore, write_slots: torch.Tensor, plan: AttentionPlan,
                rope: RotaryTable, cos: torch.Tensor, sin: torch.Tensor, ops: TorchOps | FusedOps) -> torch.Tensor:
        """x [T, hidden] (the residual stream, updated in place); cos/sin [T, head_dim] from
        rope.lookup. `ops` does the work between the linear layers (engine/models/fused.py)."""
        tracer = get_tracer()
        eps = self.eps
        # the linear layers as plain op calls, or as modules while tracing (their own scopes)
        qkv_proj, o_proj, gate_up_proj, down_proj = self.linears() if not tracer.active else (
            self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)
        with tracer.scope("attn"):
            qkv = qkv_proj(ops.add_rms_norm(x, None, self.attn_norm, eps))
            q = ops.rope_store_kv(qkv, cos, sin, self.qk_norm, eps, self.attn_scale, self.n_heads, self.n_kv,
                                  rope.interleaved, kv.k[self.layer], kv.v[self.layer], write_slots)
            with tracer.scope("attention"):
                a = attend(q, kv.k[self.layer], kv.v[self.layer], plan, self.attn_softcap)
            a = o_proj(a)
            if self.post_attn_norm is not None:
                a = ops.add_rms_norm(a, None, self.post_attn_norm, eps)
        with tracer.scope("mlp"):
            # x += a, then the MLP's norm, in one op
            m = down_proj(ops.act_mul(gate_up_proj(ops.add_rms_norm(x, a, self.ffn_norm, eps)), self.act))
            if self.post_ffn_norm is not None:
                m = ops.add_rms_norm(m, None, self.post_ffn_norm, eps)
        return x.add_(m)


class Decoder(nn.Module):
    def __init__(self, gf: GGUFFile, policy: LinearPolicy):
        super().__init__()
        c: ModelConfig = gf.config
        self.config = c
        self.policy = policy
        self.device = torch.device(policy.device)
        self.act_dtype = policy.activation_dtype
        self.ops = ops_for(policy.device, policy.use_kernels)   # C++ per-layer ops, or torch
        # the kernels stream the weights from the file mapping: in 2 MiB pages where Linux can
        self.weight_pages = "file mapping as is"
        if policy.use_kernels and not policy.on_cuda and gf.data is not None:
            self.weight_pages = back_with_huge_pages(gf.data, gf.path)
            log.info("model weights: %s", self.weight_pages)
        self.embed = make_embedding(gf.tensor("token_embd.weight"), device=policy.device)
        self.embed_scale = c.embed_scale
        self.blocks = nn.ModuleList(Block(gf, i, policy) for i in range(c.n_layers))
        self.final_norm = dequantize(gf.tensor("output_norm.weight")).to(self.device)
        self.head_td = gf.tensor("token_embd.weight" if c.tied_embeddings else "output.weight")
        self.lm_head = make_linear(self.head_td, bias=None, policy=policy)
        self.lm_head.op = "lm-head"
        # On CUDA the refined candidates' exact rows come from an fp32 copy on the device (for
        # tied embeddings: the embedding table, already one): gathering them on the host would
        # sync every step, and could not be captured in a CUDA graph.
        self.head_rows = None
        if policy.on_cuda and not self.lm_head.exact:
            table = self.embed.table
            self.head_rows = (table if c.tied_embeddings and table is not None and table.dtype == torch.float32
                              else dequantize(self.head_td).to(self.device))
        self.final_softcap = c.final_logit_softcap
        self._layers = None   # _decode_layers()
        self._spans = None    # _marked_spans()

        freq_factors = dequantize(gf.tensor("rope_freqs.weight")) if gf.has("rope_freqs.weight") else None
        capacity = min(c.context_length, 4096)
        self.rope_global = RotaryTable(c.head_dim, c.rope_base, interleaved=c.rope_interleaved,
                                       scaling=c.rope_scaling, freq_factors=freq_factors,
                                       capacity=capacity, device=self.device)
        sliding = [c.is_sliding(i) for i in range(c.n_layers)]
        self.has_sliding, self.has_global = any(sliding), not all(sliding)
        # gemma3's sliding layers use their own base and no scaling
        self.rope_local = self.rope_global
        if self.has_sliding and c.rope_local_base != c.rope_base:
            self.rope_local = RotaryTable(c.head_dim, c.rope_local_base, interleaved=c.rope_interleaved,
                                          capacity=capacity, device=self.device)

    @classmethod
    def from_gguf(cls, gf: GGUFFile, policy: LinearPolicy) -> "Decoder":
        return cls(gf, policy)

    def new_kv_store(self, num_slots: int, dtype: torch.dtype = torch.float32) -> KVStore:
        c = self.config
        return KVStore(c.n_layers, num_slots, c.n_kv_heads, c.head_dim, dtype=dtype, device=self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVStore) -> torch.Tensor:
        dev = self.device
        tracer = get_tracer()
        with tracer.scope("model", tokens=batch.num_tokens, seqs=len(batch.seqs)):
            ids = batch.token_ids.to(dev)
            positions = batch.positions.to(dev)
            write_slots = batch.write_slots.to(dev)
            batch_decodes = not self.policy.deterministic
            fused = self.ops is FUSED
            # index tensors and rope rows are made once per step and shared by every layer
            plans = {sliding: plan_attention(batch, self.config.sliding_window if sliding else None,
                                             batch_decodes=batch_decodes, device=dev, fused=fused)
                     for sliding in self.attention_kinds()}
            x = self.run_layers(ids, write_slots, plans, self.rope_rows(positions), kv)
            if batch.logits_rows.numel() == 0:   # a prefill chunk that samples nothing
                return torch.empty(0, self.config.vocab_size, device=dev)
            return self.logits(x.index_select(0, batch.logits_rows.to(dev)))

    def attention_kinds(self) -> list[bool]:
        """The kinds of attention layer the model has: False global, True sliding-window."""
        return [k for k, present in ((False, self.has_global), (True, self.has_sliding)) if present]

    def rope_rows(self, positions: torch.Tensor, *, checked: bool = True) -> dict:
        """Per attention kind: (table, cos, sin) rows of `positions` (RotaryTable.lookup)."""
        tables = {False: self.rope_global, True: self.rope_local}
        return {k: (tables[k], *tables[k].lookup(positions, checked=checked)) for k in self.attention_kinds()}

    def run_layers(self, ids: torch.Tensor, write_slots: torch.Tensor, plans: dict, ropes: dict,
                   kv: KVStore) -> torch.Tensor:
        """The residual stream [T, hidden] after every layer: embeddings of `ids`, each new
        token's K/V written to its slot. plans and ropes per attention kind (attention_kinds)."""
        tracer = get_tracer()
        fused = self.ops is FUSED
        x = self.embed(ids).float()
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        layers = self._decode_layers() if fused and not tracer.per_layer else None
        if layers is not None and all(_decode_only(p) for p in plans.values()):
            # every row a decode row: all layers in one C++ call (same ops, same bits); at full
            # trace detail it reads the clock around each part, recorded as the per-layer scopes
            plan_args = {k: [*ropes[k][1:], plans[k].decode.slots, plans[k].decode.lengths] for k in plans}
            marks = torch.empty(len(self.blocks), len(MARKS), dtype=torch.int64) if tracer.full else None
            x = layers.run(x, kv.k, kv.v, write_slots, plan_args.get(False, []), plan_args.get(True, []), marks)
            if marks is not None:
                tracer.deep_spans([(name, row[a], row[b] - row[a], args)
                                   for row, spans in zip(marks.tolist(), self._marked_spans())
                                   for name, a, b, args in spans])
            return x
        for block in self.blocks:
            with tracer.scope("layer", i=block.layer):
                # forward, not __call__: no hooks are used, and __call__'s dispatch costs per layer
                x = block.forward(x, kv, write_slots, plans[block.sliding], *ropes[block.sliding], self.ops)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits [R, vocab] of residual rows x [R, hidden]."""
        c = self.config
        h = self.ops.add_rms_norm(x, None, self.final_norm, c.norm_eps)
        logits = self.lm_head(h)
        if not self.lm_head.exact:
            logits = self._refine(logits, h)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _marked_spans(self) -> list[list[tuple[str, int, int, dict]]]:
        """Per layer, the spans DecodeLayers' clock readings make: (name, start mark, end
        mark, args), the scopes Block.forward records around the same ops."""
        if self._spans is None:
            m = MARKS.index
            self._spans = [[
                ("layer", m("layer"), m("layer end"), {"i": b.layer}),
                ("attn", m("layer"), m("attn end"), {}),
                ("qmatmul", m("qkv"), m("qkv end"), {"op": b.qkv_proj.op, "kernel": "gguf"}),
                ("attention", m("attention"), m("attention end"), {}),
                ("qmatmul", m("attention end"), m("o end"), {"op": b.o_proj.op, "kernel": "gguf"}),
                ("mlp", m("attn end"), m("mlp end"), {}),
                ("qmatmul", m("gate-up"), m("gate-up end"), {"op": b.gate_up_proj.op, "kernel": "gguf"}),
                ("qmatmul", m("down"), m("down end"), {"op": b.down_proj.op, "kernel": "gguf"}),
            ] for b in self.blocks]
        return self._spans

    def _decode_layers(self):
        """tokentop.DecodeLayers (engine/kernels/decode_layers.cpp) holding every layer, for
        decode steps; built on first use, after the start-up self-check (as Block.linears).
        None where a linear layer has a form besides the GGUF kernel's."""
        if self._layers is None:
            self._layers = False
            blocks = list(self.blocks)
            if all(m.direct_call() is not None for b in blocks for m in _block_linears(b)):
                b0, c = blocks[0], self.config
                layers = torch.classes.tokentop.DecodeLayers(b0.n_heads, b0.n_kv, b0.eps, b0.attn_scale,
                                                             b0.attn_softcap or 0.0, b0.act, self.rope_global.interleaved)
                for b in blocks:
                    layers.add_layer(b.attn_norm, b.ffn_norm, b.qk_norm, b.post_attn_norm, b.post_ffn_norm, b.sliding)
                    for m in _block_linears(b):
                        g = m.gguf
                        layers.add_linear(g.tensors, g.types, g.rows, m.bias, m.small_m)
                self._layers = layers
        return self._layers if self._layers is not False else None

    def _refine(self, logits: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Recompute the top candidates' logits exactly (fp32 hidden state, exact GGUF rows).

        A bf16 lm_head rounds its outputs to 8 significant bits: 0.06-0.125 apart at the usual
        top-logit sizes, which turns near-ties into exact ties and flips greedy choices the
        fp32 model would not; the GGUF kernel's int8 activations perturb logits by similar
        amounts. The few rows that can win cost well under a millisecond.
        """
        R, hidden = h.shape
        g = self.lm_head.gguf
        if self.ops is FUSED and g is not None and len(g.types) == 1:
            # the C++ ops: the candidates in one pass a row, each row dequantized as ggml does
            cand = torch.ops.tokentop.top_candidates(logits, REFINED_CANDIDATES)
            exact = torch.ops.tokentop.gguf_rows_dot(h.contiguous(), g.tensors[0], g.types[0], cand)
            return logits.scatter_(1, cand, exact)
        cand = top_candidates(logits, REFINED_CANDIDATES)
        if self.head_rows is not None:
            rows = self.head_rows.index_select(0, cand.reshape(-1))
        else:
            rows = dequantize_rows(self.head_td, cand.reshape(-1).cpu()).to(h.device)
        # multiply-and-sum rather than bmm: each row's result must not depend on R
        exact = (rows.view(R, REFINED_CANDIDATES, hidden) * h.unsqueeze(1)).sum(-1)
        return logits.scatter_(1, cand, exact)


def _block_linears(b: Block) -> tuple:
    return (b.qkv_proj, b.o_proj, b.gate_up_proj, b.down_proj)


def _decode_only(plan: AttentionPlan) -> bool:
    """Every row of the step is a decode row, in order, for the fused attention op."""
    d = plan.decode
    return not plan.singles and d is not None and d.rows is None and d.lengths is not None


def top_candidates(logits: torch.Tensor, k: int, chunk: int = 64) -> torch.Tensor:
    """Indices [R, k] of each row's k largest values, the set topk gives (up to ties), at a
    fraction of topk's cost over a 152k vocabulary.

    The k chunks with the largest maxima hold at least k values >= the k-th largest chunk
    maximum, so the k largest values all lie in those chunks: topk runs over k * chunk values.
    """
    R, V = logits.shape
    if V <= k * chunk:
        return logits.topk(k, dim=-1).indices
    pad = -V % chunk
    padded = F.pad(logits, (0, pad), value=float("-inf")) if pad else logits
    chunks = padded.view(R, -1, chunk)
    best = chunks.amax(dim=-1).topk(k, dim=-1).indices                    # [R, k] chunk numbers
    values = chunks.gather(1, best.unsqueeze(-1).expand(-1, -1, chunk))   # [R, k, chunk]
    top = values.view(R, -1).topk(k, dim=-1).indices
    return best.gather(1, top // chunk) * chunk + top % chunk
