"""Routing whole requests to workers, with every decision recorded and explainable.

Policies:
  round-robin   next live worker in turn
  least-loaded  fewest running + waiting requests (ties: lowest index)
  cost          estimated seconds of work if the request joins the worker:
                  (prefill tokens pending + incoming prompt - reusable prefix) / prefill rate
                + (decode budget pending + incoming max_tokens) / decode rate
                counting running and queued requests. Queued requests keep the prefix
                discount they were routed with (dropping it undercounts their work: the
                accounting bug mini-vllm-rs's heterogeneous-serving post describes).
  cache-aware   the worker with the longest reusable prefix, unless load is imbalanced
                (SGLang's gateway rule: max - min outstanding work above an absolute AND a
                relative threshold), then the least-loaded worker. Outstanding work is in
                seconds (pending tokens over the worker's rates), so a slow worker's queue
                weighs more. Ties, and a miss everywhere, fall back to the cost score: a miss
                goes to the worker that finishes it soonest, not to the emptiest cache.

Reusable prefix: the facade hashes the incoming prompt's page chain the way each worker's
prefix cache does (engine/kv/prefix_cache.py) and counts the leading pages that worker has
published (a key set kept current by its step events). It is an estimate: a page may be
evicted before the request arrives.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from engine.config import check_router_policy


NOMINAL_RATES = (100.0, 10.0)   # prefill, decode tok/s assumed for a worker with no profile yet
BALANCE_ABS_S = 2.0      # cache-aware: imbalanced if max - min outstanding work > 2 s ...
BALANCE_REL = 1.5        # ... and max > 1.5 x min


@dataclass(slots=True)   # not frozen: a decision builds one per live worker, and a frozen init costs 3x
class Candidate:
    worker: int
    name: str
    running: int
    waiting: int
    prefill_tokens: int        # pending prefill work counted, incoming request included
    decode_tokens: int         # pending decode budget counted, incoming request included
    cached_tokens: int         # incoming prompt tokens this worker could reuse
    prefill_rate: float        # tok/s used for the estimate
    decode_rate: float
    score: float               # policy's score; lower is better
    work: float = 0.0          # outstanding seconds before the incoming request
    nominal: bool = False      # the rates are placeholders: the worker has no speed profile yet
    prompt_tokens: int = 0     # the incoming prompt's length on this worker
    prompt_source: str = "local"   # local tokenizer | remote (its /tokenize) | estimate (local count)


@dataclass(frozen=True)
class RouteDecision:
    request_id: str
    time: float
    policy: str
    chosen: int
    prompt_tokens: int
    max_tokens: int
    candidates: tuple[Candidate, ...]
    reason: str = ""           # cache-aware: "longest prefix", "imbalanced", "miss" ...

    def to_json(self) -> dict:
        return {"request_id": self.request_id, "time": self.time, "policy": self.policy,
                "chosen": self.chosen, "prompt_tokens": self.prompt_tokens,
                "max_tokens": self.max_tokens, "reason": self.reason,
                "candidates": [asdict(c) for c in self.candidates]}

    @property
    def chosen_reuse(self) -> int:
        return next((c.cached_tokens for c in self.candidates if c.worker == self.chosen), 0)


@dataclass(slots=True)
class WorkerLoad:
    """The facade's running account of one worker's outstanding work."""
    worker: int
    name: str
    prefill_rate: float
    decode_rate: float
    alive: bool = True
    running: int = 0
    waiting: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    nominal: bool = False      # no measured profile: the rates are NOMINAL_RATES


class Router:
    def __init__(self, policy: str = "cost", balance_abs: float = BALANCE_ABS_S,
                 balance_rel: float = BALANCE_REL):
        self.set_policy(policy)
        self._next = 0
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel

    def set_policy(self, policy: str) -> None:
        self.policy = check_router_policy(policy)

    def choose(self, request_id: str, prompt_tokens: int, max_tokens: int,
               loads: list[WorkerLoad], cached: dict[int, int] | None = None,
               force: int | None = None,
               prompt_lens: dict[int, tuple[int, str]] | None = None) -> RouteDecision:
        """prompt_lens: worker -> (prompt tokens, source) where a worker counts the prompt with
        another tokenizer (a remote serving another model); the others count prompt_tokens."""
        live = [w for w in loads if w.alive]
        if not live:
            raise RuntimeError("no live worker to route to")
        cached = cached or {}
        prompt_lens = prompt_lens or {}
        by_cost, by_count = self.policy in ("cost", "cache-aware"), self.policy == "least-loaded"
        local = (prompt_tokens, "local")
        cands = []
        for w in live:
            n_prompt, source = prompt_lens.get(w.worker, local) if prompt_lens else local
            reuse = cached.get(w.worker, 0)
            if reuse:
                reuse = min(reuse, max(0, n_prompt - 1))
            pre = w.prefill_tokens + n_prompt - reuse
            dec = w.decode_tokens + max_tokens
            pre_rate, dec_rate = max(w.prefill_rate, 1e-9), max(w.decode_rate, 1e-9)
            work = w.prefill_tokens / pre_rate + w.decode_tokens / dec_rate
            if by_cost:
                score = pre / pre_rate + dec / dec_rate
            elif by_count:
                score = float(w.running + w.waiting)
            else:
                score = 0.0
            cands.append(Candidate(w.worker, w.name, w.running, w.waiting, pre, dec, reuse,
                                   w.prefill_rate, w.decode_rate, score, work, w.nominal, n_prompt, source))
        reason = ""
        if force is not None:
            chosen = force
        elif self.policy == "round-robin":
            order = sorted(c.worker for c in cands)
            after = [i for i in order if i >= self._next]
            chosen = (after or order)[0]
            self._next = chosen + 1
        elif self.policy == "cache-aware":
            chosen, reason = self._cache_aware(cands)
        else:
            chosen = min(cands, key=lambda c: (c.score, c.worker)).worker
        return RouteDecision(request_id, time.time(), "forced" if force is not None else self.policy,
                             chosen, prompt_tokens, max_tokens, tuple(cands), reason)

    def _cache_aware(self, cands: list[Candidate]) -> tuple[int, str]:
        hi = max(c.work for c in cands)
        lo = min(c.work for c in cands)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return min(cands, key=lambda c: (c.work, -c.cached_tokens, c.worker)).worker, "imbalanced"
        best = max(c.cached_tokens for c in cands)
        if best == 0:
            return min(cands, key=lambda c: (c.score, c.worker)).worker, "miss"
        return min((c for c in cands if c.cached_tokens == best),
                   key=lambda c: (c.score, c.worker)).worker, "longest prefix"


def reusable_prefix_tokens(ids: list[int], salt: str | None, live: list) -> dict[int, int]:
    """Prompt tokens each ready worker (slots, engine/facade/workers.py) could restore from its
    prefix cache: the leading pages of the prompt's hash chain it published. The chain is hashed
    once per model identity and page size, and each worker's count stops at its first miss."""
    # imported here: it imports torch (see engine/__init__.py)
    from engine.kv.prefix_cache import DELTA_KEY_BYTES, chain_keys, extra_key

    chains: dict[tuple, list[bytes]] = {}
    out = {}
    for w in live:
        keys = w.cache_keys
        if not keys or w.info.prefix_cache != "on":
            continue
        ps = w.info.page_size
        chain = chains.get((w.cache_ident, ps))
        if chain is None:
            full = chain_keys(ids, ps, extra_key(w.cache_ident, salt), (len(ids) - 1) // ps)
            chain = chains[w.cache_ident, ps] = [k[:DELTA_KEY_BYTES] for k in full]
        n = 0
        for key in chain:
            if key not in keys:
                break
            n += 1
        out[w.index] = n * ps
    return out
