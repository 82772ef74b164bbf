"""How many tokens to draft: per request, every step.

- fixed N.
- adaptive:acceptance (mini-vllm-rs's rule): start 4, +1 when a round's acceptance rate is
  above 0.8, -1 below 0.4, bounds 1-8.
- adaptive:length: EMA (alpha 0.2) of the accepted length; next k = round(EMA) + 1.
- adaptive:cost (default): the k, including 0, that maximizes the expected tokens per second
  of the whole step, from the worker's measured step costs (CostModel) and the request's
  acceptance by position. Heavy batching (every extra row costs everyone) or failing drafts
  (low acceptance) make k = 0 win; a rare short probe keeps the estimates alive, and probes
  grow rarer (8, 16, 32, ... steps apart) while they do not bring drafting back: a draft model
  must first catch up on every token since it last ran, so a probe costs several draft steps.
  A request with a draft model that has not drafted yet explores one round when that round's
  draft work, which every request beside it waits for, is cheap against its remaining tokens:
  the worker's record may come from other kinds of prompt (or from none), and only a round of
  this request's own says what its drafts are worth. Neither a probe nor that round is sent
  where drafting would lose even at HOPE acceptance: no acceptance it could show would pay.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

K_MIN, K_MAX = 1, 8
# a draft's catch-up after a round it drafted: the bonus token and its last draft, per request;
# a first draft step reading no more costs what a draft step does
CURRENT_CATCHUP = 2


class FixedK:
    def __init__(self, k: int = 4):
        self.k = k

    def next_k(self, ctx: "StepContext") -> int:
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        if proposed > 0:
            self._adjust(proposed, accepted)

    def _adjust(self, proposed: int, accepted: int) -> None:
        """What a round that proposed something changes: nothing, for a fixed k."""


class AcceptanceK(FixedK):
    def _adjust(self, proposed: int, accepted: int) -> None:
        rate = accepted / proposed
        if rate > 0.8:
            self.k = min(K_MAX, self.k + 1)
        elif rate < 0.4:
            self.k = max(K_MIN, self.k - 1)


class LengthK(FixedK):
    ALPHA = 0.2

    def __init__(self):
        super().__init__()
        self.ema: float | None = None

    def _adjust(self, proposed: int, accepted: int) -> None:
        self.ema = accepted if self.ema is None else (1 - self.ALPHA) * self.ema + self.ALPHA * accepted
        self.k = max(K_MIN, min(K_MAX, round(self.ema) + 1))


class RowCost:
    """Seconds of a step by its exact row count: measured at start-up (calibrate), then kept
    current by the steps the worker runs (EMA). Kernels change at row thresholds (the direct
    kernels cost about the same for 1-2 rows, then the panels or tiles take over), so no
    straight line would do; unseen counts are interpolated, or extrapolated from the last two.
    A step never costs less than one of fewer rows (it reads the same weights and computes
    more): the row count the worker runs most is measured all the time, the others rarely, so
    a slow spell of the machine would otherwise make a few rows more look cheaper than none."""

    ALPHA = 0.2

    def __init__(self):
        self.table: dict[int, float] = {}

    @property
    def known(self) -> bool:
        return bool(self.table)

    def add(self, rows: int, seconds: float) -> None:
        old = self.table.get(rows)
        self.table[rows] = seconds if old is None else (1 - self.ALPHA) * old + self.ALPHA * seconds

    def __call__(self, rows: float) -> float:
        if not self.table:
            return 0.0
        fewer = max((s for x, s in self.table.items() if x < rows), default=0.0)
        return max(self._measured(rows), fewer)

    def _measured(self, rows: float) -> float:
        if rows in self.table:
            return self.table[rows]
        xs = sorted(self.table)
        if len(xs) == 1:
            return self.table[xs[0]] * (1 + 0.05 * (rows - xs[0]))
        lo = max((x for x in xs if x < rows), default=None)
        hi = min((x for x in xs if x > rows), default=None)
        if lo is None:
            lo, hi = xs[0], xs[1]
        elif hi is None:
            lo, hi = xs[-2], xs[-1]
        slope = (self.table[hi] - self.table[lo]) / (hi - lo)
        return max(0.0, self.table[lo] + slope * (rows - lo))


class CostModel:
    """A worker's measured costs: a target step by its rows, a draft step by its rows."""

    def __init__(self):
        self.target = RowCost()
        self.draft = RowCost()
        self.draft_prefill_token = 0.0   # seconds per token of a draft catch-up chunk

    def add_draft_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 16:   # short chunks cost what a decode step does: not per token
            per = seconds / tokens
            old = self.draft_prefill_token
            self.draft_prefill_token = per if not old else 0.8 * old + 0.2 * per

    def add_target(self, rows: int, seconds: float) -> None:
        self.target.add(rows, seconds)

    def add_draft(self, rows: int, seconds: float) -> None:
        self.draft.add(rows, seconds)


