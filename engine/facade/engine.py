"""The Engine facade: lifecycle, submit, stream, abort, policies, snapshots, traces.

Threads and processes: each worker runs in its own process (default) or thread. Requests are
kept in a RequestTable (engine/facade/requests.py); one Dispatcher thread (engine/facade/dispatch.py) reads
the shared event queue, updates the records and wakes the request handles. Public methods
are thread-safe (one lock, never held while waiting on a queue or a worker).
"""
from __future__ import annotations

import itertools
import json
import threading
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Callable

from engine import messages as msg
from engine.config import SPEC_MODES, EngineConfig, SamplingParams, check_scheduler_policy
from engine.facade.limits import check_memory, check_model_limits
from engine.facade.alerts import AlertWatcher
from engine.facade.dispatch import Dispatcher
from engine.facade.history import HistoryStore
from engine.facade.latency import LatencyWindow, live_samples_of
from engine.facade.timeline import TimelineStore
from engine.errors import ConfigError, InvalidRequest, TokentopError, describe_error
from engine.models.catalog import resolve_model
from engine.models.tokenizer import Tokenizer
# RequestFailed, RequestHandle and RequestResult are part of the facade's API, imported from here
from engine.facade.requests import (RequestFailed, RequestHandle, RequestRecord, RequestResult,  # noqa: F401
                                    RequestTable, encode_prompt)
from engine.facade.router import RouteDecision, Router, WorkerLoad, reusable_prefix_tokens
from engine.facade.event_log import EventLog
from engine.facade.remote_lengths import RemotePromptLengths
from engine.facade.snapshot import EngineSnapshot
from engine.facade.snapshot_builder import SnapshotBuilder, request_view
from engine.facade.recorder import FlightRecorder
from engine.facade.workers import WorkerSet, WorkerSlot, WorkerState
from engine.trace import check_trace_dir

# how long start() waits for the workers: longer than the kernels' build time-out (600 s), so a
# worker whose build times out falls back to torch matmuls and still serves
READY_TIMEOUT_S = 900.0

ROUTES_KEPT = 50      # recent routing decisions the snapshot carries


def _open_routing_log(path: str):
    """--routing-log, opened for appending before any work; a path it cannot use is one line."""
    try:
        return open(path, "a")
    except OSError as exc:
        raise ConfigError(f"`routing_log={path}`: cannot append to it ({exc.strerror or exc}); "
                          "give a file in a folder you can write to") from None


