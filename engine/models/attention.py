"""Attention over the paged KV store, planned once per step and run by every layer.

Keys and values stay where the KV store has them: a sequence's slots are gathered by index
(or read as a view in contiguous mode), never rebuilt page by page. All pure-decode
sequences of a step share one padded, masked, batched attention; a prefill chunk attends
per sequence (torch's fused CPU kernel) with a causal mask over its cached context plus its
new tokens. Sliding-window layers only read the keys inside the window. GQA is a grouped
reshape of the queries, or the fused kernel's own GQA (the profiler shows no repeat): K/V
are never repeated per query head. With the fused C++ ops (engine/models/fused.py) every
decode row of the step, in any mode, goes to one decode_attention call that reads each row's
own slots in place: no gather copy, no mask, no padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models.batch import ForwardBatch, SeqSlice
from engine.models.fused import FUSED

NEG_INF = float("-inf")


@dataclass
class SingleSeq:
    """One sequence attended on its own (a prefill chunk, or a decode in deterministic mode)."""

    rows: slice                      # its query rows in the flat batch
    slots: torch.Tensor | None       # key slots [Lk] to gather, or None when reading a view
    view_start: int                  # first slot of the view (contiguous mode)
    num_keys: int                    # Lk
    mask: torch.Tensor | None        # additive [n, Lk], None when every key is visible
    causal: bool = False             # keys are exactly the n queries' own positions: plain
                                     # causal attention (mask left None, built only if needed)


@dataclass
class DecodeGroup:
    """Every length-1 sequence of the step, attended in one padded batch."""

    rows: torch.Tensor | None        # their query rows, None when they are rows 0..B-1 in order
    slots: torch.Tensor              # [B, Lmax] key slots, padded with slot 0
    mask: torch.Tensor | None        # additive [B, 1, Lmax], None when nothing is padded
    lengths: torch.Tensor | None = None  # [B] keys of each row: set for the fused op, which
                                         # reads only those (no mask, no padding read)


@dataclass
class AttentionPlan:
    singles: list[SingleSeq]
    decode: DecodeGroup | None
    num_tokens: int


def _key_start(seq: SeqSlice, window: int | None) -> int:
    """First key position any of this chunk's queries can see."""
    if window is None:
        return 0
    first_query = seq.context_len - seq.length
    return max(0, first_query - window + 1)


def _chunk_mask(ctx: int, n: int, k0: int, window: int | None, device=None) -> torch.Tensor:
    """Additive [n, ctx - k0] mask: query i sits at position ctx - n + i, key j at k0 + j."""
    q_pos = torch.arange(ctx - n, ctx, device=device).unsqueeze(1)
    k_pos = torch.arange(k0, ctx, device=device).unsqueeze(0)
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    return torch.zeros(hidden.shape, device=device).masked_fill_(hidden, NEG_INF)


def _single(seq: SeqSlice, window: int | None) -> SingleSeq:
    k0 = _key_start(seq, window)
    num_keys = seq.context_len - k0
    n = seq.length
    # a fresh chunk (no cached context) that no window cuts is plain causal attention
    causal = n > 1 and num_keys == n and (window is None or n <= window)
    # a single query sees every key from k0 on: causal and window are both satisfied
    mask = _chunk_mask(seq.context_len, n, k0, window) if n > 1 and not causal else None
    if seq.contiguous_start is not None:
        return SingleSeq(slice(seq.start, seq.start + n), None, seq.contiguous_start + k0, num_keys, mask, causal)
    return SingleSeq(slice(seq.start, seq.start + n), seq.slots[k0:seq.context_len], 0, num_keys, mask, causal)


def _decode_group(seqs: list[SeqSlice], window: int | None, fused: bool = False) -> DecodeGroup:
    key_slots = [s.slots[_key_start(s, window):s.context_len] for s in seqs]
    lengths = [int(k.shape[0]) for k in key_slots]
    lmax = max(lengths)
    slots = (key_slots[0][None] if len(key_slots) == 1
             else torch.nn.utils.rnn.pad_sequence(key_slots, batch_first=True, padding_value=0))
    in_order = all(s.start == i for i, s in enumerate(seqs))
    rows = None if in_order else torch.tensor([s.start for s in seqs])
    if fused:
        return DecodeGroup(rows, slots, None, torch.tensor(lengths))
    mask = None
    if min(lengths) != lmax:
        padded = torch.arange(lmax).unsqueeze(0) >= torch.tensor(lengths).unsqueeze(1)
        mask = torch.zeros(padded.shape).masked_fill_(padded, NEG_INF)[:, None, :]
    return DecodeGroup(rows, slots, mask)


