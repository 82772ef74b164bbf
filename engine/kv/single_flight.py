"""Single flight: one request computes a shared prefix page, the others wait for it.

Pages, not whole prompts, are the unit of coordination, which answers the open question
about partial prefixes left by mini-vllm-rs's post "Why My Prefix Cache Missed Identical
Requests": a request waits only while one of *its* uncomputed full prompt pages is being
computed right now by a running request (the leader); once those pages are published it is
admitted, restores them from the cache and computes its own tail. Eight requests sharing an 800-token document with different questions: one computes
the document, seven wait for exactly those pages, then each computes its question.

Modes (`--single-flight`):
  off            never wait (incremental publication alone)
  after-prefill  a follower waits until the pages it needs are published (default)
  at-completion  a follower waits until its leader's request ends (mini-vllm-rs's first policy)

Who is tracked: every request from arrival (`arrive`) to termination (`terminate`); a
termination notice for an id that never arrived, or arrived and already terminated, is an
error. A page leaves the flight when it is published (a request arriving later restores
it instead of waiting); a flight (leader -> its keys) is dropped as soon as it stops
mattering (after-prefill: all its pages published; at-completion: the leader's request
ended; both: the leader was preempted), and released followers are kept apart
from them (`released`) until they terminate, as in mini-vllm-rs's final design. A leader that
is aborted, fails or is preempted drops its flight: its followers are re-examined at the
next scheduling pass and one of them becomes the new leader (or each computes alone).
"""
from __future__ import annotations

MODES = ("off", "after-prefill", "at-completion")


class FlightCoordinator:
    def __init__(self, mode: str = "after-prefill"):
        if mode not in MODES:
            raise ValueError(f"`single_flight` must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self._inflight: dict[bytes, str] = {}       # page key -> running leader computing it
        self._flights: dict[str, list[bytes]] = {}  # leader -> the keys it registered
        self._following: dict[str, str] = {}        # waiting follower -> its leader
        self.released: set[str] = set()             # stopped waiting, not yet terminated
        self._members: set[str] = set()             # arrived, not yet terminated
        self.waits = 0                              # requests that waited on a leader

    # --- membership -------------------------------------------------------------------
    def arrive(self, rid: str) -> None:
        if rid in self._members:
            raise KeyError(f"single flight: request {rid} arrived twice")
        self._members.add(rid)

    def terminate(self, rid: str) -> None:
        if rid not in self._members:
            raise KeyError(f"single flight: termination notice for unknown request {rid}")
        self.stop(rid)
        self._following.pop(rid, None)
        self.released.discard(rid)
        self._members.discard(rid)

    # --- waiting ----------------------------------------------------------------------
    def leader_of(self, rid: str, keys: list[bytes]) -> str | None:
        """The leader `rid` must wait for, given its uncomputed full prompt pages' keys."""
        if self.mode == "off":
            return None
        current = self._following.get(rid)
        if current is not None and self.mode == "at-completion" and current in self._flights:
            return current
        for key in keys:
            leader = self._inflight.get(key)
            if leader is not None and leader != rid:
                return leader
        return None

    def computing(self, key: bytes) -> str | None:
        """The running request computing this page now, if any."""
        return self._inflight.get(key)

    def wait(self, rid: str, leader: str) -> bool:
        """Record rid as following leader; True the first time it starts waiting."""
        new = rid not in self._following
        self._following[rid] = leader
        if new:
            self.waits += 1
            self.released.discard(rid)
        return new

    def release(self, rid: str) -> None:
        if self._following.pop(rid, None) is not None:
            self.released.add(rid)

    def following(self, rid: str) -> str | None:
        return self._following.get(rid)

    @property
    def busy(self) -> bool:
        """Some running request is computing pages others could wait for."""
        return bool(self._inflight)

    @property
    def num_waiting(self) -> int:
        return len(self._following)

    # --- leading ----------------------------------------------------------------------
    def lead(self, rid: str, keys: list[bytes]) -> None:
        """rid was admitted and will compute these pages: later requests wait for them."""
        if self.mode == "off":
            return
        mine = [k for k in keys if k not in self._inflight]
        if not mine:
            return
        for k in mine:
            self._inflight[k] = rid
        self._flights.setdefault(rid, []).extend(mine)

    def published(self, rid: str, keys: list[bytes]) -> None:
        """The pages are reusable now: nobody new needs to wait for them. after-prefill also
        ends the flight when nothing of it is left in flight (its followers may go);
        at-completion keeps it until the leader's request ends."""
        if self.mode == "off" or rid not in self._flights:
            return
        for k in keys:
            if self._inflight.get(k) == rid:
                del self._inflight[k]
        if self.mode == "after-prefill" and not any(self._inflight.get(k) == rid for k in self._flights[rid]):
            del self._flights[rid]

    def stop(self, rid: str) -> None:
        """rid no longer computes its pages (finished, aborted, failed or preempted)."""
        for k in self._flights.pop(rid, ()):
            if self._inflight.get(k) == rid:
                del self._inflight[k]

    def check(self) -> list[str]:
        """Invariant violations (tests): every waiter follows a live flight's leader."""
        problems = []
        for f, leader in self._following.items():
            if f not in self._members:
                problems.append(f"follower {f} already terminated")
        for k, leader in self._inflight.items():
            if leader not in self._flights or leader not in self._members:
                problems.append(f"page in flight for gone leader {leader}")
        return problems
