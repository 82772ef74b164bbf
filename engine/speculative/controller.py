"""The worker's side of speculative decoding: choose k, propose, roll back, count.

Per step, around the scheduler and the runner:
  prepare(scheduler)   before scheduling: each decoding request's k (policy.py); n-gram and
                       suffix proposals are made here, so the scheduler reserves exactly them
  propose(plan)        after scheduling: the draft model drafts for the scheduled requests
  settle(item, v)      after the target step: keep the K/V of the emitted tokens only,
                       release whole pages past them (target's and draft's), record metrics
  end(seq)             the request left: its suffix tree goes, its output stays shared
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.config import WorkerConfig
from engine.errors import InvalidRequest
from engine.worker.sequence import Sequence, SeqState
from engine.speculative.ngram import propose_ngram
from engine.speculative.policy import CostK, CostModel, PositionAcceptance, StepContext, make_policy
from engine.speculative.stats import MeasuredGain, SpecStats
from engine.speculative.suffix import SuffixCache
from engine.speculative.verify import Verdict
from engine.trace import get_tracer


@dataclass
class SeqSpec:
    """A request's speculation state."""
    mode: str                       # ngram | suffix | draft
    policy: object
    tv_budget: float = 0.0          # mentored decoding's D (0 = lossless)
    stats: SpecStats = field(default_factory=SpecStats)
    suffix_fed: int = 0             # output tokens already in the suffix trees
    draft_probs: object = None      # q of this round's drafts (draft model, sampled requests)
    _draft_gen: object = None

    def draft_generator(self, seed: int):
        """The draft's own random stream (seeded from the request's seed: replayable)."""
        if self._draft_gen is None:
            import torch
            self._draft_gen = torch.Generator().manual_seed((seed ^ 0x5BD1E995) & (2**63 - 1))
        return self._draft_gen


CALIBRATE_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)
CALIBRATE_PROMPT = 32


