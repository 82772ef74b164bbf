"""Turn one step's logits into tokens: penalties, temperature, top-k / top-p / min-p, seeded draws.

Order of operations, per row (one row = one request sampling this step):

    penalties -> temperature -> top-k -> top-p -> min-p -> draw

- Penalties: repetition_penalty (HF / llama.cpp: a seen token's logit is divided by r when
  positive, multiplied by r otherwise) counts the prompt *and* generated tokens;
  presence_penalty and frequency_penalty (OpenAI: logit -= presence * [count > 0] +
  frequency * count) count generated tokens only, so a prompt full of code is not punished
  for being repeated by the answer.
- Temperature 0 is greedy: argmax of the penalized logits, ties go to the lowest token id.
- top-k keeps the k most likely tokens; top-p then keeps the smallest set whose mass (on the
  renormalized top-k distribution) is >= p, always at least the top token; min-p then keeps
  tokens with p(x) >= min_p * p(top). Ties in likelihood are ranked by lower token id, so the
  kept set is a pure function of the row's own logits.
- Each sampled (non-greedy) token costs exactly one uniform draw from the request's own
  generator, mapped through the inverse CDF of the final distribution: same seed => same
  tokens, whether the request ran alone or batched with others.
- Reported logprobs are those of the distribution after penalties and temperature (before
  the top-k/p/min-p filters); for greedy rows, after penalties at temperature 1.

The probability helpers at the end (probs_for, total_variation, mentored_mix,
speculative_accept, residual, draw_from) are the building blocks of speculative decoding.
"""
from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine import kernels
from engine.config import SamplingParams
from engine.errors import TokentopError

# How many candidates topk fetches for a top-p row without top-k, then for rows it could
# not decide, before a full sort of the vocabulary (152k floats: ~15 ms on CPU, while
# topk(64) costs ~0.3 ms and topk(1024) ~0.8 ms).
_TOP_P_FETCH = 64
_WIDER_FETCH = (1024, 16384)


class SamplingError(TokentopError):
    """A row of logits had no valid distribution; only that row's request should fail."""

    def __init__(self, row: int, detail: str):
        self.row = row
        super().__init__(
            f"Sampling failed for the request in batch row {row}: the model's scores were {detail}. "
            "This request was stopped; the others in the batch continue. It points to a numerical "
            "fault in the model run: retry, or use `activation_dtype=fp32` or another device.")


class RequestSampler:
    """Per-request sampling state: parameters, seeded generator, token counts for penalties."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = ()):
        self.params = params.validate()
        # A request without a seed gets a random one, recorded so the run can be replayed.
        self.seed: int = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator().manual_seed(self.seed)
        self._prompt_ids = torch.tensor(sorted(set(prompt_ids)), dtype=torch.int64)
        self.generated_counts: dict[int, int] = {}
        self._penalty_index: tuple[Tensor, Tensor, Tensor] | None = None

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    def observe(self, token_id: int) -> None:
        """Record a generated token (call once per token the request emits)."""
        self.generated_counts[token_id] = self.generated_counts.get(token_id, 0) + 1
        self._penalty_index = None

    def uniform(self) -> float:
        """One U[0, 1) draw from this request's own stream."""
        return torch.rand((), generator=self.generator, dtype=torch.float64).item()

    def stream_position(self) -> Tensor:
        """Where this request's random stream is: rewind() to it to draw the same numbers again."""
        return self.generator.get_state()

    def rewind(self, position: Tensor) -> None:
        self.generator.set_state(position)

    def penalty_index(self) -> tuple[Tensor, Tensor, Tensor]:
        """(ids seen in prompt or output, generated ids, their counts), rebuilt after observe()."""
        if self._penalty_index is None:
            gen_ids = torch.tensor(list(self.generated_counts), dtype=torch.int64)
            counts = torch.tensor(list(self.generated_counts.values()), dtype=torch.float32)
            # Duplicates in seen_ids are harmless: every copy reads the same original logit.
            seen_ids = torch.cat([self._prompt_ids, gen_ids])
            self._penalty_index = (seen_ids, gen_ids, counts)
        return self._penalty_index


@dataclass
class SampleResult:
    tokens: Tensor                       # int64 [R] on CPU; -1 for a failed row
    logprobs: Tensor                     # float32 [R]: chosen token's logprob; nan if failed or not computed
    top_logprobs: list[list[tuple[int, float]]]  # per row, most likely first; [] if not asked
    errors: dict[int, SamplingError] = field(default_factory=dict)  # row -> why it failed


