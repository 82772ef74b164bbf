"""Verify one request's proposal: k + 1 target rows in, the emitted tokens out.

Row j of `logits` is the target's prediction after the pending token and drafts d_1..d_j,
so row j judges d_{j+1} and row k gives the bonus token. p (and q, for a draft model) are
exactly the distributions sample() draws from (sampling.probs_for), with the penalties of
the tokens accepted so far in the round, for any sampling settings the request has.

- greedy: accept while d_{j+1} is the target's argmax; the first mismatch emits the argmax.
- lossless: accept x ~ q with probability min(1, p(x)/q(x)); on a rejection draw from
  normalize(max(p - q, 0)). An n-gram proposal is a point mass q = 1{x}.
- mentored (tv_budget D > 0): the same with π = (1-θ)p + θq, θ = min(1, D / TV(p, q)).
- bonus: when all k are accepted, the target's own token from row k (exactly sample()).

Every emitted token but the last has its K/V written by this step: the caller keeps
len(tokens) positions of the 1 + k it computed (see controller.settle).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.speculative.acceptance import mentored_mix, residual, speculative_accept
from engine.worker.sampling import RequestSampler, draw_from, probs_for, row_scores, sample


@dataclass
class Verdict:
    tokens: list[int]                 # emitted, in order
    logprobs: list[float]             # the target's logprob of each emitted token
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    proposed: int = 0                 # k
    accepted: int = 0                 # leading drafts accepted
    bonus: bool = False               # the last token is the bonus token


def verify(logits: Tensor, drafts: list[int], sampler: RequestSampler, *,
           draft_probs: Tensor | None = None, tv_budget: float = 0.0, bonus: bool = True) -> Verdict:
    """logits: [k+1, V] target rows; draft_probs: [k, V] q of each draft (None = point masses)."""
    k = len(drafts)
    if logits.shape[0] != k + 1:
        raise ValueError(f"{logits.shape[0]} target rows for {k} drafts")
    if sampler.params.greedy and not sampler.has_penalties:
        return _verify_plain_greedy(logits, drafts, sampler, bonus)
    saved = dict(sampler.generated_counts)
    try:
        return _verify_general(logits, drafts, sampler, draft_probs, tv_budget, bonus)
    finally:
        # the worker observes every emitted token itself when it appends them
        sampler.generated_counts = saved
        sampler._penalty_index = None


def _logprob_rows(logits: Tensor, tokens: list[int], sampler: RequestSampler) -> tuple[list[float], list]:
    lp = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device).unsqueeze(-1)).squeeze(-1).tolist()
    top: list = []
    n = sampler.params.logprobs
    if n:
        vals, ids = lp.topk(n, dim=-1)
        top = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return chosen, top


def _verify_plain_greedy(logits: Tensor, drafts: list[int], sampler: RequestSampler, bonus: bool) -> Verdict:
    """Greedy without penalties: one argmax over all rows (sample()'s rule: lowest id on ties)."""
    k = len(drafts)
    best = logits.float().argmax(dim=-1).tolist()
    a = 0
    while a < k and drafts[a] == best[a]:
        a += 1
    if a < k:
        tokens = drafts[:a] + [best[a]]
    else:
        tokens = list(drafts) + ([best[k]] if bonus else [])
    lps, top = _logprob_rows(logits, tokens, sampler)
    return Verdict(tokens, lps, top, k, a, bonus and a == k)


def _verify_general(logits: Tensor, drafts: list[int], sampler: RequestSampler,
                    draft_probs: Tensor | None, tv_budget: float, bonus: bool) -> Verdict:
    k = len(drafts)
    greedy = sampler.params.greedy
    p = sampler.params
    # a model-free draft judged against the whole vocabulary's distribution needs only p(d)
    point_mass = draft_probs is None and tv_budget <= 0 and not p.top_k and p.top_p >= 1.0 and not p.min_p
    tokens: list[int] = []
    lps: list[float] = []
    top: list = []
    for j in range(k + 1):
        row = logits[j]
        if j == k:   # every draft accepted: the target's own next token, exactly as sample() draws it
            if not bonus:
                break
            res = sample(row.unsqueeze(0), [sampler])
            if res.errors:
                raise res.errors[0]
            tok = int(res.tokens[0])
            _push(tokens, lps, top, tok, float(res.logprobs[0]), res.top_logprobs[0] if res.top_logprobs else [])
            return Verdict(tokens, lps, top, k, k, True)
        sc = row_scores(row, sampler)   # shared by p and the emitted token's logprob
        d = drafts[j]
        if point_mass and not greedy:
            ok, replacement = _judge_point_mass(sc, d, sampler)
        else:
            pj = probs_for(row, sampler, sc)
            if greedy:
                ok = bool(pj[d] == 1.0)
                replacement = None if ok else int(pj.argmax())
            else:
                q = draft_probs[j].to(pj.dtype) if draft_probs is not None else _point_mass(pj, d)
                target = mentored_mix(pj, q, tv_budget)[0] if tv_budget > 0 else pj
                ok = bool(speculative_accept(target, q, d, sampler.uniform()))
                replacement = None if ok else int(draw_from(residual(pj, q), sampler.uniform()))
        tok = d if ok else replacement
        lp, tl = _row_logprob(sc, tok, sampler)
        _push(tokens, lps, top, tok, lp, tl)
        if not ok:
            return Verdict(tokens, lps, top, k, j, False)
        sampler.observe(tok)
    return Verdict(tokens, lps, top, k, k, False)


def _push(tokens, lps, top, tok, lp, tl) -> None:
    tokens.append(tok)
    lps.append(lp)
    top.append(list(tl))


def _judge_point_mass(sc, d: int, sampler: RequestSampler) -> tuple[bool, int | None]:
    """The lossless rule for a model-free draft d (q = 1{d}) on an unfiltered row, read from the
    row's scores without building p: accept with probability p(d), else draw from p without d
    (normalize(max(p - q, 0))). The same uniforms as the general path, and its tokens up to
    float rounding; two passes over the vocabulary fewer a row, and none more on acceptance."""
    weights = sc.expd[0]
    if sampler.uniform() < float(weights[d]) / float(sc.mass[0]):
        return True, None
    rest = weights.clone()
    rest[d] = 0.0
    return False, int(draw_from(rest, sampler.uniform()))


def _point_mass(like: Tensor, token: int) -> Tensor:
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q


def _row_logprob(sc, token: int, sampler: RequestSampler) -> tuple[float, list]:
    """Logprob as sample() reports it: after penalties and temperature, before the filters.
    sc: the row's row_scores."""
    lp = sc.scaled[0] - sc.mass[0].log().to(sc.scaled.dtype)
    n = sampler.params.logprobs
    tl: list = []
    if n:
        vals, ids = lp.topk(n)
        tl = list(zip(ids.tolist(), vals.tolist()))
    return float(lp[token]), tl
