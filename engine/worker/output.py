"""A worker's output processing: a sampled token becomes streamed text, and maybe the end.

Detokenization, stop tokens and stop strings (text that could still start a stop string is
held back), the length limit, and the metrics of a finished request. Pure bookkeeping on a
Sequence: the worker loop owns the scheduler and pages, and frees them when a request ends.
"""
from __future__ import annotations

import time
from typing import NamedTuple

from engine import messages as msg
from engine.worker.sequence import Sequence


class SampledToken(NamedTuple):
    """One token sampled for one sequence in a step."""
    token_id: int
    logprob: float | None = None
    top: tuple = ()                  # ((token_id, logprob), ...) when top logprobs were asked


class StepOutput(NamedTuple):
    """What a runner's step produced: a token per sampling sequence, or that sequence's error."""
    sampled: dict[str, SampledToken]
    errors: dict[str, str]


class OutputProcessor:
    def __init__(self, eog_ids, max_context: int):
        self.eog_ids = frozenset(eog_ids)
        self.max_context = max_context

    def on_token(self, seq: Sequence, sample: SampledToken, now: float,
                 drafted: bool = False) -> tuple[list[msg.TokenDelta], str | None]:
        """Record `sample` on `seq`: the deltas to stream, and "stop" or "length" when it ends.
        drafted: an accepted draft token of speculative decoding (marked in its delta)."""
        token_id, logprob, top = sample
        seq.record_token(now)
        p = seq.params
        deltas: list[msg.TokenDelta] = []
        seq.output_ids.append(token_id)
        if (token_id in self.eog_ids and not p.ignore_eos) or token_id in p.stop_token_ids:
            self._text(seq, seq.detok.flush() if seq.detok else "", None, deltas, final=True)
            return deltas, "stop"
        if seq.sampler is not None:
            seq.sampler.observe(token_id)
        delta = seq.detok.push(token_id) if seq.detok else ""
        if self._text(seq, delta, SampledToken(token_id, logprob, top), deltas, final=False, drafted=drafted):
            return deltas, "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_context:
            self._text(seq, seq.detok.flush() if seq.detok else "", None, deltas, final=True)
            return deltas, "length"
        return deltas, None

    @staticmethod
    def _text(seq: Sequence, delta: str, token: SampledToken | None, deltas: list, final: bool,
              drafted: bool = False) -> bool:
        """Append text, honouring stop strings (held back until they can't start a stop).
        True when a stop string was found: the text ends before it."""
        stops = seq.params.stop
        pending = seq.held_text + delta
        stopped = False
        if stops:
            # one scan per stop string of at most the longest's length plus the new text
            hits = [i for i in map(pending.find, stops) if i >= 0]
            if hits:
                out, held, stopped = pending[:min(hits)], "", True
            elif final:
                out, held = pending, ""
            else:
                cut = max(0, len(pending) - (max(len(s) for s in stops) - 1))
                out, held = pending[:cut], pending[cut:]
        else:
            out, held = pending, ""
        seq.held_text = held
        seq.text += out
        if token is not None or out:
            token = token or SampledToken(-1)
            deltas.append(msg.TokenDelta(seq.id, token.token_id, out, token.logprob, tuple(token.top), drafted))
        return stopped

    @staticmethod
    def finished_event(seq: Sequence) -> msg.Finished:
        """The Finished event of an ended sequence, with its metrics."""
        n_out = len(seq.output_ids)
        m = msg.RequestMetrics(
            prompt_tokens=len(seq.prompt_ids), cached_tokens=seq.num_cached, output_tokens=n_out,
            queue_time=None if seq.first_scheduled is None else seq.first_scheduled - seq.arrival,
            ttft=None if seq.first_token_at is None else seq.first_token_at - seq.arrival,
            itl_mean=seq.itl_sum / (n_out - 1) if n_out > 1 else None,
            itl_max=seq.itl_max if n_out > 1 else None,
            e2e=(seq.finished_at or time.monotonic()) - seq.arrival, preemptions=seq.preemptions,
            follow_start=None if seq.follow_since is None else seq.follow_since - seq.arrival,
            follow_time=seq.follow_time, spec=spec_dict(seq))
        return msg.Finished(seq.id, seq.finish_reason or "error", seq.error, m)


def spec_dict(seq: Sequence) -> dict | None:
    """A speculating sequence's mode and counters (engine/speculative/stats.py); None when it is not."""
    if seq.spec is None:
        return None
    return {"mode": seq.spec.mode, **seq.spec.stats.as_dict()}
