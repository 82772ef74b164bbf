"""The contract between the engine (scheduler/runner) and the decoder.

A forward step takes a *flat* batch: the new tokens of several sequences laid end to end,
each with its absolute position. K/V of every position lives in a slot of a per-layer
store; a sequence's slots come from its block table (paged) or are one range (contiguous).
One stream is simply a batch with one sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SeqSlice:
    """One sequence's part of a flat batch."""

    start: int                 # first row of this sequence in the flat batch
    length: int                # new tokens of this sequence in this step (1 = decode)
    context_len: int           # tokens whose K/V exist after this step (cached + new)
    slots: torch.Tensor        # int64 [context_len]: KV slot of positions 0..context_len-1
    contiguous_start: int | None = None  # set when slots == range(start, start+context_len):
                                         # attention may read a view instead of gathering
    rowwise: bool = False      # speculative verify: attend each new token exactly as a decode
                               # of it would be (greedy speculation == greedy without it)


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor    # int64 [T]
    positions: torch.Tensor    # int64 [T] absolute position of each token in its sequence
    write_slots: torch.Tensor  # int64 [T] KV slot each new token's K/V is written to
    seqs: list[SeqSlice]
    logits_rows: torch.Tensor  # int64 [R] rows of the flat batch whose logits are wanted

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


class KVStore:
    """Per-layer K and V tensors of shape [num_slots, n_kv_heads, head_dim].

    num_slots = num_pages * page_size. The store owns the memory; which slot belongs to
    which sequence is the KV manager's business (engine/kv/pages.py).
    """

    def __init__(self, n_layers: int, num_slots: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (num_slots, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.num_slots = num_slots
        self.dtype = dtype

    @staticmethod
    def bytes_per_slot(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * n_layers * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