def _as_decodes(seq: SeqSlice) -> list[SeqSlice]:
    """A rowwise slice (speculative verify) becomes one decode per token, each seeing the
    keys up to its own position: the same kernel and numbers as decoding them one by one."""
    if not seq.rowwise or seq.length == 1:
        return [seq]
    first = seq.context_len - seq.length
    return [SeqSlice(seq.start + i, 1, first + i + 1, seq.slots, seq.contiguous_start)
            for i in range(seq.length)]


def plan_attention(batch: ForwardBatch, window: int | None, *, batch_decodes: bool = True,
                   device: torch.device | str = "cpu", fused: bool = False) -> AttentionPlan:
    """Index tensors and masks for one step; `window` is the sliding window (None = global).

    With batch_decodes=False (deterministic mode) every sequence is attended alone, so its
    result cannot depend on how long its batch-mates' contexts are. fused=True: every decode
    row goes to the fused C++ op (engine/models/fused.py), batched in any mode: it attends
    each row over its own keys alone, in an order that does not depend on the batch.
    """
    seqs = [r for s in batch.seqs for r in _as_decodes(s)]
    batch_decodes = batch_decodes or fused
    decodes = [s for s in seqs if s.length == 1] if batch_decodes else []
    singles = [_single(s, window) for s in seqs if not (batch_decodes and s.length == 1)]
    # One decode alone is cheaper on the single path (no padding, a view in contiguous mode).
    if len(decodes) == 1 and not fused:
        singles.append(_single(decodes[0], window))
        decodes = []
    group = _decode_group(decodes, window, fused) if decodes else None
    plan = AttentionPlan(singles, group, batch.num_tokens)
    return _to_device(plan, device) if torch.device(device).type != "cpu" else plan


def plan_decode_on_device(block_tables: torch.Tensor, context_lens: torch.Tensor, page_size: int,
                          num_keys: int, window: int | None, *, fused: bool = False) -> AttentionPlan:
    """The plan plan_attention makes for a step of B decode rows (rows 0..B-1 in order), as
    tensor ops on the tensors' own device: no host loop and no host read of a value, so a
    CUDA graph can capture it and a replay plans the step from whatever the buffers hold.

    block_tables [B, P] int64 (page ids), context_lens [B] int64 (keys after this step's
    token, >= 1). num_keys: the static width of the key slots, at least the longest row's
    visible keys. Row b sees positions k0_b .. ctx_b - 1 (k0 > 0 only under a sliding
    window), gathered to columns 0 .. ctx_b - k0_b - 1, the rest slot 0: the slots and mask
    plan_attention gives, padded further. fused=True gives lengths instead of a mask.
    """
    device = block_tables.device
    k0 = (context_lens - window).clamp(min=0) if window is not None else torch.zeros_like(context_lens)
    lengths = context_lens - k0
    column = torch.arange(num_keys, device=device)
    positions = k0.unsqueeze(1) + column                                  # [B, num_keys]
    visible = column < lengths.unsqueeze(1)
    pages = (positions // page_size).clamp(max=block_tables.shape[1] - 1)
    slots = block_tables.gather(1, pages) * page_size + positions % page_size
    slots = torch.where(visible, slots, 0)
    if fused:
        return AttentionPlan([], DecodeGroup(None, slots, None, lengths), int(block_tables.shape[0]))
    mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, NEG_INF)[:, None, :]
    return AttentionPlan([], DecodeGroup(None, slots, mask), int(block_tables.shape[0]))


def _to_device(plan: AttentionPlan, device) -> AttentionPlan:
    move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
    for s in plan.singles:
        s.slots, s.mask = move(s.slots), move(s.mask)
    if plan.decode is not None:
        d = plan.decode
        plan.decode = DecodeGroup(move(d.rows), move(d.slots), move(d.mask), move(d.lengths))
    return plan