def apply_penalties_(logits: Tensor, sampler: RequestSampler) -> Tensor:
    """Apply the request's penalties to one row of logits in place and return it."""
    p = sampler.params
    seen_ids, gen_ids, counts = (t.to(logits.device) for t in sampler.penalty_index())
    if p.repetition_penalty != 1.0 and seen_ids.numel():
        seen = logits[seen_ids]
        logits[seen_ids] = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and gen_ids.numel():
        logits[gen_ids] -= p.frequency_penalty * counts + p.presence_penalty
    return logits


@dataclass
class _Scores:
    """One batch's logits after penalties and temperature, shared by every sampling path."""

    raw: Tensor      # [R, V] float32 logits after penalties: greedy argmax reads these
    scaled: Tensor   # [R, V] (raw - row max) / T; T = 1 for greedy rows; max 0 on valid rows
    expd: Tensor     # [R, V] exp(scaled): unnormalized probabilities, max 1
    mass: Tensor     # [R] float64: sum of expd (by blocks, _block_sums)
    ok: Tensor       # [R] bool: the row has a usable distribution


EXP_FLOOR = -87.0   # exp(EXP_FLOOR) = 1.65e-38, just above float32's smallest normal number
EXP_FLOOR_WEIGHT = float(torch.tensor(EXP_FLOOR).exp())   # a score at or under the floor weighs 0


def _score(logits: Tensor, samplers: Sequence[RequestSampler]) -> _Scores:
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(samplers)} samplers")
    raw = logits.float()
    penalized = [i for i, s in enumerate(samplers) if s.has_penalties]
    if penalized:
        raw = raw.clone()  # the caller's logits stay untouched
        for i in penalized:
            apply_penalties_(raw[i], samplers[i])
    row_max = raw.amax(dim=-1, keepdim=True)   # NaN or +-inf here marks a broken row
    ok = torch.isfinite(row_max.squeeze(-1))
    temps = [s.params.temperature or 1.0 for s in samplers]
    # Subtracting the max first keeps a tiny temperature from overflowing to inf.
    scaled = raw - row_max
    if any(t != 1.0 for t in temps):
        scaled /= torch.tensor(temps, dtype=raw.dtype, device=raw.device).unsqueeze(-1)
    # A weight under float32's normal range (a score below -87: 1.6e-38 of the top token's)
    # is 0, and exp never sees such a score: its vectorized path drops to slow code for any
    # lane whose result is not a normal float, -inf's included (5-10x on a row at temperature
    # 0.2). So: clamp to the floor, exp, zero what sat at the floor.
    expd = torch.nn.functional.threshold(scaled.clamp(min=EXP_FLOOR).exp_(), EXP_FLOOR_WEIGHT, 0.0,
                                         inplace=True)
    # Summed by blocks, each within one row, so a row's mass does not depend on its batch
    # (a multithreaded sum over [R, V] splits a row across threads only when R is small).
    mass = _block_sums(expd).sum(-1)
    return _Scores(raw, scaled, expd, mass, ok)


def _describe_failure(row: Tensor) -> str:
    if torch.isnan(row).any():
        return "NaN"
    if torch.isposinf(row).any():
        return "infinite"
    return "all -inf (no token can be chosen)"


def _take(t: Tensor, rows: list[int]) -> Tensor:
    """t[rows], without a copy when rows are all of t's rows in order."""
    return t if rows == list(range(t.shape[0])) else t[rows]


@dataclass
class _Dist:
    """Final distributions of some rows, as unnormalized weights over candidate tokens."""

    rows: list[int]
    ids: Tensor | None   # [G, K] candidate token ids; None = whole vocabulary in id order
    weights: Tensor      # [G, K or V] unnormalized, >= 0 (0 = out)

    def token_ids(self, positions: Tensor) -> Tensor:
        return positions if self.ids is None else self.ids.gather(-1, positions.unsqueeze(-1)).squeeze(-1)

    def subset(self, which: Tensor) -> "_Dist":
        return _Dist([self.rows[i] for i in which.tolist()], self.ids[which], self.weights[which])


def _param(samplers: Sequence[RequestSampler], rows: list[int], name: str, device, dtype) -> Tensor:
    return torch.tensor([getattr(samplers[i].params, name) for i in rows], dtype=dtype, device=device)


