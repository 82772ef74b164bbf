"""The contract between the engine (scheduler/runner) and the decoder.

A forward step takes a *flat* batch: the new tokens of several sequences laid end to end,
each with its absolute position. K/V of every position lives in a slot of a per-layer
store; a sequence's slots come from its block table (paged) or are one range (contiguous).
One stream is simply a batch with one sequence.
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

KV_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
    pages: list[int] | None = None  # its block table (slots = page * page_size + offset), when
                                    # the KV manager gave one: a captured decode step reads it


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

    On the CPU all of it is one anonymous mapping: the kernel hands out its pages zeroed on
    first touch, so only the slots ever written are resident (--kv-cache-memory is a cap, not
    an up-front cost; as the prefix cache fills the pool over a long session, residency grows
    toward it). Never-written slots read as zeros, as torch.zeros would give (padded decode
    attention reads slot 0, masked).
    """

    def __init__(self, n_layers: int, num_slots: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (num_slots, n_kv_heads, head_dim)
        if torch.device(device).type == "cpu":
            k_and_v = _zeros_on_touch(2 * n_layers, shape, dtype)
            self.k, self.v = k_and_v[:n_layers], k_and_v[n_layers:]
        else:
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.num_slots = num_slots
        self.dtype = dtype

    @staticmethod
    def bytes_per_slot(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * n_layers * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _zeros_on_touch(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """`count` zero tensors of `shape` in one anonymous private mapping (resident only where
    written). The tensors keep the mapping alive; it is unmapped with the last of them."""
    per = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(1, count * per), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    return [flat[i * per:(i + 1) * per].view(dtype).view(shape) for i in range(count)]
