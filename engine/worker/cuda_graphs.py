"""Decode steps as captured CUDA graphs: one launch replays a whole step of the model.

A decode step of a small model on a GPU is launch-bound: hundreds of small kernels whose
launches take several times their GPU time. A CUDA graph records them once and replays them
with one launch; a replay must see the same shapes and the same addresses, so the step reads
static buffers:

- batch buckets 1, 2, 4, 8, 16, 32: a step of B sequences runs the graph of the smallest
  bucket >= B; the padded rows decode token 0 at position 0 with their K/V written to (and
  read from) a scratch slot past the page pool, and their logits are ignored.
- key buckets 256, 512, ... up to the worker's context: the attention gathers a static
  number of key slots per row (the masked rest costs gather and bandwidth, hence buckets).
  Graphs whose B x keys would gather more than MAX_GRAPH_KEYS key rows are not captured.
- the buffers: token ids, positions, context lengths, write slots and block tables in one
  int64 tensor [4 + pages, 32], filled on the host (pinned) and copied with one transfer;
  the attention plan is built inside the graph from them (plan_decode_on_device), and so
  are the rope rows, the logits and the greedy pick (sampling.greedy_pick).

Prefill and mixed steps, speculative verifies, more than 32 sequences or a context beyond the
captured buckets run eagerly (`eager_steps` counts why). The graph API is one small class, so
tests can drive this module's bookkeeping on the CPU with a stand-in for it.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch

from engine.config import format_size
from engine.models.attention import plan_decode_on_device
from engine.models.batch import ForwardBatch, KVStore
from engine.models.fused import FUSED
from engine.trace import get_tracer, set_tracer
from engine.worker.sampling import greedy_pick

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
MIN_KEY_BUCKET = 256
# At most this many key rows gathered per layer by one graph (B x keys): 32 sequences of 4096
# keys. Past it a graph's gather buffers grow large for a step that long contexts make
# bandwidth-bound anyway, so those steps run eagerly.
MAX_GRAPH_KEYS = 32 * 4096
_TOKEN, _POSITION, _CONTEXT, _WRITE, _PAGES = 0, 1, 2, 3, 4   # rows of the input buffer


def batch_bucket(n: int) -> int | None:
    """The smallest batch bucket holding n sequences; None past the largest."""
    return next((b for b in BATCH_BUCKETS if b >= n), None)


def key_buckets(max_context: int) -> tuple[int, ...]:
    """256, 512, ... doubling, the last one max_context itself."""
    buckets, k = [], MIN_KEY_BUCKET
    while k < max_context:
        buckets.append(k)
        k *= 2
    return (*buckets, max_context)


def key_bucket(buckets: tuple[int, ...], keys: int) -> int | None:
    return next((k for k in buckets if k >= keys), None)


class TorchCudaGraphs:
    """torch.cuda's graph calls, as the captured step uses them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()   # every graph of the worker shares it

    def capture(self, fn):
        """Run fn once (warm-up: lazy initialisation, cuBLAS workspaces) on a side stream, then
        record it into a graph; returns the graph (its replay() re-runs what fn launched)."""
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a second worker thread of this process may launch work meanwhile
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                fn()
            torch.cuda.synchronize()
        return graph

    def replay(self, graph) -> None:
        with torch.cuda.device(self.device):
            graph.replay()

    def copied(self):
        """An event after the work queued so far (the input copy): the host buffer is free again
        once it has passed."""
        with torch.cuda.device(self.device):
            event = torch.cuda.Event()
            event.record()
        return event

    def memory_reserved(self) -> int:
        """GPU memory the allocator holds, its unused cache released first: across the captures
        the difference is what the graphs keep (their private pool) and what they set up."""
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)

    def pinned(self, shape, dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)


@dataclass
class StepResult:
    """A replayed step's output: views of the static buffers, valid until the next replay."""

    logits: torch.Tensor      # fp32 [R, vocab], the batch's logits rows
    picked: torch.Tensor      # float64 [R, 3]: greedy_pick of those rows


