"""Requests as the facade keeps them: records, handles, and the load they put on workers.

The table is not locked itself: the facade's lock guards it (engine/facade/engine.py), and the
dispatcher (engine/facade/dispatch.py) takes that lock to apply workers' events to it.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

from engine import messages as msg
from engine.config import SamplingParams
from engine.errors import InvalidRequest, TokentopError
from engine.facade.router import NOMINAL_RATES, WorkerLoad
from engine.facade.snapshot import RequestState

KEEP_FINISHED = 200   # finished requests kept in snapshots
TEXT_TAIL = 2000      # characters of each request's text kept for the dashboard


class RequestFailed(TokentopError):
    """Raised by a handle's iterator/result when its request ended in error."""


@dataclass
class RequestResult:
    id: str
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    error: str | None
    metrics: msg.RequestMetrics | None
    worker: int | None
    notice: str | None = None


@dataclass
class RequestRecord:
    """The facade's account of one request: what was asked, where it runs, what came back."""
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    worker: int | None = None
    state: RequestState = RequestState.QUEUED
    cached_estimate: int = 0
    computed: int = 0
    cached: int = 0
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    messages: tuple | None = None
    finish_reason: str | None = None
    error: str | None = None
    metrics: msg.RequestMetrics | None = None
    burst: str | None = None
    prompt_text: str = ""
    prefill_at: float | None = None        # when the worker was first seen computing it
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    leader: str | None = None       # single flight: waiting for this request's pages
    follow_at: float | None = None  # when the facade first saw it waiting on a leader
    notice: str | None = None      # said once about how the request was taken (max_tokens lowered)
    spec: dict | None = None       # speculative decoding counters, as the worker last sent them
    drafted: list = field(default_factory=list)   # [start, end) of text from accepted drafts
    # worker -> (prompt tokens there, "remote" | "estimate"): remotes serving another model
    prompt_lens: dict = field(default_factory=dict)

    def prompt_len_on(self, worker: int | None) -> int:
        """The prompt's length on `worker` (its own tokenizer's count where it has another model)."""
        return self.prompt_lens.get(worker, (len(self.prompt_ids),))[0]

    def prompt_source_on(self, worker: int | None) -> str:
        """Where that length came from: "local" (our tokenizer), "remote" (its /tokenize), "estimate"."""
        return self.prompt_lens[worker][1] if worker in self.prompt_lens else "local"

    def add_delta(self, d: msg.TokenDelta) -> None:
        """A token and its text, as the worker streamed them; text from accepted drafts is
        marked (the last TEXT_TAIL characters' worth)."""
        if d.token_id >= 0:
            self.output_ids.append(d.token_id)
            self.last_token_at = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = self.last_token_at
        if d.drafted and d.text:
            start = len(self.text)
            if self.drafted and self.drafted[-1][1] == start:
                self.drafted[-1][1] += len(d.text)
            else:
                self.drafted.append([start, start + len(d.text)])
            while self.drafted and self.drafted[0][1] < start - TEXT_TAIL:
                self.drafted.pop(0)
        self.text += d.text
        self.state = RequestState.DECODE

    def finish(self, f: msg.Finished) -> None:
        self.finish_reason, self.error, self.metrics = f.reason, f.error, f.metrics
        if f.metrics is not None and f.metrics.spec is not None:
            self.spec = f.metrics.spec
        self.state = RequestState.of_finish(f.reason)
        self.finished_at = time.monotonic()

    def add_view(self, v: msg.SeqView) -> None:
        """What the worker last reported of it: progress, single flight, speculation, state."""
        self.computed, self.cached, self.leader = v.computed_tokens, v.cached_tokens, v.leader
        if v.leader and self.follow_at is None:
            self.follow_at = time.monotonic()
        self.spec = v.spec
        self.state = RequestState.of_worker(v.state)
        if self.state != RequestState.QUEUED and self.prefill_at is None:
            self.prefill_at = time.monotonic()


