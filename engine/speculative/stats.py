"""Speculation counters, per request and per worker.

Named so they map onto vLLM's metrics: drafts -> spec_decode_num_drafts, draft_tokens ->
spec_decode_num_draft_tokens, accepted_tokens -> spec_decode_num_accepted_tokens,
accepted_per_pos -> spec_decode_num_accepted_tokens_per_pos.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_POS = 16


@dataclass
class SpecStats:
    drafts: int = 0              # verify rounds with at least one draft token
    draft_tokens: int = 0        # draft tokens verified
    accepted_tokens: int = 0     # draft tokens accepted
    emitted_tokens: int = 0      # tokens emitted by those rounds (accepted + the target's)
    accepted_per_pos: list[int] = field(default_factory=lambda: [0] * MAX_POS)
    proposed_per_pos: list[int] = field(default_factory=lambda: [0] * MAX_POS)
    # verify rounds by how many of their draft tokens were accepted (vLLM's acceptance_histogram)
    rounds_by_accepted: list[int] = field(default_factory=lambda: [0] * (MAX_POS + 1))
    k: int = 0                   # the draft length chosen last

    def record(self, proposed: int, accepted: int, emitted: int) -> None:
        if proposed <= 0:
            return
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        self.emitted_tokens += emitted
        self.rounds_by_accepted[min(accepted, MAX_POS)] += 1
        for i in range(min(proposed, MAX_POS)):
            self.proposed_per_pos[i] += 1
            if i < accepted:
                self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """vLLM's mean acceptance length: tokens per verify round, 1 + accepted / drafts."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None

    def per_position(self) -> list[float]:
        n = max((i + 1 for i, c in enumerate(self.proposed_per_pos) if c), default=0)
        return [self.accepted_per_pos[i] / self.proposed_per_pos[i] for i in range(n)]

    def as_dict(self) -> dict:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "emitted_tokens": self.emitted_tokens,
                "acceptance_rate": self.acceptance_rate, "mean_accepted_length": self.mean_accepted_length,
                "acceptance_per_position": self.per_position(),
                "accepted_per_position": self.accepted_per_pos[:len(self.per_position())],
                "acceptance_histogram": self.rounds_by_accepted[:len(self.per_position()) + 1], "k": self.k}


@dataclass
class MeasuredGain:
    """What speculation buys a worker: the tokens per second of its steps with speculating
    requests, against the cost model's estimate of the same steps without drafts (one row per
    decoding request). Sums decay so the figure follows the current load."""
    DECAY = 0.98
    seconds: float = 0.0
    tokens: float = 0.0
    plain_seconds: float = 0.0
    plain_tokens: float = 0.0

    def add(self, seconds: float, tokens: int, plain_seconds: float, plain_tokens: int) -> None:
        d = self.DECAY
        self.seconds = d * self.seconds + seconds
        self.tokens = d * self.tokens + tokens
        self.plain_seconds = d * self.plain_seconds + plain_seconds
        self.plain_tokens = d * self.plain_tokens + plain_tokens

    def as_dict(self) -> dict:
        """spec_tok_s, plain_tok_s_est and their ratio gain; all None before any such step."""
        if self.seconds <= 0 or self.plain_seconds <= 0:
            return {"spec_tok_s": None, "plain_tok_s_est": None, "gain": None}
        spec, plain = self.tokens / self.seconds, self.plain_tokens / self.plain_seconds
        return {"spec_tok_s": spec, "plain_tok_s_est": plain, "gain": spec / plain if plain else None}
