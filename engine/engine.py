"""The Engine facade: submit, stream, abort, snapshot, policies, traces.

Threads and processes: each worker runs in its own process (default) or thread. The facade
owns one dispatcher thread that reads the shared event queue, updates request records and
wakes the request handles. Public methods are thread-safe (one lock, never held while
waiting on a queue or a worker).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing as mp
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from engine import messages as msg
from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.errors import ConfigError, InvalidRequest, TokentopError, WorkerDied
from engine.router import RouteDecision, Router, WorkerLoad
from engine.snapshot import EngineSnapshot, LogLine, RequestView, WorkerView

HISTORY = 60          # samples of tok/s kept per worker for sparklines
TEXT_TAIL = 2000      # characters of each request's text kept for the dashboard
KEEP_FINISHED = 200   # finished requests kept in snapshots


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


@dataclass
class _Record:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    worker: int | None = None
    state: str = "queued"
    cached_estimate: int = 0
    computed: int = 0
    cached: int = 0
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    metrics: msg.RequestMetrics | None = None
    burst: str | None = None
    first_token_at: float | None = None
    finished_at: float | None = None


class RequestHandle:
    """Streams one request's TokenDelta events; `result()` waits for the end."""

    def __init__(self, engine: "Engine", record: _Record):
        self._engine = engine
        self.id = record.id
        self._record = record
        self._q: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._aq: asyncio.Queue | None = None
        self._lock = threading.Lock()

    # called by the dispatcher thread
    def _deliver(self, event) -> None:
        with self._lock:
            if self._aq is not None:
                self._aloop.call_soon_threadsafe(self._aq.put_nowait, event)
            else:
                self._q.put(event)
        if isinstance(event, msg.Finished):
            self._done.set()

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
                             r.finish_reason or "error", r.error, r.metrics, r.worker)

    def abort(self) -> None:
        self._engine.abort(self.id)


@dataclass
class _WorkerSlot:
    index: int
    cfg: WorkerConfig
    commands: object
    process: object = None
    state: str = "starting"
    message: str = ""
    info: dict = field(default_factory=dict)
    stats: msg.WorkerStats | None = None
    prefill_hist: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    decode_hist: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    profile: tuple[float, float] = (0.0, 0.0)