class RequestHandle:
    """Streams one request's TokenDelta events; `result()` waits for the end."""

    def __init__(self, record: RequestRecord, abort: Callable[[str], bool]):
        self._abort = abort
        self.id = record.id
        self._record = record
        self._q: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._aq: asyncio.Queue | None = None
        self._lock = threading.Lock()

    # called by the dispatcher thread
    def _deliver(self, event) -> None:
        if isinstance(event, msg.Finished):
            # done before the event is seen: whoever iterated to the end may call result(0)
            self._done.set()
        with self._lock:
            if self._aq is not None:
                self._aloop.call_soon_threadsafe(self._aq.put_nowait, event)
            else:
                self._q.put(event)

    def __iter__(self) -> Iterator[msg.TokenDelta]:
        while True:
            event = self._q.get()
            if isinstance(event, msg.Finished):
                self._raise_if_failed(event)
                return
            yield event

    async def __aiter__(self):
        with self._lock:
            self._aloop = asyncio.get_running_loop()
            self._aq = asyncio.Queue()
            while not self._q.empty():
                self._aq.put_nowait(self._q.get_nowait())
        while True:
            event = await self._aq.get()
            if isinstance(event, msg.Finished):
                self._raise_if_failed(event)
                return
            yield event

    def _raise_if_failed(self, event: msg.Finished) -> None:
        if event.reason == "error":
            raise RequestFailed(event.error or "request failed")

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> RequestResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        r = self._record
        return RequestResult(r.id, r.text, list(r.prompt_ids), list(r.output_ids),
                             r.finish_reason or "error", r.error, r.metrics, r.worker, r.notice)

    @property
    def notice(self) -> str | None:
        """A note on how the request was taken (e.g. max_tokens lowered to the context), or None."""
        return self._record.notice

    def abort(self) -> None:
        self._abort(self.id)



def seen_timings(rec: RequestRecord) -> tuple[float | None, float | None, float | None, None]:
    """(queue time, TTFT, mean ITL, max ITL) as the facade saw them, for a request the
    worker never reported metrics for (it died): the figures it had are kept."""
    queue_time = rec.prefill_at - rec.arrival if rec.prefill_at is not None else None
    ttft = rec.first_token_at - rec.arrival if rec.first_token_at is not None else None
    n = len(rec.output_ids)
    itl = ((rec.last_token_at - rec.first_token_at) / (n - 1)
           if n > 1 and rec.first_token_at is not None and rec.last_token_at is not None else None)
    return queue_time, ttft, itl, None