class SpecController:
    def __init__(self, cfg: WorkerConfig, runner, blocks):
        self.cfg = cfg
        self.runner, self.blocks = runner, blocks
        self.draft = getattr(runner, "draft", None)   # engine.speculative.draft.DraftModel or None
        self.calibrated = False
        self.stats = SpecStats()             # the worker's totals
        self.gain = MeasuredGain()
        self.recent = {m: PositionAcceptance() for m in ("ngram", "suffix", "draft")}
        self.cost = CostModel()
        self.suffix = SuffixCache()

    @property
    def modes(self) -> tuple[str, ...]:
        return ("off", "ngram", "suffix", "draft") if self.draft is not None else ("off", "ngram", "suffix")

    def start(self, seq: Sequence) -> None:
        mode = seq.params.speculate or self.cfg.speculate
        if mode == "draft" and self.draft is None:
            raise InvalidRequest("speculate=draft needs a worker started with a draft model (`draft_model`); "
                                 "use speculate=ngram or off")
        p = seq.params
        tv = self.cfg.spec_tv_budget if p.spec_tv_budget is None else p.spec_tv_budget
        seq.spec = None if mode == "off" else SeqSpec(mode, make_policy(p.spec_k or self.cfg.spec_k), tv)
        if mode == "suffix":
            self.suffix.start(seq.id)

    def end(self, seq: Sequence) -> None:
        if seq.spec is not None and seq.spec.mode == "suffix":
            self._feed_suffix(seq)   # the last tokens too: the shared tree keeps the whole output
            self.suffix.stop(seq.id)

    # --- before scheduling --------------------------------------------------------------
    def prepare(self, scheduler) -> None:
        running = scheduler.running
        decoding = [s for s in running if s.state == SeqState.DECODE and s.num_pending == 1]
        spec = [s for s in decoding if s.spec is not None]
        for s in running:
            s.spec_want, s.draft_ids = 0, []
        if not spec:
            return
        if not self.calibrated:
            self.calibrate()
        budget = scheduler.max_batched_tokens
        rows = len(decoding) + _prefill_rows(scheduler, budget - len(decoding))
        other = float(len(decoding) - 1)
        ahead = min(scheduler.max_active, len(running) + len(scheduler.waiting))
        n_draft = sum(s.spec.mode == "draft" for s in spec)
        draft_rounds = 0
        for seq in sorted(spec, key=lambda s: s.arrival):
            # drafts take only what this step's prefill chunks leave of the budget
            max_k = min(seq.remaining_decode - 1, scheduler.max_context - seq.num_tokens,
                        max(0, budget - rows))
            mode = seq.spec.mode
            ctx = StepContext(self.cost, rows, other, draft_rounds, n_draft, mode == "draft", max_k,
                              prior=self.recent[mode], remaining=seq.remaining_decode,
                              catchup_tokens=seq.num_tokens - seq.draft_computed if mode == "draft" else 0,
                              decoding=len(decoding), running=ahead)
            k = max(0, min(seq.spec.policy.next_k(ctx), max_k))
            seq.spec.stats.k = k
            if seq.spec.mode == "suffix":
                self._feed_suffix(seq)
            if k and seq.spec.mode in ("ngram", "suffix"):
                seq.draft_ids = self._lookup(seq, k)
                k = len(seq.draft_ids)
            seq.spec_want = k
            rows += k
            if k:
                policy = seq.spec.policy
                other += policy.expected_tokens(k) - 1 if isinstance(policy, CostK) else k / 2
                if seq.spec.mode == "draft":
                    draft_rounds = max(draft_rounds, k)

    def _feed_suffix(self, seq: Sequence) -> None:
        """Put the output tokens sampled since the last step into the suffix trees."""
        fed = seq.spec.suffix_fed
        if fed < len(seq.output_ids):
            self.suffix.add_output(seq.id, seq.output_ids[fed:])
            seq.spec.suffix_fed = len(seq.output_ids)

    def _lookup(self, seq: Sequence, k: int) -> list[int]:
        """A model-free proposal of up to k tokens: prompt lookup or the suffix trees."""
        tokens = seq.prompt_ids + seq.output_ids
        if seq.spec.mode == "suffix":
            return self.suffix.propose(seq.id, tokens, k).tokens
        return propose_ngram(tokens, k, self.cfg.ngram_min, self.cfg.ngram_max)

    def calibrate(self) -> None:
        """Measure a verify step by rows, and a draft step, on a scratch sequence (about a
        second on the 1.5B); skipped while the pool is too full, the steps then teach it."""
        from engine.config import SamplingParams
        from engine.worker.scheduler import ScheduledSeq, StepPlan
        from engine.speculative.policy import FixedK

        runner, blocks = self.runner, self.blocks
        n, k_max = CALIBRATE_PROMPT, max(CALIBRATE_ROWS) - 1
        pages = 2 * (-(-(n + k_max + 1) // blocks.page_size))
        if blocks.mode != "paged" or blocks.pool.num_free < pages:
            return
        prompt = (runner.tokenizer.encode("calibration " * n, add_special=False) * 2)[:n]
        seq = Sequence("spec-calibration", prompt, SamplingParams(max_tokens=k_max + 2))
        runner.start_sequence(seq)
        seq.spec = SeqSpec("ngram", FixedK(0))
        try:
            with get_tracer().span("spec calibration"):
                blocks.grow(seq, n)
                runner.execute(StepPlan([ScheduledSeq(seq, n, True)], []), blocks)
                seq.num_computed, seq.output_ids = n, [prompt[-1]]
                for _ in range(2):
                    for rows in CALIBRATE_ROWS:
                        seq.draft_ids = prompt[:rows - 1]
                        blocks.grow(seq, n + rows)
                        t0 = time.perf_counter()
                        runner.execute(StepPlan([ScheduledSeq(seq, rows, True, rows - 1)], []), blocks)
                        seconds = time.perf_counter() - t0
                        old = self.cost.target.table.get(rows)
                        self.cost.target.table[rows] = seconds if old is None else min(old, seconds)
                if self.draft is not None:
                    for _ in range(2):
                        blocks.truncate_draft(seq, 0)   # the catch-up reads the whole prompt
                        _, timings = self.draft.propose([(seq, 4)], blocks)
                        self.cost.add_draft_prefill(*self.draft.last_catchup)
                        for r, seconds in timings:
                            old = self.cost.draft.table.get(r)
                            self.cost.draft.table[r] = seconds if old is None else min(old, seconds)
                        blocks.truncate_draft(seq, seq.num_computed)
        finally:
            blocks.free(seq)
            runner.end_sequence(seq)
        self.calibrated = True

    # --- after scheduling ---------------------------------------------------------------
    def propose(self, plan, blocks) -> None:
        """Draft-model proposals for the scheduled requests; a request the draft could not
        serve (no pages) is shrunk back to a plain decode."""
        items = [i for i in plan.items if i.draft and i.seq.spec is not None and i.seq.spec.mode == "draft"]
        if not items or self.draft is None:
            return
        got, timings = self.draft.propose([(i.seq, i.draft) for i in items], blocks)
        for rows, seconds in timings:
            self.cost.add_draft(rows, seconds)
        self.cost.add_draft_prefill(*self.draft.last_catchup)
        for item in items:
            drafts, q = got.get(item.seq.id, ([], None))
            drafts = drafts[:item.draft]
            item.num_tokens -= item.draft - len(drafts)
            item.draft = len(drafts)
            item.seq.draft_ids = drafts
            item.seq.spec.draft_probs = q

    def record_step(self, plan, seconds: float, emitted: int, drafting: float = 0.0) -> None:
        """Teach the cost model: target step time by rows (decode/verify-only steps); and
        measure the gain of those with speculating requests against the same step undrafted.
        seconds: the target's step; drafting: the draft model's proposals before it, which
        the step's tokens cost too."""
        if not all(i.seq.state == SeqState.DECODE for i in plan.items):
            return
        if any(i.seq.spec is not None for i in plan.items) and self.cost.target.known:
            rows = len(plan.items)
            self.gain.add(seconds + drafting, emitted, self.cost.target(rows), rows)
        self.cost.add_target(plan.num_tokens, seconds)

    def stats_dict(self) -> dict:
        """The worker's totals and the measured gain, for WorkerStats."""
        return {**self.stats.as_dict(), **self.gain.as_dict()}

    # --- after the target step ------------------------------------------------------------
    def settle(self, item, verdict: Verdict | None, blocks) -> None:
        """Keep the K/V of what is emitted, release the rest. Call after scheduler.advance."""
        seq = item.seq
        if verdict is not None:
            seq.num_computed -= item.num_tokens - len(verdict.tokens)
            sp = seq.spec
            sp.stats.record(verdict.proposed, verdict.accepted, len(verdict.tokens))
            self.stats.record(verdict.proposed, verdict.accepted, len(verdict.tokens))
            self.stats.k = verdict.proposed
            sp.policy.update(verdict.proposed, verdict.accepted)
            self.recent[sp.mode].update(verdict.proposed, verdict.accepted)
            get_tracer().instant("spec verdict", request=seq.id, proposed=verdict.proposed,
                                 accepted=verdict.accepted, bonus=verdict.bonus)
        blocks.truncate(seq, seq.num_computed)
        blocks.truncate_draft(seq, seq.num_computed)
        seq.draft_ids = []
        seq.spec_want = 0
        if seq.spec is not None:
            seq.spec.draft_probs = None


def _prefill_rows(scheduler, budget: int) -> int:
    """Prompt rows the scheduler will put in this step (its rules, approximately)."""
    chunk = scheduler.prefill_chunk
    rows = 0
    for s in scheduler.running:
        if s.state != SeqState.DECODE or s.num_pending > 1:
            rows += min(s.num_pending, chunk or s.num_pending)
    slots = scheduler.max_active - len(scheduler.running)
    for s in list(scheduler.waiting)[:max(0, slots)]:
        n = min(s.num_pending, chunk or s.num_pending)
        if chunk and n > budget - rows:
            break   # a fixed chunk that does not fit waits (scheduler._chunk)
        rows += n
    return min(rows, max(0, budget))