@dataclass
class StepContext:
    """What the chooser knows about the step being planned."""
    cost: CostModel
    base_rows: int          # rows of the step without this request's drafts
    other_tokens: float     # tokens the step emits for everyone else
    draft_rounds: int       # draft-model steps already planned by others (0 for n-gram)
    draft_rows: int         # requests drafting with the model in this step (rows of a draft step)
    uses_draft: bool        # the request drafts with a model (each k costs a draft step)
    max_k: int
    prior: PositionAcceptance | None = None   # the worker's recent acceptance for this proposer
    catchup_tokens: int = 0  # tokens the draft model must read before it can draft
    remaining: int = 1       # tokens the request may still emit
    decoding: int = 0        # requests decoding in this step (0: base_rows)
    running: int = 0         # requests decoding or about to (prefilling, or waiting for a free
                             # slot): the rows of the steps ahead (0: decoding)



class PositionAcceptance:
    """Decayed counts of drafts reached and accepted at each position (recent rounds weigh
    more). A position is reached when every draft before it was accepted, so rate(i) is
    P(draft i+1 accepted | drafts 1..i were), the factor expected_tokens multiplies by."""

    DECAY = 0.9

    def __init__(self):
        self.accepted = [0.0] * K_MAX
        self.tried = [0.0] * K_MAX

    def update(self, proposed: int, accepted: int) -> None:
        for i in range(min(proposed, accepted + 1, K_MAX)):
            self.accepted[i] = self.DECAY * self.accepted[i] + (1.0 if i < accepted else 0.0)
            self.tried[i] = self.DECAY * self.tried[i] + 1.0

    def rate(self, i: int, default: float) -> float:
        return self.accepted[i] / self.tried[i] if self.known(i) else default

    def known(self, i: int) -> bool:
        return self.tried[i] > 0.5