class RequestTable:
    """Every request the facade knows: live ones, and the last KEEP_FINISHED finished ones."""

    def __init__(self):
        self.records: dict[str, RequestRecord] = {}
        self.handles: dict[str, RequestHandle] = {}
        self._finished: deque[str] = deque()
        # The router's account, kept as records change so that a decision reads it in
        # O(workers), not O(requests): each unfinished routed request's share as last counted
        # (recount), and per worker the sum of the shares: [running, waiting, prefill, decode].
        self._shares: dict[str, tuple[int, int, int, int, int]] = {}
        self._account: dict[int, list[int]] = {}
        self._sizes = [0, 0]   # prompt tokens and max_tokens summed over every record kept

    def add(self, rec: RequestRecord, handle: RequestHandle) -> None:
        self.records[rec.id] = rec
        self.handles[rec.id] = handle
        self._sizes[0] += len(rec.prompt_ids)
        self._sizes[1] += rec.params.max_tokens
        self.recount(rec)

    def recount(self, rec: RequestRecord) -> None:
        """Bring the load account up to date with `rec`: call it after changing what its share
        depends on (worker, state, computed tokens, output, finish)."""
        old = self._shares.pop(rec.id, None)
        if old is not None:
            acct = self._account[old[0]]
            for i in range(4):
                acct[i] -= old[i + 1]
        new = load_share(rec)
        if new is not None:
            self._shares[rec.id] = new
            acct = self._account.setdefault(new[0], [0, 0, 0, 0])
            for i in range(4):
                acct[i] += new[i + 1]

    def get(self, request_id: str) -> RequestRecord | None:
        return self.records.get(request_id)

    def live(self, request_id: str) -> RequestRecord | None:
        """The record, while its request has not finished."""
        rec = self.records.get(request_id)
        return rec if rec is not None and rec.finish_reason is None else None

    # --- what workers report, applied by the dispatcher under the facade's lock --------------
    def on_delta(self, d: msg.TokenDelta) -> bool:
        """A streamed token of a live request; False for one already ended (e.g. tokens a dying
        worker sent after its requests were failed)."""
        rec = self.live(d.request_id)
        if rec is None:
            return False
        rec.add_delta(d)
        self.recount(rec)
        return True

    def on_finished(self, f: msg.Finished) -> RequestRecord | None:
        rec = self.get(f.request_id)
        if rec is not None:
            rec.finish(f)
            self.finished(rec)
        return rec

    def on_view(self, v: msg.SeqView) -> None:
        rec = self.live(v.request_id)
        if rec is not None:
            rec.add_view(v)
            self.recount(rec)

    def move(self, rec: RequestRecord, worker: int) -> None:
        """`rec` queued again, on `worker` (a reroute)."""
        rec.worker, rec.state = worker, RequestState.QUEUED
        self.recount(rec)

    def deliver(self, request_id: str, event) -> None:
        """Wake the handle of `request_id` with `event` (a TokenDelta or its Finished)."""
        handle = self.handles.get(request_id)
        if handle is not None:
            handle._deliver(event)

    def finished(self, rec: RequestRecord) -> None:
        """Count a request as finished; the oldest finished ones beyond KEEP_FINISHED go."""
        self.recount(rec)
        self._finished.append(rec.id)
        while len(self._finished) > KEEP_FINISHED:
            rid = self._finished.popleft()
            gone = self.records.pop(rid, None)
            self.handles.pop(rid, None)
            if gone is not None:
                self._sizes[0] -= len(gone.prompt_ids)
                self._sizes[1] -= gone.params.max_tokens

    def outstanding(self) -> int:
        return sum(r.finish_reason is None for r in self.records.values())

    def open_on(self, worker: int) -> list[str]:
        """Ids of the unfinished requests routed to `worker`."""
        return [r.id for r in self.records.values() if r.worker == worker and r.finish_reason is None]

    def loads(self, workers) -> list[WorkerLoad]:
        """What the router weighs for each worker slot (engine/facade/workers.py): its rates
        and every unfinished request's outstanding work (load_share), from the running account."""
        loads = []
        zero = (0, 0, 0, 0)
        for w in workers:
            pre, dec = w.profile   # (0, 0) when it was not calibrated, e.g. a lone worker
            ld = WorkerLoad(w.index, w.info_or_config().name,
                            pre or NOMINAL_RATES[0], dec or NOMINAL_RATES[1], w.ready,
                            *self._account.get(w.index, zero), not (pre and dec))
            n = w.stats.external_requests if w.stats is not None and w.cfg.remote else 0
            if n:
                # a remote's requests from other clients (its scrape): each weighs as a typical
                # request here (the mean over the records kept), since their sizes are not known
                kept = len(self.records) or 1
                ld.waiting += n
                ld.prefill_tokens += round(n * (self._sizes[0] / kept))
                ld.decode_tokens += round(n * (self._sizes[1] / kept))
            loads.append(ld)
        return loads


def load_share(rec: RequestRecord) -> tuple[int, int, int, int, int] | None:
    """(worker, running, waiting, prefill tokens, decode tokens) one request adds to its
    worker's load: prompt tokens not yet computed (nor expected from the prefix cache) and its
    decode budget left; None once it finished or while it has no worker."""
    if rec.finish_reason is not None or rec.worker is None:
        return None
    queued = rec.state == RequestState.QUEUED
    return (rec.worker, int(not queued), int(queued),
            max(0, rec.prompt_len_on(rec.worker) - max(rec.computed, rec.cached_estimate)),
            max(0, rec.params.max_tokens - len(rec.output_ids)))


def encode_prompt(tokenizer, prompt: str | None, messages: list[dict] | None,
              prompt_ids: list[int] | None, parse_special: bool = False) -> list[int]:
    """A request's prompt token ids from exactly one of text, chat messages or ids."""
    given = sum(x is not None for x in (prompt, messages, prompt_ids))
    if given != 1:
        raise InvalidRequest("give exactly one of a prompt, chat messages or prompt token ids")
    if prompt_ids is not None:
        ids = list(prompt_ids)
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token ids out of range 0..{tokenizer.vocab_size - 1}: {bad[:5]}")
    elif messages is not None:
        ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    else:
        if not isinstance(prompt, str):
            raise InvalidRequest("the prompt must be text")
        if not prompt.strip():
            raise InvalidRequest("the prompt is empty; type some text")
        ids = tokenizer.encode(prompt, parse_special=parse_special)
    if not ids:
        raise InvalidRequest("the prompt encodes to no tokens")
    return ids
