"""Iteration-level continuous batching.

Every step mixes the decode tokens of running sequences with chunks of prompts, under a
token budget (max_batched_tokens) and at most max_active sequences. When pages run out a
running sequence is preempted by recompute: its pages are freed and it goes back to the
front of the queue, to be prefilled again (prompt + output so far).

Progress is guaranteed in two ways:
- no deadlock: the oldest running sequence is never preempted for a younger one;
- no thrash (paged mode): a waiting sequence, new or preempted, is admitted only when the
  free pages cover its whole current length plus `decode_headroom` tokens of growth for it
  and for every running sequence, and never in a step that preempted. So after any
  admission, no sequence is preempted before some running sequence has decoded
  `decode_headroom` more tokens: a preempted sequence cannot be re-admitted only to be
  evicted again at the next page boundary.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.config import check_scheduler_policy
from engine.kv.pages import BlockManager
from engine.worker.sequence import Sequence, SeqState


DECODE_HEADROOM = 128   # tokens of growth reserved per sequence when admitting (paged mode)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int        # new tokens of this sequence computed in this step
    samples: bool          # the step ends this sequence's pending tokens: sample a token
    draft: int = 0         # of num_tokens, draft tokens to verify (speculative decoding)


@dataclass
class StepPlan:
    items: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)

    @property
    def num_decode(self) -> int:
        return sum(1 for i in self.items if i.seq.state == SeqState.DECODE)

    @property
    def num_draft(self) -> int:
        return sum(i.draft for i in self.items)


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_active: int, max_batched_tokens: int,
                 max_context: int, policy: str = "fcfs", prefill_chunk: int = 0,
                 decode_headroom: int = DECODE_HEADROOM):
        self.blocks = blocks
        self.max_active = max_active
        self.max_batched_tokens = max_batched_tokens
        self.max_context = max_context
        self.policy = policy
        # deterministic mode fixes the chunk size so a prompt's chunks never depend on what
        # else is in the batch (0 = whatever the budget leaves)
        self.prefill_chunk = prefill_chunk
        self.decode_headroom = decode_headroom
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0            # totals since start, for stats and benchmarks
        self.recomputed_tokens = 0      # tokens whose KV a preemption threw away (computed again)
        self.reuse = None   # engine/kv/reuse.py PrefixReuse when the prefix cache is on

    def enable_reuse(self, reuse) -> None:
        self.reuse = reuse

    # --- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.state = SeqState.WAITING
        self.waiting.append(seq)
        if self.reuse is not None:
            self.reuse.arrive(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and free its pages (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        if self.reuse is not None:
            self.reuse.finished(seq)

    def set_policy(self, policy: str) -> None:
        self.policy = check_scheduler_policy(policy)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # --- one step ---------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        items: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        budget = self._continue_running(self.max_batched_tokens, items, preempted)
        self._admit_waiting(budget, items, preempted)
        if self.reuse is not None:
            self.reuse.note_waiting(self.waiting)   # show who waits on which leader
        return StepPlan(items, preempted)

    def _continue_running(self, budget: int, items: list[ScheduledSeq], preempted: list[Sequence]) -> int:
        """Running sequences, oldest first: decodes need 1 token, prefills continue a chunk; out
        of pages, the youngest are preempted. Returns the budget left."""
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq not in self.running:
                continue   # preempted earlier in this loop
            n = self._chunk(seq, budget)
            if n == 0:
                continue
            k = self._draft_room(seq, n, budget)
            if k and not self._fits(seq, n + k):
                k = 0   # drafts never preempt anyone
            while not self._fits(seq, n):
                if self._drop_draft_pages():
                    continue   # a draft model's K/V is only a cache: it goes before any request
                # running sequences are visited oldest first, so a younger victim has not
                # been scheduled in this step yet: nothing to take back from `items`
                victim = self._youngest_other(seq)
                if victim is None:
                    break
                self._preempt(victim)
                preempted.append(victim)
            if not self._fits(seq, n):
                # alone it still does not fit: it goes back to wait (recompute later)
                self._preempt(seq)
                preempted.append(seq)
                continue
            self.blocks.grow(seq, seq.num_computed + n + k)
            items.append(ScheduledSeq(seq, n + k, n == seq.num_pending, k))
            budget -= n + k
        return budget

    def _admit_waiting(self, budget: int, items: list[ScheduledSeq], preempted: list[Sequence]) -> None:
        """Admit waiting sequences while there is room; none in a step that preempted (the victim
        would take back the pages it just gave up). A follower may join the step in which its
        leader completes the pages it waits for (engine/kv/reuse.py)."""
        computing = {i.seq.id: (i.seq, i.seq.num_computed + i.num_tokens) for i in items} \
            if self.reuse is not None and self.waiting else None
        for seq in self._admission_order():
            if budget <= 0 or len(self.running) >= self.max_active or preempted:
                break
            if self.reuse is not None and not self.reuse.admit(seq, computing):
                continue   # waits for the leader computing its prefix; others may pass
            n = self._chunk(seq, budget)
            if n == 0 or not self._fits(seq, n) or not self._room_to_admit(seq):
                if self.reuse is not None:
                    self.reuse.undo(seq)
                break   # keep order: don't let later requests overtake on memory
            if self.reuse is not None:
                self.reuse.admitted(seq)
            self.waiting.remove(seq)
            self.blocks.grow(seq, seq.num_computed + n)
            seq.state = SeqState.PREFILL
            if seq.first_scheduled is None:
                seq.first_scheduled = time.monotonic()
            self.running.append(seq)
            items.append(ScheduledSeq(seq, n, n == seq.num_pending))
            budget -= n
            if computing is not None:
                computing[seq.id] = (seq, seq.num_computed + n)   # later followers may join it

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of seq to compute this step (0 = none fit the budget)."""
        if self.prefill_chunk and seq.num_pending > 1:
            n = min(seq.num_pending, self.prefill_chunk)
            return n if n <= budget else 0
        return max(0, min(seq.num_pending, budget))

    def _draft_room(self, seq: Sequence, n: int, budget: int) -> int:
        """Draft tokens verified right after a decode: what speculation wants, within the
        step's budget and the context (speculative decoding, engine/speculative/)."""
        if not seq.spec_want or n != 1 or seq.num_pending != 1:
            return 0
        return max(0, min(seq.spec_want, budget - n, self.max_context - seq.num_tokens))

    def _drop_draft_pages(self) -> bool:
        """Release every running sequence's draft-model pages (speculative decoding; the
        draft catches up when it drafts again). False when there were none."""
        holders = [s for s in self.running if s.draft_table]
        for s in holders:
            self.blocks.truncate_draft(s, 0)
        return bool(holders)

    def _fits(self, seq: Sequence, n: int) -> bool:
        return n > 0 and self.blocks.can_grow(seq, seq.num_computed + n)

    def _room_to_admit(self, seq: Sequence) -> bool:
        """Paged mode: free pages cover seq's whole current length plus the decode headroom of
        seq and of every running sequence. A lone sequence only needs its current length."""
        if self.blocks.mode != "paged":
            return True   # a contiguous region already covers the whole context
        if not self.running:
            return self.blocks.pages_needed(seq, seq.num_tokens) <= self.blocks.pool.num_free
        need = sum(self._reserve(s) for s in (*self.running, seq))
        return need <= self.blocks.pool.num_free

    def _reserve(self, seq: Sequence) -> int:
        """Pages seq still lacks for its current length plus decode headroom (capped at its limit)."""
        limit = min(len(seq.prompt_ids) + seq.params.max_tokens, self.max_context)
        upto = max(seq.num_tokens, min(seq.num_tokens + self.decode_headroom, limit))
        return self.blocks.pages_needed(seq, upto)

    def _admission_order(self) -> list[Sequence]:
        if self.policy == "spf":
            return sorted(self.waiting, key=lambda s: (s.num_pending, s.arrival))
        return list(self.waiting)

    def _youngest_other(self, seq: Sequence) -> Sequence | None:
        others = [s for s in self.running if s is not seq and s.arrival >= seq.arrival]
        return max(others, key=lambda s: s.arrival) if others else None

    def _preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        self.recomputed_tokens += seq.num_computed - seq.num_cached
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.num_cached = 0
        seq.state = SeqState.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)
        if self.reuse is not None:
            self.reuse.preempted(seq)

    # --- after the forward pass -------------------------------------------------------
    def advance(self, plan: StepPlan) -> None:
        """Account the computed tokens; sequences whose pending tokens are done go to decode."""
        for item in plan.items:
            item.seq.num_computed += item.num_tokens
            if item.samples:
                item.seq.state = SeqState.DECODE