class Engine:
    def __init__(self, config: EngineConfig, *, progress: Callable[[str, int, int], None] | None = None):
        if not config.workers:
            raise ConfigError("at least one --device is needed")
        if config.worker_mode not in ("process", "thread"):
            raise ConfigError(f"--worker-mode must be process or thread, got {config.worker_mode!r}")
        self.config = config
        self.router = Router(config.router_policy)
        self._progress = progress
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._records: dict[str, _Record] = {}
        self._handles: dict[str, RequestHandle] = {}
        self._finished: deque[str] = deque()
        self._routing: deque[RouteDecision] = deque(maxlen=50)
        self._log: deque[LogLine] = deque(maxlen=200)
        self._workers: list[_WorkerSlot] = []
        self._events = None
        self._dispatcher: threading.Thread | None = None
        self._stopping = False
        self._trace_wait: dict[int, list] = {}
        self._trace_cv = threading.Condition(self._lock)
        self.tracing = bool(config.trace_dir)
        self.tokenizer = None
        self._routing_log = open(config.routing_log, "a") if config.routing_log else None
        self._tracer = None

    # --- lifecycle ----------------------------------------------------------------------
    def start(self, wait: bool = True, timeout: float = 600.0) -> "Engine":
        from engine.devices import check_memory
        from engine.models.catalog import resolve_model
        from engine.models.tokenizer import Tokenizer
        from engine.trace import Tracer

        self._tracer = Tracer("engine", enabled=self.tracing)
        paths = {}
        for cfg in self.config.workers:
            if cfg.model not in paths:
                cb = (lambda done, total, name=cfg.model: self._progress(name, done, total)) \
                    if self._progress else None
                paths[cfg.model] = str(resolve_model(cfg.model, progress=cb))
        check_memory(self.config.workers, paths)
        self.tokenizer = Tokenizer.from_gguf(paths[self.config.workers[0].model])
        ctx = mp.get_context("spawn")
        if self.config.worker_mode == "process":
            self._events = ctx.Queue()
        else:
            self._events = queue.Queue()
        for i, cfg in enumerate(self.config.workers):
            if self.config.worker_mode == "process":
                commands = ctx.Queue()
                proc = ctx.Process(target=_worker_entry, name=f"tokentop-worker-{i}",
                                   args=(i, cfg, paths[cfg.model], commands, self._events,
                                         self.tracing, self.config.worker_log), daemon=True)
            else:
                commands = queue.Queue()
                proc = threading.Thread(target=_worker_entry, name=f"tokentop-worker-{i}",
                                        args=(i, cfg, paths[cfg.model], commands, self._events,
                                              self.tracing), daemon=True)
            slot = _WorkerSlot(i, cfg, commands, proc)
            if cfg.simulated:
                slot.profile = (cfg.sim_prefill_tps, cfg.sim_decode_tps)
            self._workers.append(slot)
            proc.start()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="tokentop-dispatch",
                                            daemon=True)
        self._dispatcher.start()
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                states = [w.state for w in self._workers]
            if all(s in ("ready", "dead") for s in states):
                break
            time.sleep(0.02)
        with self._lock:
            if all(w.state == "dead" for w in self._workers):
                reasons = "; ".join(f"worker {w.index} ({w.cfg.device}): {w.message}" for w in self._workers)
                raise TokentopError(f"no worker could start: {reasons}")

    @property
    def ready(self) -> bool:
        with self._lock:
            return any(w.state == "ready" for w in self._workers)

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        for w in self._workers:
            if w.state not in ("dead",):
                try:
                    w.commands.put(msg.Stop())
                except Exception:
                    pass
        deadline = time.monotonic() + timeout
        for w in self._workers:
            if w.process is not None:
                w.process.join(max(0.0, deadline - time.monotonic()))
                if isinstance(w.process, mp.process.BaseProcess) and w.process.is_alive():
                    w.process.terminate()
        if self._dispatcher is not None:
            self._dispatcher.join(1.0)
        if self._routing_log:
            self._routing_log.close()

    def __enter__(self) -> "Engine":
        return self.start() if not self._workers else self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # --- requests -----------------------------------------------------------------------
    def submit(self, prompt: str | None = None, *, messages: list[dict] | None = None,
               params: SamplingParams | None = None, prompt_ids: list[int] | None = None,
               worker: int | None = None, burst: str | None = None) -> RequestHandle:
        """Queue one request. Bad input raises InvalidRequest and queues nothing."""
        params = (params or SamplingParams()).validate()
        ids = self.encode(prompt, messages, prompt_ids)
        now = time.monotonic()
        with self._lock:
            live = [w for w in self._workers if w.state == "ready"]
            if not live:
                raise InvalidRequest("no worker is ready yet (still loading, or all workers died)")
            max_ctx = max(w.info.get("max_context", 0) for w in live)
            if len(ids) + 1 > max_ctx:
                raise InvalidRequest(f"prompt has {len(ids)} tokens but the context is {max_ctx} tokens; "
                                     "shorten the prompt or raise --max-context")
            if worker is not None and worker not in [w.index for w in live]:
                raise InvalidRequest(f"worker {worker} is not ready")
            rid = f"r{next(self._ids)}"
            rec = _Record(rid, ids, params, now, burst=burst)
            decision = self.router.choose(rid, len(ids), params.max_tokens, self._loads(),
                                          cached=None, force=worker)
            rec.worker = decision.chosen
            self._routing.append(decision)
            if self._routing_log:
                self._routing_log.write(json.dumps(decision.to_json()) + "\n")
                self._routing_log.flush()
            handle = RequestHandle(self, rec)
            self._records[rid] = rec
            self._handles[rid] = handle
            slot = self._workers[decision.chosen]
        if self._tracer is not None and self._tracer.enabled:
            self._tracer.instant("route", request=rid, chosen=decision.chosen, policy=decision.policy,
                                 scores={c.worker: round(c.score, 4) for c in decision.candidates})
        slot.commands.put(msg.Submit(rid, tuple(ids), params, now))
        return handle

    def encode(self, prompt: str | None, messages: list[dict] | None,
               prompt_ids: list[int] | None) -> list[int]:
        given = sum(x is not None for x in (prompt, messages, prompt_ids))
        if given != 1:
            raise InvalidRequest("give exactly one of a prompt, chat messages or prompt token ids")
        if prompt_ids is not None:
            ids = list(prompt_ids)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.tokenizer.vocab_size]
            if bad:
                raise InvalidRequest(f"prompt token ids out of range 0..{self.tokenizer.vocab_size - 1}: {bad[:5]}")
        elif messages is not None:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ids = self.tokenizer.encode(text, add_special=False)
        else:
            if not isinstance(prompt, str):
                raise InvalidRequest("the prompt must be text")
            if not prompt.strip():
                raise InvalidRequest("the prompt is empty; type some text")
            ids = self.tokenizer.encode(prompt)
        if not ids:
            raise InvalidRequest("the prompt encodes to no tokens")
        return ids

    def generate(self, prompt: str | None = None, **kw) -> RequestResult:
        """Submit and wait: the simple blocking call."""
        return self.submit(prompt, **kw).result()

    def abort(self, request_id: str) -> bool:
        with self._lock:
            rec = self._records.get(request_id)
            if rec is None or rec.finish_reason is not None or rec.worker is None:
                return False
            slot = self._workers[rec.worker]
        slot.commands.put(msg.Abort(request_id))
        return True

    def _loads(self) -> list[WorkerLoad]:
        loads = {w.index: WorkerLoad(w.index, w.info.get("name", w.cfg.device),
                                     *self._rates(w), alive=w.state == "ready")
                 for w in self._workers}
        for rec in self._records.values():
            if rec.finish_reason is not None or rec.worker is None:
                continue
            load = loads[rec.worker]
            if rec.state == "queued":
                load.waiting += 1
            else:
                load.running += 1
            load.prefill_tokens += max(0, len(rec.prompt_ids) - max(rec.computed, rec.cached_estimate))
            load.decode_tokens += max(0, rec.params.max_tokens - len(rec.output_ids))
        return list(loads.values())

    def _measured_rates(self, w: _WorkerSlot) -> tuple[float, float]:
        """The worker's profile (0 when it was not calibrated, e.g. a lone worker)."""
        pre, dec = w.profile
        return (pre or w.info.get("profile_prefill_tps", 0.0), dec or w.info.get("profile_decode_tps", 0.0))

    def _rates(self, w: _WorkerSlot) -> tuple[float, float]:
        # without a profile the cost router still needs numbers: nominal rates, never shown
        pre, dec = self._measured_rates(w)
        return pre or 100.0, dec or 10.0

    # --- policies -----------------------------------------------------------------------
    def set_scheduler_policy(self, policy: str, worker: int | None = None) -> None:
        from engine.scheduler import POLICIES
        if policy not in POLICIES:
            raise ConfigError(f"unknown scheduler policy {policy!r}; choose one of {', '.join(POLICIES)}")
        for w in self._workers:
            if worker is None or w.index == worker:
                w.commands.put(msg.SetPolicy(policy))
        self._log_line("info", f"scheduler policy -> {policy}")

    def set_router_policy(self, policy: str) -> None:
        with self._lock:
            self.router.set_policy(policy)
        self._log_line("info", f"router policy -> {policy}")

    def set_worker_profile(self, index: int, prefill_tps: float, decode_tps: float) -> None:
        with self._lock:
            self._workers[index].profile = (prefill_tps, decode_tps)

    # --- dispatcher ---------------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        while True:
            try:
                event = self._events.get(timeout=0.2)
            except queue.Empty:
                event = None
            except (EOFError, OSError):
                return
            if event is not None:
                self._on_event(event)
            self._check_liveness()
            if self._stopping and all(not _alive(w.process) for w in self._workers):
                try:
                    while True:
                        self._on_event(self._events.get_nowait())
                except (queue.Empty, EOFError, OSError):
                    pass
                return

    def _check_liveness(self) -> None:
        for w in self._workers:
            if w.state in ("dead", "stopped") or _alive(w.process):
                continue
            if self._stopping:
                w.state = "stopped"
                continue
            code = getattr(w.process, "exitcode", None)
            self._on_event(msg.WorkerDead(w.index, f"worker process exited (exit code {code})"))

    def _on_event(self, event) -> None:
        if isinstance(event, msg.StepEvents):
            self._on_step(event)
        elif isinstance(event, msg.WorkerStats):
            self._on_stats(event)
        elif isinstance(event, msg.WorkerReady):
            with self._lock:
                w = self._workers[event.worker]
                w.state, w.info, w.message = "ready", event.info, ""
            kernels = f"; linear layers: {event.info['kernels']}" if event.info.get("kernels") else ""
            self._log_line("info", f"worker {event.worker} ({w.cfg.device}) ready: {event.info.get('pages')} "
                                   f"KV pages of {event.info.get('page_size')} tokens{kernels}")
        elif isinstance(event, msg.WorkerLoading):
            with self._lock:
                w = self._workers[event.worker]
                w.state, w.message = "loading", event.message
        elif isinstance(event, msg.WorkerDead):
            self._on_dead(event)
        elif isinstance(event, msg.TraceEvents):
            with self._trace_cv:
                self._trace_wait[event.worker] = event.events
                self._trace_cv.notify_all()

    def _on_step(self, event: msg.StepEvents) -> None:
        deliveries = []
        with self._lock:
            for d in event.tokens:
                rec = self._records.get(d.request_id)
                if rec is None:
                    continue
                if d.token_id >= 0:
                    rec.output_ids.append(d.token_id)
                    if rec.first_token_at is None:
                        rec.first_token_at = time.monotonic()
                rec.text += d.text
                rec.state = "decode"
                deliveries.append((rec.id, d))
            for f in event.finished:
                rec = self._records.get(f.request_id)
                if rec is None:
                    continue
                rec.finish_reason, rec.error, rec.metrics = f.reason, f.error, f.metrics
                rec.state = {"error": "error", "abort": "aborted"}.get(f.reason, "finished")
                rec.finished_at = time.monotonic()
                self._finished.append(rec.id)
                deliveries.append((rec.id, f))
                if f.reason == "error":
                    self._log_line("error", f"{rec.id}: {f.error}", locked=True)
                self._trace_lifecycle(rec, f.metrics)
            for rid in event.preempted:
                self._log_line("warning", f"{rid} preempted on worker {event.worker} (will recompute)",
                               locked=True)
            self._forget_old()
        for rid, d in deliveries:
            handle = self._handles.get(rid)
            if handle is not None:
                handle._deliver(d)

    def _on_stats(self, s: msg.WorkerStats) -> None:
        with self._lock:
            w = self._workers[s.worker]
            w.stats = s
            w.prefill_hist.append(s.prefill_tps)
            w.decode_hist.append(s.decode_tps)
            for v in s.seqs:
                rec = self._records.get(v.request_id)
                if rec is None or rec.finish_reason is not None:
                    continue
                rec.computed, rec.cached = v.computed_tokens, v.cached_tokens
                rec.state = {"waiting": "queued"}.get(v.state, v.state)

    def _on_dead(self, event: msg.WorkerDead) -> None:
        failed = []
        with self._lock:
            w = self._workers[event.worker]
            if w.state == "dead":
                return
            w.state, w.message = "dead", event.message.splitlines()[0] if event.message else "died"
            for rec in self._records.values():
                if rec.worker == event.worker and rec.finish_reason is None:
                    failed.append(rec.id)
            self._log_line("error", f"worker {event.worker} ({w.cfg.device}) died: {w.message}; "
                                    f"{len(failed)} request(s) failed", locked=True)
        for rid in failed:
            rec = self._records[rid]
            err = WorkerDied(f"worker {event.worker} ({w.cfg.device}) died: {w.message}")
            metrics = msg.RequestMetrics(len(rec.prompt_ids), rec.cached, len(rec.output_ids), None,
                                         None, None, None, time.monotonic() - rec.arrival)
            self._on_step(msg.StepEvents(event.worker, (), (msg.Finished(rid, "error", str(err), metrics),)))

    def _forget_old(self) -> None:
        while len(self._finished) > KEEP_FINISHED:
            rid = self._finished.popleft()
            self._records.pop(rid, None)
            self._handles.pop(rid, None)

    def _log_line(self, level: str, text: str, locked: bool = False) -> None:
        line = LogLine(time.time(), level, text)
        if locked:
            self._log.append(line)
        else:
            with self._lock:
                self._log.append(line)

    def log(self, level: str, text: str) -> None:
        """Let the UI add a line (e.g. a burst summary) to the engine's event log."""
        self._log_line(level, text)

    # --- snapshot -----------------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        now = time.monotonic()
        with self._lock:
            workers = tuple(self._worker_view(w) for w in self._workers)
            reqs = tuple(self._request_view(r, now) for r in self._records.values())
            return EngineSnapshot(time.time(), workers, reqs, tuple(self._routing),
                                  self.router.policy, tuple(self._log), self.tracing)

    def _worker_view(self, w: _WorkerSlot) -> WorkerView:
        s, info = w.stats, w.info
        pre, dec = self._measured_rates(w)
        return WorkerView(
            index=w.index, name=info.get("name", w.cfg.name or w.cfg.device), device=w.cfg.device,
            model=w.cfg.model, dtype=info.get("dtype", "?"), weights=info.get("weights", "?"),
            simulated=w.cfg.simulated, state=w.state, message=w.message,
            running=s.running if s else 0, waiting=s.waiting if s else 0,
            prefill_tps=s.prefill_tps if s else 0.0, decode_tps=s.decode_tps if s else 0.0,
            prefill_history=tuple(w.prefill_hist), decode_history=tuple(w.decode_hist),
            pages_total=s.pages_total if s else info.get("pages", 0), pages_used=s.pages_used if s else 0,
            page_states=s.page_states if s else bytes(info.get("pages", 0)),
            page_size=info.get("page_size", w.cfg.page_size), policy=s.policy if s else w.cfg.policy,
            steps=s.steps if s else 0, profile_prefill_tps=pre, profile_decode_tps=dec,
            max_active=w.cfg.max_active)

    def _request_view(self, r: _Record, now: float) -> RequestView:
        m = r.metrics
        end = r.finished_at or now
        return RequestView(
            id=r.id, worker=r.worker, state=r.state, prompt_tokens=len(r.prompt_ids),
            cached_tokens=m.cached_tokens if m else r.cached, output_tokens=len(r.output_ids),
            max_tokens=r.params.max_tokens, queue_time=m.queue_time if m else None,
            ttft=m.ttft if m else (r.first_token_at - r.arrival if r.first_token_at else None),
            itl_mean=m.itl_mean if m else None, e2e=m.e2e if m else end - r.arrival,
            text_tail=r.text[-TEXT_TAIL:], error=r.error, burst=r.burst, age=now - r.arrival)

    # --- traces -------------------------------------------------------------------------
    def set_tracing(self, enabled: bool) -> None:
        self.tracing = enabled
        if self._tracer is not None:
            self._tracer.set_enabled(enabled)
        for w in self._workers:
            if w.state == "ready":
                w.commands.put(msg.SetTracing(enabled))

    def _trace_lifecycle(self, rec: _Record, m: msg.RequestMetrics | None) -> None:
        if self._tracer is None or not self._tracer.enabled or m is None:
            return
        t0 = rec.arrival
        marks = [("queued", t0)]
        if m.queue_time is not None:
            marks.append(("prefill", t0 + m.queue_time))
        if m.ttft is not None:
            marks.append(("decode", t0 + m.ttft))
        end = {"abort": "aborted", "error": "failed"}.get(rec.finish_reason or "", "finished")
        marks.append((end, t0 + m.e2e))
        # time.monotonic and the tracer's perf_counter_ns are both CLOCK_MONOTONIC on Linux
        for phase, t in marks:
            self._tracer.request_phase(rec.id, phase, ts_ns=int(t * 1e9), worker=rec.worker)

    def export_trace(self, path: str | Path | None = None, timeout: float = 5.0) -> Path:
        """Collect every worker's trace events plus the facade's and write one Chrome JSON file."""
        from engine.trace import write_chrome_trace

        target = path or self.config.trace_dir or "traces"
        with self._trace_cv:
            self._trace_wait.clear()
            ready = [w for w in self._workers if w.state == "ready"]
        for w in ready:
            w.commands.put(msg.DrainTrace())
        deadline = time.monotonic() + timeout
        with self._trace_cv:
            while len(self._trace_wait) < len(ready) and time.monotonic() < deadline:
                self._trace_cv.wait(0.1)
            events = [e for evs in self._trace_wait.values() for e in evs]
        if self._tracer is not None:
            events += self._tracer.drain()
        return write_chrome_trace(target, events)


def _alive(proc) -> bool:
    return proc is not None and proc.is_alive()


def _worker_entry(index, cfg, model_path, commands, events, tracing, log_path=None) -> None:
    from engine.trace import Tracer, set_tracer
    from engine.worker import worker_main

    if log_path:   # a worker process must not draw over the dashboard's terminal
        import os
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    # NVTX ranges for Nsight on CUDA workers; the Chrome trace is separate and off by default
    tracer = Tracer(f"worker {index} ({cfg.device})", enabled=tracing, nvtx=cfg.device.startswith("cuda"))
    set_tracer(tracer)
    tracer.set_thread_name("worker loop")
    worker_main(index, cfg, model_path, commands, events)
