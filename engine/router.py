"""Routing whole requests to workers, with every decision recorded and explainable.

Policies:
  round-robin   next live worker in turn
  least-loaded  fewest running + waiting requests (ties: lowest index)
  cost          estimated seconds of work if the request joins the worker:
                  (prefill tokens pending + incoming prompt - reusable prefix) / prefill rate
                + (decode budget pending + incoming max_tokens) / decode rate
                counting running and queued requests. Queued requests keep the prefix
                discount they were routed with (the seeds' accounting bug, avoided).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

POLICIES = ("round-robin", "least-loaded", "cost")


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class RouteDecision:
    request_id: str
    time: float
    policy: str
    chosen: int
    prompt_tokens: int
    max_tokens: int
    candidates: tuple[Candidate, ...]

    def to_json(self) -> dict:
        return {"request_id": self.request_id, "time": self.time, "policy": self.policy,
                "chosen": self.chosen, "prompt_tokens": self.prompt_tokens,
                "max_tokens": self.max_tokens,
                "candidates": [c.__dict__ for c in self.candidates]}


@dataclass
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


class Router:
    def __init__(self, policy: str = "cost"):
        self.set_policy(policy)
        self._next = 0

    def set_policy(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = policy

    def choose(self, request_id: str, prompt_tokens: int, max_tokens: int,
               loads: list[WorkerLoad], cached: dict[int, int] | None = None,
               force: int | None = None) -> RouteDecision:
        live = [w for w in loads if w.alive]
        if not live:
            raise RuntimeError("no live worker to route to")
        cached = cached or {}
        cands = []
        for w in live:
            reuse = min(cached.get(w.worker, 0), max(0, prompt_tokens - 1))
            pre = w.prefill_tokens + prompt_tokens - reuse
            dec = w.decode_tokens + max_tokens
            if self.policy == "cost":
                score = pre / max(w.prefill_rate, 1e-9) + dec / max(w.decode_rate, 1e-9)
            elif self.policy == "least-loaded":
                score = float(w.running + w.waiting)
            else:
                score = 0.0
            cands.append(Candidate(w.worker, w.name, w.running, w.waiting, pre, dec, reuse,
                                   w.prefill_rate, w.decode_rate, score))
        if force is not None:
            chosen = force
        elif self.policy == "round-robin":
            order = sorted(c.worker for c in cands)
            after = [i for i in order if i >= self._next]
            chosen = (after or order)[0]
            self._next = chosen + 1
        else:
            chosen = min(cands, key=lambda c: (c.score, c.worker)).worker
        return RouteDecision(request_id, time.time(), "forced" if force is not None else self.policy,
                             chosen, prompt_tokens, max_tokens, tuple(cands))
