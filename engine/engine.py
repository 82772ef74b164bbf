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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

from engine import messages as msg
from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.errors import ConfigError, InvalidRequest, TokentopError, WorkerDied
from engine.procstat import UsageSampler
from engine.router import RouteDecision, Router, WorkerLoad
from engine.snapshot import EngineSnapshot, LogLine, RequestView, WorkerView

HISTORY = 60          # samples of tok/s kept per worker for sparklines
TEXT_TAIL = 2000      # characters of each request's text kept for the dashboard
KEEP_FINISHED = 200   # finished requests kept in snapshots
HIT_WINDOW = 150      # WorkerStats samples (~30 s at 5 Hz) behind a worker's prefix hit rate
UNWRITTEN_TRACE_EVENTS = 2_000_000   # most trace events kept after a failed export
LOG_GROUP_WINDOW = 5.0   # seconds: the same event again within this is counted on one log line


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
    spec_hist: deque = field(default_factory=lambda: deque(maxlen=HISTORY))   # acceptance per report
    spec_seen: tuple[int, int] = (0, 0)      # (draft tokens, accepted) at the last report
    cache_keys: set = field(default_factory=set)          # 8-byte prefixes of published pages
    prefix_hist: deque = field(default_factory=lambda: deque(maxlen=HIT_WINDOW))


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
        self.spec_mode = ""   # speculation of new requests that do not choose: "" = the workers' default
        self._records: dict[str, _Record] = {}
        self._handles: dict[str, RequestHandle] = {}
        self._finished: deque[str] = deque()
        self._routing: deque[RouteDecision] = deque(maxlen=50)
        self._log: deque[LogLine] = deque(maxlen=200)
        self._log_groups: dict[tuple, tuple[float, int, LogLine]] = {}   # key -> first, count, line
        self._workers: list[_WorkerSlot] = []
        self._events = None
        self._dispatcher: threading.Thread | None = None
        self._stopping = False
        self._trace_wait: dict[int, list] = {}
        self._trace_cv = threading.Condition(self._lock)
        self._unwritten_trace: list = []   # events of an export that failed, kept for the next one
        self.tracing = bool(config.trace_dir)
        self.tokenizer = None
        self._routing_log = open(config.routing_log, "a") if config.routing_log else None
        self._tracer = None
        self._trace_since = time.monotonic() if self.tracing else None   # start of the trace window
        self._started_at: float | None = None
        self._usage = UsageSampler()
        self._observers: list[Callable[[str, object], None]] = []

    # --- lifecycle ----------------------------------------------------------------------
    def start(self, wait: bool = True, timeout: float = 600.0) -> "Engine":
        from engine.devices import check_memory, check_model_limits
        from engine.models.catalog import resolve_model
        from engine.models.tokenizer import Tokenizer
        from engine.trace import Tracer, check_trace_dir

        if self.config.trace_dir:   # before any work: not a crash once the work is done
            check_trace_dir(self.config.trace_dir)
        self._tracer = Tracer("engine", enabled=self.tracing)
        self._started_at = time.monotonic()
        paths = {}
        for cfg in self.config.workers:
            if cfg.model not in paths:
                cb = (lambda done, total, name=cfg.model: self._progress(name, done, total)) \
                    if self._progress else None
                paths[cfg.model] = str(resolve_model(cfg.model, progress=cb))
            if cfg.draft_model and cfg.draft_model not in paths:   # assembled here, once
                paths[cfg.draft_model] = str(resolve_model(cfg.draft_model))
        check_model_limits(self.config.workers, paths)
        check_memory(self.config.workers, paths)
        self.tokenizer = Tokenizer.from_gguf(paths[self.config.workers[0].model])
        ctx = mp.get_context("spawn")
        if self.config.worker_mode == "process":
            self._events = ctx.Queue()
        else:
            self._events = queue.Queue()
        for i, cfg in enumerate(self.config.workers):
            if cfg.remote:      # forwarding needs no process of its own: a thread of I/O
                from engine.remote import remote_worker_main
                commands = queue.Queue()
                proc = threading.Thread(target=remote_worker_main, name=f"tokentop-remote-{i}",
                                        args=(i, cfg, paths[cfg.model], commands, self._events), daemon=True)
            elif self.config.worker_mode == "process":
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
            if all(s in ("ready", "dead", "down") for s in states):
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
               worker: int | None = None, burst: str | None = None,
               parse_special: bool = False, cache_salt: str | None = None) -> RequestHandle:
        """Queue one request. Bad input raises InvalidRequest and queues nothing.
        A special token spelled in a plain prompt is plain text unless parse_special (trusted
        prompts only); in chat messages it is always plain text. cache_salt (or
        params.cache_salt): requests share cached KV pages only with the same salt."""
        params = params or SamplingParams()
        if cache_salt is not None:
            params = replace(params, cache_salt=cache_salt)
        params = params.validate()
        if not params.speculate and self.spec_mode:   # the dashboard's choice for new requests
            params = replace(params, speculate=self.spec_mode)
        ids = self.encode(prompt, messages, prompt_ids, parse_special=parse_special)
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
            notice = None
            room = max_ctx - len(ids)   # the last token sampled needs no KV: context - prompt
            if params.max_tokens > room:
                # clamp, and say so once: the record, the router and the table see the real limit
                notice = (f"max_tokens {params.max_tokens} lowered to {room}: the {len(ids)}-token prompt "
                          f"leaves {room} of the {max_ctx}-token context (--max-context, --kv-cache-memory)")
                self._log_repeated(("max_tokens lowered",), "warning",
                                   f"{rid}: {notice}{{times}}")
                params = replace(params, max_tokens=room)
            rec = _Record(rid, ids, params, now, burst=burst, notice=notice,
                          messages=tuple(messages) if messages is not None else None,
                          prompt_text=prompt if isinstance(prompt, str) else self.tokenizer.decode(ids))
            decision = self.router.choose(rid, len(ids), params.max_tokens, self._loads(),
                                          cached=self._reuse_estimates(ids, params.cache_salt, live),
                                          force=worker)
            rec.worker = decision.chosen
            rec.cached_estimate = decision.chosen_reuse
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
                                 reason=decision.reason,
                                 scores={c.worker: round(c.score, 4) for c in decision.candidates},
                                 reuse={c.worker: c.cached_tokens for c in decision.candidates})
        slot.commands.put(msg.Submit(rid, tuple(ids), params, now,
                                     rec.messages if slot.cfg.remote else None))
        self._notify("route", decision)
        return handle

    def _reuse_estimates(self, ids: list[int], salt: str | None, live: list[_WorkerSlot]) -> dict[int, int]:
        """Prompt tokens each worker could restore: its published keys vs the prompt's chain."""
        from engine.kv.prefix_cache import DELTA_KEY_BYTES, chain_keys, extra_key, model_identity

        chains: dict[tuple, list[bytes]] = {}
        out = {}
        for w in live:
            if w.info.get("prefix_cache") != "on" or not w.cache_keys:
                continue
            cfg, ps = w.cfg, w.info.get("page_size", w.cfg.page_size)
            ident = model_identity(cfg.model, cfg.weights, cfg.activation_dtype, cfg.simulated)
            if (ident, ps) not in chains:
                chains[ident, ps] = chain_keys(ids, ps, extra_key(ident, salt), (len(ids) - 1) // ps)
            n = 0
            for key in chains[ident, ps]:
                if key[:DELTA_KEY_BYTES] not in w.cache_keys:
                    break
                n += 1
            out[w.index] = n * ps
        return out

    def encode(self, prompt: str | None, messages: list[dict] | None,
               prompt_ids: list[int] | None, parse_special: bool = False) -> list[int]:
        given = sum(x is not None for x in (prompt, messages, prompt_ids))
        if given != 1:
            raise InvalidRequest("give exactly one of a prompt, chat messages or prompt token ids")
        if prompt_ids is not None:
            ids = list(prompt_ids)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.tokenizer.vocab_size]
            if bad:
                raise InvalidRequest(f"prompt token ids out of range 0..{self.tokenizer.vocab_size - 1}: {bad[:5]}")
        elif messages is not None:
            ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True)
        else:
            if not isinstance(prompt, str):
                raise InvalidRequest("the prompt must be text")
            if not prompt.strip():
                raise InvalidRequest("the prompt is empty; type some text")
            ids = self.tokenizer.encode(prompt, parse_special=parse_special)
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

    def set_spec_mode(self, mode: str) -> None:
        """Speculative decoding of new requests: off, ngram, draft ("" = the workers' default)."""
        from engine.config import SPEC_MODES

        if mode and mode not in SPEC_MODES:
            raise ConfigError(f"speculation mode must be one of {', '.join(SPEC_MODES)}, got {mode!r}")
        self.spec_mode = mode

    def spec_modes(self) -> tuple[str, ...]:
        """Modes every ready worker can serve (draft only where all have a draft model)."""
        with self._lock:
            sets = [set(w.info.get("spec_modes", ("off",))) for w in self._workers if w.state == "ready"]
        common = set.intersection(*sets) if sets else {"off"}
        return tuple(m for m in ("off", "ngram", "draft") if m in common)

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
            capped = " (all its KV pool holds: raise --kv-cache-memory for more)" \
                if event.info.get("context_capped_by_kv") else ""
            kernels = f"; linear layers: {event.info['kernels']}" if event.info.get("kernels") else ""
            self._log_line("info", f"worker {event.worker} ({w.cfg.device}) ready: " + (
                event.info.get("summary") or f"{event.info.get('pages')} KV pages of "
                f"{event.info.get('page_size')} tokens, context {event.info.get('max_context')} tokens{capped}")
                + kernels)
        elif isinstance(event, msg.WorkerDown):
            with self._lock:
                w = self._workers[event.worker]
                w.state, w.message = "down", event.message
            self._log_line("error", f"worker {event.worker} ({w.cfg.device}) down: {event.message}")
        elif isinstance(event, msg.Reroute):
            self._reroute(event)
        elif isinstance(event, msg.ProfileUpdate):
            with self._lock:
                self._workers[event.worker].profile = (event.prefill_tps, event.decode_tps)
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
            if event.cache_delta:
                keys = self._workers[event.worker].cache_keys
                for added, key in event.cache_delta:
                    if added:
                        keys.add(key)
                    else:
                        keys.discard(key)
            for d in event.tokens:
                rec = self._records.get(d.request_id)
                if rec is None or rec.finish_reason is not None:
                    continue   # e.g. tokens a dying worker sent after its requests were failed
                if d.token_id >= 0:
                    rec.output_ids.append(d.token_id)
                    rec.last_token_at = time.monotonic()
                    if rec.first_token_at is None:
                        rec.first_token_at = rec.last_token_at
                if d.drafted and d.text:
                    start = len(rec.text)
                    if rec.drafted and rec.drafted[-1][1] == start:
                        rec.drafted[-1][1] += len(d.text)
                    else:
                        rec.drafted.append([start, start + len(d.text)])
                    while rec.drafted and rec.drafted[0][1] < start - TEXT_TAIL:
                        rec.drafted.pop(0)
                rec.text += d.text
                rec.state = "decode"
                deliveries.append((rec.id, d))
            for f in event.finished:
                rec = self._records.get(f.request_id)
                if rec is None:
                    continue
                rec.finish_reason, rec.error, rec.metrics = f.reason, f.error, f.metrics
                if f.metrics is not None and f.metrics.spec is not None:
                    rec.spec = f.metrics.spec
                rec.state = {"error": "error", "abort": "aborted"}.get(f.reason, "finished")
                rec.finished_at = time.monotonic()
                self._finished.append(rec.id)
                deliveries.append((rec.id, f))
                if f.reason == "error":
                    self._log_line("error", f"{rec.id}: {f.error}", locked=True)
                deliveries.append((None, (rec.worker, f)))
            for rid in event.preempted:
                self._log_repeated(("preempted", event.worker, rid), "warning",
                                   f"{rid} preempted{{times}} on worker {event.worker} (will recompute)")
                if self._tracer is not None and self._tracer.enabled:
                    self._tracer.instant("preempted", request=rid, worker=event.worker)
            self._forget_old()
        for rid, d in deliveries:
            if rid is None:
                self._notify("finished", d)
                continue
            handle = self._handles.get(rid)
            if handle is not None:
                handle._deliver(d)

    def _on_stats(self, s: msg.WorkerStats) -> None:
        with self._lock:
            w = self._workers[s.worker]
            w.stats = s
            w.prefill_hist.append(s.prefill_tps)
            w.decode_hist.append(s.decode_tps)
            if s.spec is not None:
                drafted, accepted = s.spec["draft_tokens"], s.spec["accepted_tokens"]
                if drafted > w.spec_seen[0]:
                    w.spec_hist.append((accepted - w.spec_seen[1]) / (drafted - w.spec_seen[0]))
                w.spec_seen = (drafted, accepted)
            if s.prefix:
                w.prefix_hist.append((s.prefix["prefix_cache_queries"], s.prefix["prefix_cache_hits"]))
            for v in s.seqs:
                rec = self._records.get(v.request_id)
                if rec is None or rec.finish_reason is not None:
                    continue
                rec.computed, rec.cached, rec.leader = v.computed_tokens, v.cached_tokens, v.leader
                if v.leader and rec.follow_at is None:
                    rec.follow_at = time.monotonic()
                rec.spec = v.spec
                rec.state = {"waiting": "queued"}.get(v.state, v.state)
                if rec.state != "queued" and rec.prefill_at is None:
                    rec.prefill_at = time.monotonic()

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
            metrics = msg.RequestMetrics(len(rec.prompt_ids), rec.cached, len(rec.output_ids),
                                         *_seen_timings(rec), time.monotonic() - rec.arrival)
            self._on_step(msg.StepEvents(event.worker, (), (msg.Finished(rid, "error", str(err), metrics),)))

    def _reroute(self, event: msg.Reroute) -> None:
        """A request its remote worker could not start (nothing streamed yet) goes elsewhere once."""
        with self._lock:
            rec = self._records.get(event.request_id)
            if rec is None or rec.finish_reason is not None or rec.worker != event.worker:
                return
            loads = [ld for ld in self._loads() if ld.worker != event.worker and ld.alive]
            error = None
            if rec.output_ids or rec.text:
                error = f"worker {event.worker} failed mid-stream: {event.reason}"
            elif not loads:
                error = f"worker {event.worker} failed ({event.reason}) and no other worker is ready"
            if error is None:
                decision = self.router.choose(rec.id, len(rec.prompt_ids), rec.params.max_tokens, loads)
                rec.worker, rec.state = decision.chosen, "queued"
                self._routing.append(decision)
                slot = self._workers[decision.chosen]
                self._log_line("warning", f"{rec.id} rerouted from worker {event.worker} to "
                                          f"{decision.chosen}: {event.reason}", locked=True)
        if error is not None:
            m = msg.RequestMetrics(len(rec.prompt_ids), 0, len(rec.output_ids), None, None, None, None,
                                   time.monotonic() - rec.arrival)
            self._on_step(msg.StepEvents(event.worker, (), (msg.Finished(rec.id, "error", error, m),)))
            return
        slot.commands.put(msg.Submit(rec.id, tuple(rec.prompt_ids), rec.params, rec.arrival,
                                     rec.messages if slot.cfg.remote else None))
        self._notify("route", decision)

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

    def _log_repeated(self, key: tuple, level: str, text: str) -> None:
        """Log an event that can repeat: within LOG_GROUP_WINDOW of its first line, a repeat
        rewrites that line as "... ×12 in 4.1 s" (moved to the end) instead of adding one.
        `text` has a {times} slot for that count. The lock is held."""
        now = time.time()
        for k in [k for k, g in self._log_groups.items() if now - g[0] >= LOG_GROUP_WINDOW]:
            del self._log_groups[k]
        first, count, old = self._log_groups.get(key, (now, 0, None))
        count += 1
        if old is not None and old in self._log:
            self._log.remove(old)
        times = f" ×{count} in {now - first:.1f} s" if count > 1 else ""
        line = LogLine(now, level, text.format(times=times))
        self._log.append(line)
        self._log_groups[key] = (first, count, line)

    def log(self, level: str, text: str) -> None:
        """Let the UI add a line (e.g. a burst summary) to the engine's event log."""
        self._log_line(level, text)

    # --- for servers and exporters (engine/serve) ------------------------------------------
    def add_observer(self, fn: Callable[[str, object], None]) -> None:
        """fn(kind, payload) on every routing decision ("route", RouteDecision; caller's thread)
        and finished request ("finished", (worker, Finished); dispatcher thread). Keep it quick."""
        self._observers.append(fn)

    def _notify(self, kind: str, payload) -> None:
        for fn in self._observers:
            try:
                fn(kind, payload)
            except Exception as exc:   # an exporter's bug must not stop the engine
                self._log_line("error", f"observer failed on {kind}: {type(exc).__name__}: {exc}")

    def outstanding(self) -> int:
        """Requests submitted and not yet finished, on all workers."""
        with self._lock:
            return sum(r.finish_reason is None for r in self._records.values())

    def capacity(self) -> tuple[int, int]:
        """(requests the ready workers can run at once, the longest context among them)."""
        with self._lock:
            live = [w for w in self._workers if w.state == "ready"]
            return (sum(w.cfg.max_active for w in live),
                    max((w.info.get("max_context", 0) for w in live), default=0))

    # --- snapshot -----------------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        now = time.monotonic()
        with self._lock:
            workers = tuple(self._worker_view(w) for w in self._workers)
            reqs = tuple(self._request_view(r, now) for r in self._records.values())
            uptime = now - self._started_at if self._started_at is not None else 0.0
            return EngineSnapshot(time.time(), workers, reqs, tuple(self._routing),
                                  self.router.policy, tuple(self._log), self.tracing, uptime)

    def _worker_view(self, w: _WorkerSlot) -> WorkerView:
        s, info = w.stats, w.info
        pre, dec = self._measured_rates(w)
        cpu, rss = self._worker_usage(w)
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
            max_active=w.cfg.max_active, preemptions=s.preemptions_total if s else 0,
            recomputed_tokens=s.recomputed_tokens_total if s else 0, kv_bytes=info.get("kv_bytes", 0),
            cpu_percent=cpu, rss_bytes=rss, prefix_cache=info.get("prefix_cache") == "on",
            prefix=dict(s.prefix) if s else {}, hit_rate=_window_rate(w.prefix_hist),
            remote_url=info.get("url") if w.cfg.remote else None,
            kv_usage=s.kv_usage if s else None, note=info.get("note", ""),
            spec=s.spec if s else None, spec_history=tuple(w.spec_hist),
            spec_modes=tuple(info.get("spec_modes", ("off",))), draft_model=info.get("draft_model", ""))


    def _worker_usage(self, w: _WorkerSlot) -> tuple[float | None, int | None]:
        if w.state not in ("ready", "loading") or w.process is None:
            return None, None
        if isinstance(w.process, threading.Thread):
            return self._usage.sample(w.index, None, w.process.native_id)
        return self._usage.sample(w.index, w.process.pid)

    def _request_view(self, r: _Record, now: float) -> RequestView:
        m = r.metrics
        end = r.finished_at or now
        seen = _seen_timings(r)     # while running, or where the worker sent no metrics (it died)
        return RequestView(
            id=r.id, worker=r.worker, state=r.state, prompt_tokens=len(r.prompt_ids),
            cached_tokens=m.cached_tokens if m else r.cached, output_tokens=len(r.output_ids),
            max_tokens=r.params.max_tokens, queue_time=m.queue_time if m else seen[0],
            ttft=m.ttft if m and m.ttft is not None else seen[1],
            itl_mean=m.itl_mean if m else seen[2], e2e=m.e2e if m else end - r.arrival,
            text_tail=r.text[-TEXT_TAIL:], error=r.error, burst=r.burst, age=now - r.arrival,
            spec=r.spec, drafted_spans=_tail_spans(r.drafted, len(r.text)),
            finish_reason=r.finish_reason, prompt=r.prompt_text, params=r.params,
            notice=r.notice, leader=r.leader if r.finish_reason is None else None)

    # --- traces -------------------------------------------------------------------------
    def set_tracing(self, enabled: bool) -> None:
        if enabled and not self.tracing:
            self._trace_since = time.monotonic()
        self.tracing = enabled
        if self._tracer is not None:
            self._tracer.set_enabled(enabled)
        for w in self._workers:
            if w.state == "ready":
                w.commands.put(msg.SetTracing(enabled))

    def _lifecycle_events(self, since: float, until: float) -> list[dict]:
        """Every request alive during [since, until] as phase spans on its own track, clipped
        to the window: queued -> prefill -> decode, then finished / aborted / failed, or the
        phase it is still in at `until` (marked running)."""
        from engine.trace import request_track_events

        with self._lock:
            records = [r for r in self._records.values()
                       if r.arrival <= until and (r.finished_at is None or r.finished_at >= since)]
            lifecycles = []
            for rec in records:
                m = rec.metrics
                queue_time, ttft = (m.queue_time, m.ttft) if m else _seen_timings(rec)[:2]
                if ttft is None and rec.first_token_at is not None:
                    ttft = rec.first_token_at - rec.arrival
                if queue_time is not None and ttft is not None:
                    queue_time = min(queue_time, ttft)   # a preempted request is queued again later
                marks = [("queued", rec.arrival)]
                follow = m.follow_start if m else (rec.follow_at - rec.arrival if rec.follow_at else None)
                if follow is not None and (queue_time is None or follow < queue_time):
                    marks.append(("waiting-on-leader", rec.arrival + follow))   # single flight
                if queue_time is not None:
                    marks.append(("prefill", rec.arrival + queue_time))
                if ttft is not None:
                    marks.append(("decode", rec.arrival + ttft))
                end = None
                if rec.finish_reason is not None:
                    end = ({"abort": "aborted", "error": "failed"}.get(rec.finish_reason, "finished"),
                           rec.arrival + m.e2e if m else rec.finished_at or until)
                lifecycles.append((rec.id, rec.worker, marks, end))
        pid = self._tracer.pid if self._tracer is not None else 0
        return request_track_events(pid, lifecycles, since, until)

    def export_trace(self, path: str | Path | None = None, timeout: float = 5.0) -> str:
        """Collect every worker's trace events plus the facade's and write one Chrome JSON file;
        return its absolute path. A write error is a one-line TokentopError; nothing else is lost."""
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
        now = time.monotonic()
        if self._tracer is not None:
            events += self._tracer.drain()
        # Request lifecycles are built from the engine's records, so a request that was
        # already running when tracing started, or is still running now, is in the trace too.
        events += self._lifecycle_events(self._trace_since if self._trace_since is not None else now, now)
        self._trace_since = now        # the next export covers what happens from here on
        events = self._unwritten_trace + events
        try:
            written = write_chrome_trace(target, events)
        except OSError as exc:
            self._unwritten_trace = events[-UNWRITTEN_TRACE_EVENTS:]
            raise TokentopError(f"cannot write the trace to {Path(target).absolute()}: "
                                f"{exc.strerror or exc}; its events are kept for the next export") from None
        self._unwritten_trace = []
        return written