def _vocab_dist(sc: _Scores, rows: list[int], samplers: Sequence[RequestSampler]) -> _Dist:
    """Rows with no top-k/top-p: the whole vocabulary in id order, min-p applied as a mask."""
    weights = _take(sc.expd, rows)
    if any(samplers[i].params.min_p for i in rows):
        min_p = _param(samplers, rows, "min_p", weights.device, weights.dtype).unsqueeze(-1)
        weights = torch.where(weights >= min_p, weights, 0.0)   # p(top) is exp(0) = 1
    return _Dist(rows, None, weights)


def _ranked_candidates(scaled: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k best tokens of each row ordered by (value desc, id asc): a canonical order."""
    if k >= scaled.shape[-1]:
        return scaled.sort(dim=-1, descending=True, stable=True)
    vals, ids = scaled.topk(k, dim=-1)   # topk's order among ties is unspecified
    ids, by_id = ids.sort(dim=-1)
    vals = vals.gather(-1, by_id)
    vals, by_val = vals.sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(-1, by_val)


def _filtered_candidates(sc: _Scores, rows: list[int], samplers: Sequence[RequestSampler],
                         fetch: int) -> tuple[_Dist, Tensor]:
    """top-k -> top-p -> min-p over the `fetch` best tokens; also says which rows were decided."""
    scaled = _take(sc.scaled, rows)
    vocab, dev = scaled.shape[-1], scaled.device
    vals, ids = _ranked_candidates(scaled, min(fetch, vocab))
    row_ids = torch.tensor(rows, device=dev).unsqueeze(-1)
    w = sc.expd[row_ids, ids].double()                 # the very numbers summed in `mass`
    pos = torch.arange(w.shape[-1], device=dev)
    top_k = _param(samplers, rows, "top_k", dev, torch.int64)
    keep = (top_k == 0).unsqueeze(-1) | (pos < top_k.unsqueeze(-1))
    w = w * keep
    cum = w.cumsum(-1)
    # top-p is measured on the renormalized top-k distribution, or the full one without top-k.
    total = torch.where(top_k > 0, cum[:, -1], sc.mass[rows])
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    top_p = _param(samplers, rows, "top_p", dev, torch.float64)
    keep &= before < (top_p * total).unsqueeze(-1)
    min_p = _param(samplers, rows, "min_p", dev, torch.float64)
    keep &= w >= (min_p * w[:, 0]).unsqueeze(-1)
    keep &= w > 0   # underflowed or -inf logits are never drawn: leave them out of the set
    # Decided when every token tied with the last kept one was fetched: otherwise topk may
    # have cut the tie arbitrarily, or the top-p set reaches past what was fetched.
    n_kept = keep.sum(-1)
    last_kept = vals.gather(-1, (n_kept - 1).unsqueeze(-1)).squeeze(-1)
    decided = torch.full_like(keep[:, 0], True) if w.shape[-1] == vocab else last_kept > vals[:, -1]
    return _Dist(rows, ids, w * keep), decided


def _candidate_dists(sc: _Scores, rows: list[int], samplers: Sequence[RequestSampler],
                     first_fetch: int) -> list[_Dist]:
    """topk-sized work, widening (up to a full sort) only for rows it could not decide."""
    vocab = sc.scaled.shape[-1]
    fetches = [first_fetch] + [f for f in _WIDER_FETCH if f > first_fetch]
    dists: list[_Dist] = []
    for fetch in fetches + [vocab]:
        dist, decided = _filtered_candidates(sc, rows, samplers, fetch)
        if decided.any():
            dists.append(dist.subset(decided.nonzero().squeeze(-1)))
        rows = [r for r, d in zip(rows, decided.tolist()) if not d]
        if not rows or fetch >= vocab:
            break
    return dists


def _distributions(sc: _Scores, rows: list[int], samplers: Sequence[RequestSampler]) -> list[_Dist]:
    """Final distributions of the sampled (non-greedy) rows, grouped by the work they need."""
    top_k = [i for i in rows if samplers[i].params.top_k]
    top_p = [i for i in rows if not samplers[i].params.top_k and samplers[i].params.top_p < 1.0]
    plain = [i for i in rows if not samplers[i].params.top_k and samplers[i].params.top_p == 1.0]
    dists = [_vocab_dist(sc, plain, samplers)] if plain else []
    if top_k:
        dists += _candidate_dists(sc, top_k, samplers, max(samplers[i].params.top_k for i in top_k) + 1)
    if top_p:
        dists += _candidate_dists(sc, top_p, samplers, _TOP_P_FETCH)
    return dists


CDF_BLOCK = 1024   # tokens a block of the two-level inverse CDF holds


def _block_sums(weights: Tensor) -> Tensor:
    """float64 [G, ceil(K / CDF_BLOCK)]: each block of CDF_BLOCK weights summed in float32, as
    float64. The row's total is their sum. A float64 sum of the whole row would first copy
    it to float64 (~0.3 ms a 152k row); a block's float32 sum is off by ~1e-7 of the block."""
    g, k = weights.shape
    n_full = k // CDF_BLOCK
    sums = [weights[:, :n_full * CDF_BLOCK].reshape(g, n_full, CDF_BLOCK).sum(-1)]
    if n_full * CDF_BLOCK < k:
        sums.append(weights[:, n_full * CDF_BLOCK:].sum(-1, keepdim=True))
    return torch.cat(sums, dim=-1).double()


def _inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """Per row of weights [G, K] (unnormalized, >= 0), the first position whose running weight
    exceeds u * total, u [G] in [0, 1): an inverse-CDF draw; a zero weight is never picked.

    Two short scans instead of one over K: the running sum of block sums finds the block, a
    running sum inside it the token. A float64 running sum is sequential: over a 152k
    vocabulary it cost ~0.9 ms a row."""
    run = _block_sums(weights).cumsum(-1)
    target = u.to(run) * run[:, -1]
    blocks = torch.searchsorted(run, target.unsqueeze(-1), right=True).squeeze(-1)
    picks = []
    for i, b in enumerate(blocks.tolist()):
        if b >= run.shape[-1]:   # u * total rounded up to the total: the last block with weight
            b = _last_nonzero(torch.diff(run[i], prepend=run.new_zeros(1)))
        start = b * CDF_BLOCK
        block = weights[i, start:start + CDF_BLOCK]
        inside = block.cumsum(0, dtype=torch.float64) + (run[i, b - 1] if b else 0.0)
        j = int(torch.searchsorted(inside, target[i:i + 1], right=True))
        if j >= block.shape[0]:   # the block's float32 sum fell short of its running sum
            j = _last_nonzero(block)
        picks.append(start + j)
    return torch.tensor(picks, dtype=torch.int64, device=weights.device)


def _last_nonzero(t: Tensor) -> int:
    nz = t.nonzero()
    return int(nz[-1]) if nz.numel() else t.shape[0] - 1


def draw_from(weights: Tensor, u: Tensor | float) -> Tensor:
    """Inverse-CDF draw from weights [..., K] (unnormalized, >= 0) with u [...] in [0, 1).

    Returns int64 positions [...]; the same u always maps to the same token.
    """
    lead = weights.shape[:-1]
    u = torch.as_tensor(u, dtype=torch.float64, device=weights.device).expand(lead)
    return _inverse_cdf(weights.reshape(-1, weights.shape[-1]), u.reshape(-1)).reshape(lead)


def plain_greedy(samplers: Sequence[RequestSampler]) -> bool:
    """Every row greedy, without penalties or top logprobs: argmax and its logprob are all."""
    return not any(not s.params.greedy or s.has_penalties or s.params.logprobs for s in samplers)


def greedy_pick(logits: Tensor) -> Tensor:
    """Per row of logits [R, V]: (argmax, its logprob, whether the row is usable) as float64
    [R, 3], in tensor ops on the logits' device (no host read, so a CUDA graph can hold it;
    one copy to the host then reads all three). Token ids below 2**53 are exact in float64.
    The logprob is the full path's: -log(sum(exp(raw - max))) at temperature 1."""
    raw = logits.float()
    best, token = raw.max(dim=-1)                   # the first maximum: lowest id wins ties
    mass = (raw - best.unsqueeze(-1)).exp().sum(-1, dtype=torch.float64)
    return torch.stack([token.double(), -mass.log().float().double(), torch.isfinite(best).double()], dim=-1)


def _plain_greedy(logits: Tensor, samplers: Sequence[RequestSampler],
                  picked: Tensor | None = None) -> SampleResult | None:
    """Every row greedy, without penalties or top logprobs: on the CPU the C++ op greedy_pick
    does the argmax and the chosen logprob in two passes over each row (~0.3 ms less per step
    than the full scoring over a 152k vocabulary), the logprob (NaN otherwise) only where a
    request returns logprobs to its client; on another device greedy_pick above (or
    `picked`, its result computed already, e.g. inside a captured decode step), read with one
    copy: the step's one host sync. None when it does not apply, or a row is unusable (the
    full path then says why)."""
    if logits.dim() != 2 or logits.shape[0] != len(samplers) or not plain_greedy(samplers):
        return None
    if logits.device.type != "cpu":
        host = (picked if picked is not None else greedy_pick(logits)).cpu()
        if not bool(host[:, 2].all()):
            return None
        return SampleResult(host[:, 0].long(), host[:, 1].float(), [[] for _ in samplers])
    if not (kernels.is_loaded() and kernels.available()):
        return None
    # the logprob's exp-sum is most of the op's time: only for a client that reads it
    wanted = any(s.params.return_logprobs for s in samplers)
    tokens, logprobs, ok = torch.ops.tokentop.greedy_pick(logits.float().contiguous(), wanted)
    if not bool(ok.all()):
        return None
    return SampleResult(tokens, logprobs, [[] for _ in samplers])


def sample(logits: Tensor, samplers: Sequence[RequestSampler], picked: Tensor | None = None) -> SampleResult:
    """Pick one token per row. A row whose logits are unusable fails alone (result.errors).
    picked: greedy_pick(logits) when already computed on the logits' device."""
    n_rows, dev = len(samplers), logits.device
    if n_rows == 0:
        return SampleResult(torch.empty(0, dtype=torch.int64), torch.empty(0), [])
    fast = _plain_greedy(logits, samplers, picked)
    if fast is not None:
        return fast
    sc = _score(logits, samplers)
    ok = sc.ok.tolist()
    errors = {i: SamplingError(i, _describe_failure(sc.raw[i])) for i in range(n_rows) if not ok[i]}
    tokens = torch.full((n_rows,), -1, dtype=torch.int64, device=dev)

    greedy = [i for i in range(n_rows) if ok[i] and samplers[i].params.greedy]
    if greedy:
        tokens[greedy] = _take(sc.raw, greedy).argmax(dim=-1)   # first maximum: lowest id wins ties
    sampled = [i for i in range(n_rows) if ok[i] and not samplers[i].params.greedy]
    uniforms = {i: samplers[i].uniform() for i in sampled}   # one draw per row, in row order
    for dist in _distributions(sc, sampled, samplers):
        u = torch.tensor([uniforms[i] for i in dist.rows], dtype=torch.float64, device=dev)
        tokens[dist.rows] = dist.token_ids(_inverse_cdf(dist.weights, u))

    log_mass = sc.mass.log().to(sc.scaled.dtype)
    chosen = sc.scaled.gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1) - log_mass
    chosen = torch.where(sc.ok, chosen, float("nan"))

    top: list[list[tuple[int, float]]] = [[] for _ in range(n_rows)]
    asked = [i for i in range(n_rows) if ok[i] and samplers[i].params.logprobs]
    if asked:
        n_max = min(max(samplers[i].params.logprobs for i in asked), sc.scaled.shape[-1])
        vals, ids = _take(sc.scaled, asked).topk(n_max, dim=-1)
        vals = (vals - log_mass[asked].unsqueeze(-1)).tolist()
        for j, (i, row_ids) in enumerate(zip(asked, ids.tolist())):
            n = samplers[i].params.logprobs
            top[i] = list(zip(row_ids[:n], vals[j][:n]))
    return SampleResult(tokens.cpu(), chosen.cpu(), top, errors)