class CostK:
    """Expected-tokens-per-second chooser (see the module docstring).

    A request's acceptance at position i is its own decayed record, shrunk toward the
    worker's recent record for the same proposer (ctx.prior): a new request starts from what
    the worker has seen instead of from optimism. A draft model that has fallen behind must
    first catch up (a prefill of every token it has not read), which pays only if the request
    then keeps drafting: so it starts only where drafting pays in a plain step of the requests
    running now, each one row (no prefill beside it, whose rows make a draft look cheap; no
    other request's draft steps to share), and the catch-up is spread over the rounds left
    (about remaining / e).
    A draft that drafted last round has only its last tokens to read (CURRENT_CATCHUP).
    A position neither record has reached is taken to be as good as the one before it: a run
    of accepted drafts tends to go on, and the 0.5 prior there would keep k from ever growing
    past the positions a first round happened to reach.
    """

    PRIOR_ACCEPT, PRIOR_WEIGHT = 0.5, 2.0   # Beta prior at each position, without worker data
    PROBE_FIRST, PROBE_MAX = 8, 128          # steps at k = 0 before a probe, doubling
    PROBE_MAX_CATCHUP = 16                   # never probe a draft that must re-read more
    MARGIN = 1.03                            # speculate only for a clear expected gain
    HOPE = 0.9                               # probe or explore only where drafting would pay
                                             # at this acceptance at every position
    EXPLORE_K = 4                            # a request's first round with a draft model
    EXPLORE_SHARE = 0.10                     # explore if the round's draft work, times the rows
                                             # waiting for it, is at most this share of the
                                             # request's remaining decode time

    def __init__(self):
        self.own = PositionAcceptance()
        self.k = 0
        self._idle = 0
        self._probe_every = self.PROBE_FIRST
        self._probing = False
        self._prior: PositionAcceptance | None = None
        self._explored = False

    def alphas(self, k: int) -> list[float]:
        """P(draft i+1 accepted | drafts 1..i were), for i < k (see the class docstring)."""
        out, p = [], self.PRIOR_ACCEPT
        for i in range(k):
            if self._prior is not None and self._prior.known(i):
                p = self._prior.rate(i, p)
            elif i and not self.own.known(i):
                p = out[-1]
            out.append((self.own.accepted[i] + p * self.PRIOR_WEIGHT) / (self.own.tried[i] + self.PRIOR_WEIGHT))
        return out

    def expected_tokens(self, k: int) -> float:
        e, run = 1.0, 1.0
        for a in self.alphas(k):
            run *= a
            e += run
        return e

    def next_k(self, ctx: StepContext) -> int:
        cost = ctx.cost
        self._prior = ctx.prior
        max_k = min(ctx.max_k, K_MAX)
        if max_k <= 0:
            return 0
        if not cost.target.known:
            self.k = min(4, max_k)   # nothing measured yet: the first rounds teach the model
            return self.k
        catchup = ctx.catchup_tokens * cost.draft_prefill_token if ctx.uses_draft else 0.0
        if ctx.catchup_tokens > CURRENT_CATCHUP and not self._best_k(self._plain_step(ctx), max_k, 0.0):
            best_k = 0   # a draft that would not keep paying does not start (see the class docstring)
        else:
            best_k = self._best_k(ctx, max_k, catchup / max(ctx.remaining, 1))
        self._probing = False
        if best_k == 0 and self._explore(ctx, max_k, catchup):
            best_k = min(self.EXPLORE_K, max_k)
        if best_k == 0:
            self._idle += 1
            if (self._idle >= self._probe_every and self._hopeful(ctx, max_k, catchup)
                    and (not ctx.uses_draft or ctx.catchup_tokens <= self.PROBE_MAX_CATCHUP)):
                self._idle, self._probing = 0, True   # a short probe so acceptance can recover
                best_k = min(2, max_k)
        else:
            self._idle = 0
            self._probe_every = self.PROBE_FIRST   # drafting pays: after it stops, probe soon
        self.k = best_k
        return best_k

    def _hopeful(self, ctx: StepContext, max_k: int, catchup_seconds: float) -> bool:
        """Drafting would pay in this step were every draft accepted HOPE of the time."""
        return self._best_k(ctx, max_k, catchup_seconds / max(ctx.remaining, 1), hope=True) > 0

    def _explore(self, ctx: StepContext, max_k: int, catchup_seconds: float) -> bool:
        """Once per request with a draft model, before any round of its own: where the round's
        draft work (the catch-up and EXPLORE_K draft steps), which every request running beside
        it waits for, is a small share of the time its remaining tokens take undrafted, and
        well-accepted drafts would pay in the plain steps ahead (a request decoding alone while
        others still prefill will have them beside it)."""
        if not ctx.uses_draft or self._explored or self.own.known(0):
            return False
        self._explored = True
        plain = self._plain_step(ctx)
        cost, rows = ctx.cost, plain.base_rows
        delay = catchup_seconds + self.EXPLORE_K * cost.draft(max(ctx.draft_rows, 1))
        return (delay * rows <= self.EXPLORE_SHARE * ctx.remaining * cost.target(rows)
                and self._hopeful(plain, max_k, catchup_seconds))

    def _best_k(self, ctx: StepContext, max_k: int, catchup_per_token: float, hope: bool = False) -> int:
        """The k (0 .. max_k) of the highest expected tokens per second of the step; a draft
        must beat k = 0 by MARGIN. catchup_per_token: the catch-up's share per emitted token.
        hope: each position accepted at least HOPE of the time."""
        cost = ctx.cost
        base = (ctx.other_tokens + 1) / max(cost.target(ctx.base_rows), 1e-9)
        best_k, best_rate = 0, base * self.MARGIN
        e, run = 1.0, 1.0
        alphas = self.alphas(max_k)
        if hope:
            alphas = [max(a, self.HOPE) for a in alphas]
        for k, a in enumerate(alphas, 1):
            run *= a
            e += run   # expected_tokens(k), one position at a time
            seconds = cost.target(ctx.base_rows + k)
            if ctx.uses_draft:
                seconds += max(0, k - ctx.draft_rounds) * cost.draft(ctx.draft_rows) + catchup_per_token * e
            rate = (ctx.other_tokens + e) / max(seconds, 1e-9)
            if rate > best_rate * 1.001:     # ties go to the shorter draft
                best_k, best_rate = k, rate
        return best_k

    @staticmethod
    def _plain_step(ctx: StepContext) -> StepContext:
        """The step of the requests running now, each one row, none other drafting."""
        n = ctx.running or ctx.decoding or ctx.base_rows
        return replace(ctx, base_rows=n, other_tokens=n - 1.0, draft_rounds=0)

    def update(self, proposed: int, accepted: int) -> None:
        self.own.update(proposed, accepted)
        if self._probing:
            # the next choice says whether the probe brought drafting back (and resets this);
            # a probe that did not, whatever it accepted, was a cost: the next one waits longer
            self._probe_every = min(self.PROBE_MAX, self._probe_every * 2)


def make_policy(spec_k: str):
    if spec_k.isdigit():
        return FixedK(int(spec_k))
    return {"adaptive:acceptance": AcceptanceK, "adaptive:length": LengthK,
            "adaptive:cost": CostK}[spec_k]()