def _window_rate(hist: deque) -> float | None:
    """Hit tokens / looked-up tokens over the samples in hist (None: no lookups there)."""
    if len(hist) < 2:
        return None
    (q0, h0), (q1, h1) = hist[0], hist[-1]
    return (h1 - h0) / (q1 - q0) if q1 > q0 else None


def _seen_timings(rec: _Record) -> tuple[float | None, float | None, float | None, None]:
    """(queue time, TTFT, mean ITL, max ITL) as the facade saw them, for a request the
    worker never reported metrics for (it died): the figures it had are kept."""
    queue_time = rec.prefill_at - rec.arrival if rec.prefill_at is not None else None
    ttft = rec.first_token_at - rec.arrival if rec.first_token_at is not None else None
    n = len(rec.output_ids)
    itl = ((rec.last_token_at - rec.first_token_at) / (n - 1)
           if n > 1 and rec.first_token_at is not None and rec.last_token_at is not None else None)
    return queue_time, ttft, itl, None


def _tail_spans(spans: list, text_len: int) -> tuple[tuple[int, int], ...]:
    """Drafted [start, end) ranges, relative to the text tail the snapshot carries."""
    off = max(0, text_len - TEXT_TAIL)
    return tuple((max(0, a - off), b - off) for a, b in spans if b > off)


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