# --- the exact distribution, for speculative decoding (engine/speculative/acceptance.py) ---

def row_scores(logits_row: Tensor, sampler: RequestSampler) -> _Scores:
    """One row's scores (penalties, temperature, exp, mass): what probs_for and the row's
    logprob both start from, computed once when a caller needs both."""
    return _score(logits_row.unsqueeze(0), [sampler])


def probs_for(logits_row: Tensor, sampler: RequestSampler, scores: _Scores | None = None) -> Tensor:
    """The exact distribution sample() draws from for this row: float32 [V], sums to 1.
    scores: row_scores(logits_row, sampler), when the caller has them already.

    Greedy requests give a one-hot at the argmax. Raises SamplingError (row 0) when the
    row has no valid distribution.
    """
    sc = scores if scores is not None else row_scores(logits_row, sampler)
    if not sc.ok.item():
        raise SamplingError(0, _describe_failure(sc.raw[0]))
    probs = torch.zeros(logits_row.shape[-1], dtype=torch.float64, device=logits_row.device)
    if sampler.params.greedy:
        probs[sc.raw[0].argmax()] = 1.0
        return probs.float()
    (dist,) = _distributions(sc, [0], [sampler])
    weights = dist.weights[0].double()
    if dist.ids is None:
        probs = weights
    else:
        probs.scatter_(0, dist.ids[0], weights)
    return (probs / _block_sums(dist.weights).sum()).float()