class DecodeGraphs:
    """The captured decode steps of one model and KV store, and their replay."""

    def __init__(self, model, kv: KVStore, page_size: int, max_context: int, scratch_slot: int, api):
        if scratch_slot % page_size or scratch_slot >= kv.k[0].shape[0]:
            raise ValueError(f"the scratch slot {scratch_slot} must start a page past the pool, inside the store")
        self.model = model
        self.kv = kv
        self.api = api
        self.page_size = page_size
        self.scratch_slot = scratch_slot
        self.key_buckets = key_buckets(-(-max_context // page_size) * page_size)
        self.max_pages = -(-self.key_buckets[-1] // page_size)
        self.device = model.device
        rows = _PAGES + self.max_pages
        self.host = api.pinned((rows, BATCH_BUCKETS[-1]), torch.int64)
        self.host_np = self.host.numpy()
        self.inputs = torch.zeros(rows, BATCH_BUCKETS[-1], dtype=torch.int64, device=self.device)
        self.out_logits = torch.zeros(BATCH_BUCKETS[-1], model.config.vocab_size, device=self.device)
        self.out_picked = torch.zeros(BATCH_BUCKETS[-1], 3, dtype=torch.float64, device=self.device)
        self.graphs: dict[tuple[int, int], object] = {}
        self.skipped: list[tuple[int, int]] = []   # buckets past MAX_GRAPH_KEYS
        self.replays: Counter = Counter()          # (batch bucket, key bucket) -> steps
        self.eager_steps: Counter = Counter()      # reason -> steps run eagerly
        self._copy_done = None
        self._tables_kept: list[torch.Tensor] = []
        self.summary = ""

    # --- capture -------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> str:
        """Capture every bucket, largest first (the shared pool is sized once, by the largest
        graph; the smaller ones reuse its memory); returns the summary line."""
        t0 = time.perf_counter()
        before = self.api.memory_reserved()
        for rope in (self.model.rope_global, self.model.rope_local):
            rope.reserve(self.key_buckets[-1])
            self._tables_kept += [rope.cos, rope.sin_signed]   # a graph reads them at their address
        self._fill_padding(0, BATCH_BUCKETS[-1])
        self.inputs.copy_(self.host)
        previous = set_tracer(None)   # nothing to trace while recording: the replays are traced
        try:
            for b in sorted(BATCH_BUCKETS, reverse=True):
                for k in sorted(self.key_buckets, reverse=True):
                    if b * k > MAX_GRAPH_KEYS:
                        self.skipped.append((b, k))
                        continue
                    self.graphs[(b, k)] = self.api.capture(self._step_fn(b, k))
        finally:
            set_tracer(previous)
        self.graph_bytes = max(0, self.api.memory_reserved() - before)
        self.static_bytes = sum(t.numel() * t.element_size() for t in (self.inputs, self.out_logits, self.out_picked))
        self.summary = (f"captured {len(self.graphs)} decode graphs (batch {','.join(map(str, BATCH_BUCKETS))} "
                        f"x keys {','.join(map(str, self.key_buckets))}) in {time.perf_counter() - t0:.1f} s; "
                        f"GPU memory: {format_size(self.graph_bytes)} added by the capture, "
                        f"{format_size(self.static_bytes)} of static buffers")
        if self.skipped:
            self.summary += (f"; not captured (past {MAX_GRAPH_KEYS} gathered keys, run eagerly): "
                             + ", ".join(f"{b}x{k}" for b, k in sorted(self.skipped)))
        return self.summary

    def _step_fn(self, b: int, keys: int):
        """The step a graph records: inputs[:, :b] -> out_logits[:b], out_picked[:b]."""
        model, kv, ps = self.model, self.kv, self.page_size
        inp = self.inputs[:, :b]
        ids, positions, context, write = inp[_TOKEN], inp[_POSITION], inp[_CONTEXT], inp[_WRITE]
        tables = inp[_PAGES:_PAGES + -(-keys // ps)].t()
        window = model.config.sliding_window
        fused = model.ops is FUSED

        def step() -> None:
            plans = {sliding: plan_decode_on_device(tables, context, ps, min(keys, window) if sliding else keys,
                                                    window if sliding else None, fused=fused)
                     for sliding in model.attention_kinds()}
            x = model.run_layers(ids, write, plans, model.rope_rows(positions, checked=False), kv)
            logits = model.logits(x)
            self.out_logits[:b].copy_(logits)
            self.out_picked[:b].copy_(greedy_pick(logits))
        return step

    # --- replay --------------------------------------------------------------------------
    def why_eager(self, batch: ForwardBatch) -> str | None:
        """Why this step cannot replay a graph; None when it can."""
        seqs = batch.seqs
        if not self.graphs:
            return "no graphs captured"
        if any(s.length != 1 for s in seqs):
            return "prefill or mixed step"
        if any(s.rowwise for s in seqs):
            return "speculative verify"
        bucket = batch_bucket(len(seqs))
        if bucket is None:
            return f"more than {BATCH_BUCKETS[-1]} sequences"
        ps = self.page_size
        if any(s.pages is None or len(s.pages) * ps < s.context_len or s.start != i for i, s in enumerate(seqs)):
            return "no block tables"
        keys = key_bucket(self.key_buckets, max(s.context_len for s in seqs))
        if keys is None or (bucket, keys) not in self.graphs:
            return "context past the captured key buckets"
        return None

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> StepResult | None:
        """Replay the step's graph: its logits rows and their greedy pick. None (and the reason
        counted) when the step must run eagerly."""
        reason = self.why_eager(batch)
        if reason is not None:
            self.eager_steps[reason] += 1
            return None
        n = len(batch.seqs)
        b = batch_bucket(n)
        k = key_bucket(self.key_buckets, max(s.context_len for s in batch.seqs))
        with get_tracer().scope("cuda graph", batch=n, bucket=b, keys=k):
            if self._copy_done is not None:
                self._copy_done.synchronize()     # the previous step's transfer has left the buffer
            rows = self.fill(batch, b, k)
            self.inputs[:rows].copy_(self.host[:rows], non_blocking=True)
            self._copy_done = self.api.copied()
            self.api.replay(self.graphs[(b, k)])
            self.replays[(b, k)] += 1
        wanted = batch.logits_rows.tolist()
        if wanted == list(range(n)):
            return StepResult(self.out_logits[:n], self.out_picked[:n])
        index = torch.tensor(wanted, dtype=torch.int64).to(self.device, non_blocking=True)
        return StepResult(self.out_logits.index_select(0, index), self.out_picked.index_select(0, index))

    def fill(self, batch: ForwardBatch, bucket: int, keys: int) -> int:
        """The host buffer's columns 0..bucket-1 from a decode batch (the rest padding); returns
        how many of its rows the graph of `keys` reads (the rows to copy)."""
        h, n = self.host_np, batch.num_tokens
        h[_TOKEN, :n] = batch.token_ids.numpy()
        h[_POSITION, :n] = batch.positions.numpy()
        h[_WRITE, :n] = batch.write_slots.numpy()
        pages = -(-keys // self.page_size)
        for i, s in enumerate(batch.seqs):
            h[_CONTEXT, i] = s.context_len
            used = -(-s.context_len // self.page_size)
            h[_PAGES:_PAGES + used, i] = s.pages[:used]
        self._fill_padding(n, bucket)
        return _PAGES + pages

    def _fill_padding(self, first: int, end: int) -> None:
        """Columns [first, end): token 0 at position 0, one key, in the scratch slot."""
        h = self.host_np
        h[_TOKEN, first:end] = 0
        h[_POSITION, first:end] = 0
        h[_CONTEXT, first:end] = 1
        h[_WRITE, first:end] = self.scratch_slot
        h[_PAGES, first:end] = self.scratch_slot // self.page_size