def attend(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, plan: AttentionPlan,
           softcap: float | None = None) -> torch.Tensor:
    """q: [T, H, hd], already rotated and scaled. k/v_store: [slots, KV, hd]. Returns [T, H*hd]."""
    T, H, hd = q.shape
    only = len(plan.singles) + (plan.decode is not None) == 1
    out = None if only and (plan.decode is None or plan.decode.rows is None) else q.new_empty(T, H * hd)

    for s in plan.singles:
        o = _attend_single(q, k_store, v_store, s, softcap)
        if out is None:
            return o
        out[s.rows] = o

    d = plan.decode
    if d is not None:
        # Gather the B*L rows from the (contiguous) store, then run one bmm per KV head on
        # strided views: BLAS reads a head's keys in place (row stride KV*hd), so neither a
        # kv-head-major copy (slower than the strided reads) nor matmul's own reordering copy
        # is made. Never index a transposed view of the whole store:
        # torch would first copy all of it.
        B, L = d.slots.shape
        qd = q[:B] if d.rows is None else q.index_select(0, d.rows)
        if d.lengths is not None:
            o = FUSED.decode_attention(qd.contiguous(), k_store, v_store, d.slots, d.lengths, softcap)
        else:
            o = _decode_bmm(qd, k_store, v_store, d, softcap)
        if out is None:
            return o
        if d.rows is None:
            out[:B] = o
        else:
            out.index_copy_(0, d.rows, o)
    return out


def _attend_single(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, s,
                   softcap: float | None) -> torch.Tensor:
    """One sequence's rows (a prefill chunk, or a sequence attending alone): [n, H*hd]."""
    _, H, hd = q.shape
    KV = k_store.shape[1]
    G = H // KV
    if s.slots is None:
        k = k_store.narrow(0, s.view_start, s.num_keys)
        v = v_store.narrow(0, s.view_start, s.num_keys)
    else:
        k = k_store.index_select(0, s.slots)
        v = v_store.index_select(0, s.slots)
    k, v = k.to(q.dtype), v.to(q.dtype)  # no-op for the default fp32 store
    qs = q[s.rows]
    n = qs.shape[0]
    if n > 1 and softcap is None:
        # A chunk goes to torch's fused CPU attention, faster than bmm/softmax/bmm from a
        # few dozen queries on (equal at 16); single queries stay on the bmm path below,
        # faster for them. 4-D inputs: with 3-D ones torch falls back to its slow math path.
        o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=s.mask,
                                           is_causal=s.causal, scale=1.0, enable_gqa=True)
        return o[0].transpose(0, 1).reshape(n, H * hd)
    mask = _chunk_mask(s.num_keys, n, 0, None, q.device) if s.causal else s.mask
    # [n, KV*G, hd] -> [KV, G*n, hd]: each KV head serves its G query heads in one bmm
    qg = qs.view(n, KV, G, hd).permute(1, 2, 0, 3).reshape(KV, G * n, hd)
    scores = torch.bmm(qg, k.permute(1, 2, 0))                      # [KV, G*n, Lk]
    scores = _finish_scores(scores.view(KV, G, n, -1), mask, softcap)
    o = torch.bmm(scores.view(KV, G * n, -1), v.transpose(0, 1))   # [KV, G*n, hd]
    return o.view(KV, G, n, hd).permute(2, 0, 1, 3).reshape(n, H * hd)


def _decode_bmm(qd: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, d: DecodeGroup,
                softcap: float | None) -> torch.Tensor:
    B, L = d.slots.shape
    _, H, hd = qd.shape
    KV = k_store.shape[1]
    flat = d.slots.view(-1)
    k = k_store.index_select(0, flat).view(B, L, KV, hd).to(qd.dtype)
    v = v_store.index_select(0, flat).view(B, L, KV, hd).to(qd.dtype)
    qg = qd.reshape(B, KV, H // KV, hd)
    heads = []
    for h in range(KV):
        scores = _finish_scores(torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2)), d.mask, softcap)
        heads.append(torch.bmm(scores, v[:, :, h]))                   # [B, G, hd]
    return (heads[0] if KV == 1 else torch.stack(heads, dim=1)).reshape(B, H * hd)


def _finish_scores(scores: torch.Tensor, mask: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    return torch.softmax(scores, dim=-1)