class Engine:
    def __init__(self, config: EngineConfig, *, progress: Callable[[str, int, int], None] | None = None):
        if not config.workers:
            raise ConfigError("at least one worker is needed (`workers`)")
        if config.worker_mode not in ("process", "thread"):
            raise ConfigError(f"`worker_mode` must be process or thread, got {config.worker_mode!r}")
        self.config = config
        self.router = Router(config.router_policy)
        self._progress = progress
        self.lock = threading.RLock()   # guards the request table, the worker slots and the router
        self._ids = itertools.count(1)
        self.spec_mode = ""   # speculation of new requests that do not choose: "" = the workers' default
        self.requests = RequestTable()
        self.routes: deque[RouteDecision] = deque(maxlen=ROUTES_KEPT)
        self.event_log = EventLog()
        self._observers: list[Callable[[str, object], None]] = []
        self.recorder = FlightRecorder(self)   # the trace ring and `t` (engine/facade/recorder.py)
        self.workers = WorkerSet(config.workers, worker_mode=config.worker_mode,
                                 trace_settings=self.recorder.worker_settings, worker_log=config.worker_log)
        self.latency = LatencyWindow()   # percentiles over time, fed by the dispatcher
        self.alerts = AlertWatcher(self)   # stall, KV pressure, imbalance, dead or down workers
        self.timelines = TimelineStore()   # each request's phases, for the dashboard's timeline
        self.history = HistoryStore()      # each worker's last 15 minutes, one point a second
        self.dispatcher = Dispatcher(self)
        self._dispatch_started = False
        self.stopping = False
        self.tokenizer = None
        self._routing_log = _open_routing_log(config.routing_log) if config.routing_log else None
        self._started_at: float | None = None
        self._views = SnapshotBuilder()
        self._remote_lengths = RemotePromptLengths(self)

    # --- lifecycle ----------------------------------------------------------------------
    def start(self, wait: bool = True, timeout: float = READY_TIMEOUT_S) -> "Engine":
        if self.config.trace_dir:   # before any work: not a crash once the work is done
            check_trace_dir(self.config.trace_dir)
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
        self.workers.spawn_all(paths, self._remote_lengths.counters)
        self.dispatcher.start()
        self._dispatch_started = True
        self.alerts.start()
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                states = [w.state for w in self.workers]
            if all(s.settled for s in states):
                break
            time.sleep(0.02)
        with self.lock:
            if all(w.state == WorkerState.DEAD for w in self.workers):
                reasons = "; ".join(f"worker {w.index} ({w.cfg.device}): {w.message}" for w in self.workers)
                raise TokentopError(f"no worker could start: {reasons}")

    @property
    def ready(self) -> bool:
        with self.lock:
            return bool(self.workers.ready())

    def shutdown(self, timeout: float = 5.0) -> None:
        if self.stopping:
            return
        self.stopping = True
        self.alerts.stop()     # workers stopping on purpose are no alert
        self.workers.stop_all(timeout, lambda w, exc: self.log(
            "warning", f"worker {w.index}: stop not delivered ({exc}); it is terminated after the timeout"))
        if self._dispatch_started:
            self.dispatcher.join(1.0)
        if self._routing_log:
            self._routing_log.close()
        self._remote_lengths.close()

    def __enter__(self) -> "Engine":
        return self.start() if not len(self.workers) else self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # --- requests -----------------------------------------------------------------------
    def submit(self, prompt: str | None = None, *, messages: list[dict] | None = None,
               params: SamplingParams | None = None, prompt_ids: list[int] | None = None,
               worker: int | None = None, burst: str | None = None,
               parse_special: bool = False, cache_salt: str | None = None,
               prompt_lengths: dict[int, tuple[int, str]] | None = None) -> RequestHandle:
        """Queue one request. Bad input raises InvalidRequest and queues nothing.
        A special token spelled in a plain prompt is plain text unless parse_special (trusted
        prompts only); in chat messages it is always plain text. cache_salt (or
        params.cache_salt): requests share cached KV pages only with the same salt.
        prompt_lengths: what prompt_lengths() answered, for a caller that asked it elsewhere
        (the server, off its event loop); else it is asked here, in the caller's thread.
        messages with prompt_ids: the ids are those messages, encoded by the caller; the messages
        still go to a remote worker that serves another model (its own chat template)."""
        params = params or SamplingParams()
        if cache_salt is not None:
            params = replace(params, cache_salt=cache_salt)
        params = params.validate()
        asked_draft = params.speculate == "draft"
        if not params.speculate and self.spec_mode:   # the dashboard's choice for new requests
            params = replace(params, speculate=self.spec_mode)
        if messages is not None and prompt_ids is not None:   # the messages' ids, encoded by the caller
            ids = self.encode(None, None, prompt_ids)
        else:
            ids = self.encode(prompt, messages, prompt_ids, parse_special=parse_special)
        if prompt_lengths is None:
            prompt_lengths = self.prompt_lengths(ids, messages)
        now = time.monotonic()
        with self.lock:
            live = self.workers.ready()
            max_ctx = self._check_admissible(live, len(ids), worker, asked_draft)
            rid = f"r{next(self._ids)}"
            notice = None
            room = max_ctx - len(ids)   # the last token sampled needs no KV: context - prompt
            if params.max_tokens > room:
                # clamp, and say so once: the record, the router and the table see the real limit
                notice = (f"max_tokens {params.max_tokens} lowered to {room}: the {len(ids)}-token prompt "
                          f"leaves {room} of the {max_ctx}-token context (`max_context`, `kv_cache_memory`)")
                self.event_log.repeated(("max_tokens lowered",), "warning", f"{rid}: {notice}{{times}}")
                params = replace(params, max_tokens=room)
            rec = RequestRecord(rid, ids, params, now, burst=burst, notice=notice,
                          messages=tuple(messages) if messages is not None else None,
                          prompt_text=prompt if isinstance(prompt, str) else self.tokenizer.decode(ids),
                          prompt_lens=dict(prompt_lengths))
            decision = self.router.choose(rid, len(ids), params.max_tokens, self.loads(),
                                          cached=reusable_prefix_tokens(ids, params.cache_salt, live),
                                          force=worker, prompt_lens=prompt_lengths)
            rec.worker = decision.chosen
            rec.cached_estimate = decision.chosen_reuse
            self.record_route(decision)
            handle = RequestHandle(rec, self.abort)
            self.requests.add(rec, handle)
            slot = self.workers[decision.chosen]
        slot.send_request(rec, now)
        self.notify("route", decision)
        return handle

    def _check_admissible(self, live: list[WorkerSlot], n_ids: int, worker: int | None, asked_draft: bool) -> int:
        """Refuse what no ready worker could take; the largest context among them."""
        if not live:   # each worker's state and last word: a remote that is down says why
            states = "; ".join(f"worker {w.index} ({w.cfg.device}) {w.state}"
                               + (f": {w.message}" if w.message else "") for w in self.workers)
            raise InvalidRequest(f"no worker is ready yet ({states})")
        max_ctx = max(w.info.max_context for w in live)
        if n_ids + 1 > max_ctx:
            raise InvalidRequest(f"prompt has {n_ids} tokens but the context is {max_ctx} tokens; "
                                 "shorten the prompt or raise `max_context`")
        if worker is not None and worker not in [w.index for w in live]:
            raise InvalidRequest(f"worker {worker} is not ready")
        if asked_draft and not all("draft" in w.info.spec_modes for w in live):
            # refused here: a worker without a draft model would fail it after routing
            raise InvalidRequest("speculate 'draft' needs a draft model (`draft_model`) on every worker; "
                                 "use speculate 'ngram' or 'off'")
        return max_ctx

    def record_route(self, decision: RouteDecision) -> None:
        """Keep a routing decision for the snapshot and the routing log (the flight recorder
        traces it from notify("route")). Lock held."""
        self.routes.append(decision)
        if self._routing_log:
            self._routing_log.write(json.dumps(decision.to_json()) + "\n")
            self._routing_log.flush()

    def encode(self, prompt: str | None, messages: list[dict] | None,
               prompt_ids: list[int] | None, parse_special: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, messages, prompt_ids, parse_special)

    def needs_remote_counts(self) -> bool:
        """Whether prompt_lengths() would ask a remote server (and may take up to its timeout)."""
        return self._remote_lengths.needed()

    def prompt_lengths(self, ids: list[int], messages: list[dict] | None = None) -> dict[int, tuple[int, str]]:
        """The prompt's length on each ready remote worker that serves another model
        (engine/facade/remote_lengths.py). Asks the remotes over HTTP: call it outside any event loop."""
        return self._remote_lengths.lengths(ids, messages)

    def loads(self) -> list[WorkerLoad]:
        """What the router weighs: each worker's rates and the work routed to it. Lock held."""
        return self.requests.loads(self.workers)

    def generate(self, prompt: str | None = None, **kw) -> RequestResult:
        """Submit and wait: the simple blocking call."""
        return self.submit(prompt, **kw).result()

    def abort(self, request_id: str) -> bool:
        with self.lock:
            rec = self.requests.live(request_id)
            if rec is None or rec.worker is None:
                return False
            slot = self.workers[rec.worker]
        slot.send(msg.Abort(request_id))
        return True

    # --- policies -----------------------------------------------------------------------
    def set_scheduler_policy(self, policy: str, worker: int | None = None) -> None:
        check_scheduler_policy(policy)
        for w in self.workers:
            if worker is None or w.index == worker:
                w.send(msg.SetPolicy(policy))
        self.log("info", f"scheduler policy -> {policy}")

    def set_spec_mode(self, mode: str) -> None:
        """Speculative decoding of new requests: off, ngram, suffix, draft ("" = the workers' default)."""
        if mode and mode not in SPEC_MODES:
            raise ConfigError(f"speculation mode must be one of {', '.join(SPEC_MODES)}, got {mode!r}")
        self.spec_mode = mode

    def spec_modes(self) -> tuple[str, ...]:
        """Modes every ready worker can serve (draft only where all have a draft model)."""
        with self.lock:
            sets = [set(w.info.spec_modes) for w in self.workers.ready()]
        common = set.intersection(*sets) if sets else {"off"}
        return tuple(m for m in SPEC_MODES if m in common)

    def set_router_policy(self, policy: str) -> None:
        with self.lock:
            self.router.set_policy(policy)
        self.log("info", f"router policy -> {policy}")

    def set_worker_profile(self, index: int, prefill_tps: float, decode_tps: float) -> None:
        with self.lock:
            self.workers[index].profile = (prefill_tps, decode_tps)

    def log(self, level: str, text: str) -> None:
        """Add a line to the engine's event log (the UI adds burst summaries here)."""
        self.event_log.add(level, text)

    # --- for servers and exporters (engine/serve) ------------------------------------------
    def add_observer(self, fn: Callable[[str, object], None]) -> None:
        """fn(kind, payload) on every routing decision ("route", RouteDecision; caller's thread),
        finished request ("finished", (worker, Finished)), prefix-cache pages published or
        evicted ("kv_blocks", (worker, StepEvents.kv_blocks)) and a worker's cache lost with it
        ("kv_lost", worker); all but "route" on the dispatcher thread. Keep it quick."""
        self._observers.append(fn)

    def notify(self, kind: str, payload) -> None:
        for fn in self._observers:
            try:
                fn(kind, payload)
            except Exception as exc:   # an exporter's bug must not stop the engine
                self.log("error", f"observer failed on {kind}: {describe_error(exc)}")

    def outstanding(self) -> int:
        """Requests submitted and not yet finished, on all workers."""
        with self.lock:
            return self.requests.outstanding()

    def capacity(self) -> tuple[int, int]:
        """(requests the ready workers can run at once, the longest context among them)."""
        with self.lock:
            live = self.workers.ready()
            return (sum(w.cfg.max_active for w in live),
                    max((w.info.max_context for w in live), default=0))

    # --- snapshot -----------------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        now = time.monotonic()
        with self.lock:
            workers = tuple(self._views.worker_view(w) for w in self.workers)
            reqs = tuple(request_view(r, now) for r in self.requests.records.values())
            uptime = now - self._started_at if self._started_at is not None else 0.0
            routes = tuple(self.routes)
            live = live_samples_of(self.requests.records.values(), now)
            timelines = self.timelines.timelines(self.requests.records)
        snap = EngineSnapshot(time.time(), workers, reqs, routes, self.router.policy,
                              self.event_log.lines(), self.tracing, uptime,
                              trace_detail=self.recorder.detail, clock=now, timelines=timelines)
        # worked out after the facade's lock is released: the window has its own
        return replace(snap, latency=self.latency.views(now, live), alerts=self.alerts.active(),
                       alert_counts=self.alerts.totals(), history=self.history.histories())

    # --- traces (engine/facade/recorder.py) ------------------------------------------------
    @property
    def tracing(self) -> bool:
        """Full trace detail on (per-layer scopes); the light ring records regardless."""
        return self.recorder.detail == "full"

    def set_tracing(self, enabled: bool) -> None:
        self.recorder.set_full(enabled)

    def export_trace(self, path: str | Path | None = None, timeout: float = 10.0, *,
                     refuse_busy: bool = False) -> str:
        """The flight recorder's last window, every worker's ring and the facade's, as one
        Chrome JSON file; its absolute path. A write error is a one-line TokentopError;
        refuse_busy: TraceBusy while one is being written or right after (recorder.py)."""
        return self.recorder.export(path, timeout, refuse_busy=refuse_busy)
