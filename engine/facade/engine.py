"""The Engine facade: lifecycle, submit, stream, abort, policies, snapshots, traces.

Threads and processes: each worker runs in its own process (default) or thread. Requests are
kept in a RequestTable (engine/facade/requests.py); one Dispatcher thread (engine/facade/dispatch.py) reads
the shared event queue, updates the records and wakes the request handles. Public methods
are thread-safe (one lock, never held while waiting on a queue or a worker).
"""
from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from engine import messages as msg
from engine.config import SPEC_MODES, EngineConfig, SamplingParams, WorkerConfig, check_scheduler_policy
from engine.facade.limits import check_memory, check_model_limits
from engine.facade.alerts import AlertWatcher
from engine.facade.dispatch import Dispatcher
from engine.facade.history import HistoryStore
from engine.facade.latency import LatencyWindow, live_samples_of
from engine.facade.timeline import TimelineStore
from engine.errors import ConfigError, InvalidRequest, TokentopError, describe_error
from engine.models.catalog import resolve_model
from engine.models.tokenizer import Tokenizer
from engine.facade.procstat import UsageSampler
# RequestFailed, RequestHandle and RequestResult are part of the facade's API, imported from here
from engine.facade.requests import (RequestFailed, RequestHandle, RequestRecord, RequestResult,  # noqa: F401
                             RequestTable, TEXT_TAIL, seen_timings)
from engine.facade.router import NOMINAL_RATES, RouteDecision, Router, WorkerLoad
from engine.facade.snapshot import EngineSnapshot, LogLine, RequestState, RequestView, WorkerView
from engine.trace import Tracer, check_trace_dir, request_track_events, set_tracer, write_chrome_trace

# how long start() waits for the workers: longer than the kernels' build time-out (600 s), so a
# worker whose build times out falls back to torch matmuls and still serves
READY_TIMEOUT_S = 900.0

HISTORY = 60          # samples of tok/s kept per worker for sparklines
HIT_WINDOW = 150      # WorkerStats samples (~30 s at 5 Hz) behind a worker's prefix hit rate
UNWRITTEN_TRACE_EVENTS = 2_000_000   # most trace events kept after a failed export
LOG_GROUP_WINDOW = 5.0   # seconds: the same event again within this is counted on one log line


@dataclass
class _WorkerSlot:
    index: int
    cfg: WorkerConfig
    commands: object
    process: object = None
    state: str = "starting"
    message: str = ""
    info: msg.WorkerInfo | None = None        # set when the worker reports ready
    stats: msg.WorkerStats | None = None
    prefill_hist: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    decode_hist: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    # prefill, decode tok/s the router divides by, from one place: what the worker reported
    # when ready (measured, cached or a simulated worker's declared rates), then updates (a
    # remote worker's measured streams) or set_worker_profile; (0, 0) = not calibrated
    profile: tuple[float, float] = (0.0, 0.0)
    spec_hist: deque = field(default_factory=lambda: deque(maxlen=HISTORY))   # acceptance per report
    spec_seen: tuple[int, int] = (0, 0)      # (draft tokens, accepted) at the last report
    cache_keys: set = field(default_factory=set)          # 8-byte prefixes of published pages
    prefix_hist: deque = field(default_factory=lambda: deque(maxlen=HIT_WINDOW))


def _open_routing_log(path: str):
    """--routing-log, opened for appending before any work; a path it cannot use is one line."""
    try:
        return open(path, "a")
    except OSError as exc:
        raise ConfigError(f"--routing-log {path}: cannot append to it ({exc.strerror or exc}); "
                          "give a file in a folder you can write to") from None


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
        self.requests = RequestTable()
        self.latency = LatencyWindow()   # percentiles over time, fed by the dispatcher
        self.alerts = AlertWatcher(self)   # stall, KV pressure, imbalance, dead or down workers
        self.timelines = TimelineStore()   # each request's phases, for the dashboard's timeline
        self.history = HistoryStore()      # each worker's last 15 minutes, one point a second
        self._routing: deque[RouteDecision] = deque(maxlen=50)
        self._log: deque[LogLine] = deque(maxlen=200)
        self._log_groups: dict[tuple, tuple[float, int, LogLine]] = {}   # key -> first, count, line
        self._workers: list[_WorkerSlot] = []
        self._events = None
        self.dispatcher = Dispatcher(self)
        self._dispatch_started = False
        self._stopping = False
        self._trace_wait: dict[int, list] = {}
        self._trace_cv = threading.Condition(self._lock)
        self._unwritten_trace: list = []   # events of an export that failed, kept for the next one
        self.tracing = bool(config.trace_dir)
        self.tokenizer = None
        self._routing_log = _open_routing_log(config.routing_log) if config.routing_log else None
        self._tracer = None
        self._trace_since = time.monotonic() if self.tracing else None   # start of the trace window
        self._started_at: float | None = None
        self._usage = UsageSampler()
        self._observers: list[Callable[[str, object], None]] = []
        self._counters: dict = {}   # remote worker index -> RemoteTokenCounter (engine/remote/worker.py)

    # --- lifecycle ----------------------------------------------------------------------
    def start(self, wait: bool = True, timeout: float = READY_TIMEOUT_S) -> "Engine":
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
                from engine.remote.worker import RemoteTokenCounter, remote_worker_main
                self._counters[i] = RemoteTokenCounter(cfg.device[len("remote:"):])
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
            self._workers.append(_WorkerSlot(i, cfg, commands, proc))
            proc.start()
        self.dispatcher.start()
        self._dispatch_started = True
        self.alerts.start()
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
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
        self.alerts.stop()     # workers stopping on purpose are no alert
        for w in self._workers:
            if w.state not in ("dead",):
                try:
                    w.commands.put(msg.Stop())
                except (ValueError, OSError) as exc:   # its queue is closed or its pipe broken
                    self._log_line("warning", f"worker {w.index}: stop not delivered ({exc}); "
                                   "it is terminated after the timeout")
        deadline = time.monotonic() + timeout
        for w in self._workers:
            if w.process is not None:
                w.process.join(max(0.0, deadline - time.monotonic()))
                if isinstance(w.process, mp.process.BaseProcess) and w.process.is_alive():
                    w.process.terminate()
        if self._dispatch_started:
            self.dispatcher.join(1.0)
        if self._routing_log:
            self._routing_log.close()
        for counter in self._counters.values():
            counter.close()

    def __enter__(self) -> "Engine":
        return self.start() if not self._workers else self

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
        if not params.speculate and self.spec_mode:   # the dashboard's choice for new requests
            params = replace(params, speculate=self.spec_mode)
        if messages is not None and prompt_ids is not None:   # the messages' ids, encoded by the caller
            ids = self.encode(None, None, prompt_ids)
        else:
            ids = self.encode(prompt, messages, prompt_ids, parse_special=parse_special)
        if prompt_lengths is None:
            prompt_lengths = self.prompt_lengths(ids, messages)
        now = time.monotonic()
        with self._lock:
            live = [w for w in self._workers if w.state == "ready"]
            if not live:   # each worker's state and last word: a remote that is down says why
                states = "; ".join(f"worker {w.index} ({w.cfg.device}) {w.state}"
                                   + (f": {w.message}" if w.message else "") for w in self._workers)
                raise InvalidRequest(f"no worker is ready yet ({states})")
            max_ctx = max(w.info.max_context for w in live)
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
            rec = RequestRecord(rid, ids, params, now, burst=burst, notice=notice,
                          messages=tuple(messages) if messages is not None else None,
                          prompt_text=prompt if isinstance(prompt, str) else self.tokenizer.decode(ids),
                          prompt_lens=dict(prompt_lengths))
            decision = self.router.choose(rid, len(ids), params.max_tokens, self._loads(),
                                          cached=self._reuse_estimates(ids, params.cache_salt, live),
                                          force=worker, prompt_lens=prompt_lengths)
            rec.worker = decision.chosen
            rec.cached_estimate = decision.chosen_reuse
            self._routing.append(decision)
            if self._routing_log:
                self._routing_log.write(json.dumps(decision.to_json()) + "\n")
                self._routing_log.flush()
            handle = RequestHandle(rec, self.abort)
            self.requests.add(rec, handle)
            slot = self._workers[decision.chosen]
        if self._tracer is not None and self._tracer.enabled:
            self._tracer.instant("route", request=rid, chosen=decision.chosen, policy=decision.policy,
                                 reason=decision.reason,
                                 scores={c.worker: round(c.score, 4) for c in decision.candidates},
                                 reuse={c.worker: c.cached_tokens for c in decision.candidates})
        slot.commands.put(msg.Submit(rid, tuple(ids), params, now, rec.messages if slot.cfg.remote else None,
                                     rec.prompt_len_on(decision.chosen)))
        self._notify("route", decision)
        return handle

    def needs_remote_counts(self) -> bool:
        """Whether prompt_lengths() would ask a remote server (and may take up to its timeout)."""
        return any(shape for _, shape, _ in self._other_model_remotes())

    def _other_model_remotes(self) -> list[tuple[int, str, str]]:
        """(index, /tokenize shape or "" for none, model) of each ready remote of another model."""
        if not self._counters:        # no remote workers (and engine.remote, httpx, not imported)
            return []
        from engine.remote.worker import TOKENIZE_SAME

        with self._lock:
            return [(w.index, w.info.tokenize, w.info.model) for w in self._workers
                    if w.state == "ready" and w.cfg.remote and w.info.tokenize != TOKENIZE_SAME]

    def prompt_lengths(self, ids: list[int], messages: list[dict] | None = None) -> dict[int, tuple[int, str]]:
        """The prompt's length on each ready remote worker that serves another model, and where
        the figure comes from: "remote" (its /tokenize) or "estimate" (the local count, when it has
        no /tokenize or the call failed or timed out). Workers not listed count len(ids) ("local").
        Asks the remotes over HTTP (bounded by engine/remote/worker.py TOKENIZE_TIMEOUT in all): call it
        outside any event loop."""
        out: dict[int, tuple[int, str]] = {}
        remotes = self._other_model_remotes()
        if not remotes:
            return out
        from engine.remote.worker import TOKENIZE_TIMEOUT

        text = self.tokenizer.decode(list(ids)) if messages is None else ""   # what the remote is sent
        deadline = time.monotonic() + TOKENIZE_TIMEOUT
        for index, shape, model in remotes:
            if not shape:
                out[index] = (len(ids), "estimate")
                continue
            try:
                n = self._counters[index].count(shape, model, text,
                                                tuple(messages) if messages is not None else None,
                                                max(0.0, deadline - time.monotonic()))
                out[index] = (n, "remote")
            except ValueError as exc:
                out[index] = (len(ids), "estimate")
                with self._lock:
                    self._log_repeated(("tokenize failed", index), "warning",
                                       f"worker {index}: prompt length estimated locally, its /tokenize "
                                       f"failed: {exc}{{times}}")
        return out

    def _reuse_estimates(self, ids: list[int], salt: str | None, live: list[_WorkerSlot]) -> dict[int, int]:
        """Prompt tokens each worker could restore: its published keys vs the prompt's chain."""
        # imported here: it imports torch (see engine/__init__.py)
        from engine.kv.prefix_cache import DELTA_KEY_BYTES, chain_keys, extra_key, model_identity

        chains: dict[tuple, list[bytes]] = {}
        out = {}
        for w in live:
            if w.info.prefix_cache != "on" or not w.cache_keys:
                continue
            cfg, ps = w.cfg, w.info.page_size
            ident = model_identity(cfg.model, cfg.activation_dtype, cfg.simulated)
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
            rec = self.requests.live(request_id)
            if rec is None or rec.worker is None:
                return False
            slot = self._workers[rec.worker]
        slot.commands.put(msg.Abort(request_id))
        return True

    def _loads(self) -> list[WorkerLoad]:
        loads = []
        for w in self._workers:
            pre, dec = self._measured_rates(w)
            loads.append(WorkerLoad(w.index, (w.info or msg.WorkerInfo.before_ready(w.cfg)).name,
                                    pre or NOMINAL_RATES[0], dec or NOMINAL_RATES[1],
                                    alive=w.state == "ready", nominal=not (pre and dec)))
        loads = self.requests.loads(loads)
        external = {w.index: w.stats.external_requests for w in self._workers
                    if w.cfg.remote and w.stats is not None and w.stats.external_requests}
        if external:
            # a remote's requests from other clients (its scrape): each weighs as a typical
            # request here, since their sizes are not known
            recs = list(self.requests.records.values())
            prompt = sum(len(r.prompt_ids) for r in recs) / len(recs) if recs else 0.0
            decode = sum(r.params.max_tokens for r in recs) / len(recs) if recs else 0.0
            for ld in loads:
                n = external.get(ld.worker, 0)
                if n:
                    ld.waiting += n
                    ld.prefill_tokens += round(n * prompt)
                    ld.decode_tokens += round(n * decode)
        return loads

    def _measured_rates(self, w: _WorkerSlot) -> tuple[float, float]:
        """The worker's profile (0 when it was not calibrated, e.g. a lone worker)."""
        return w.profile

    # --- policies -----------------------------------------------------------------------
    def set_scheduler_policy(self, policy: str, worker: int | None = None) -> None:
        check_scheduler_policy(policy)
        for w in self._workers:
            if worker is None or w.index == worker:
                w.commands.put(msg.SetPolicy(policy))
        self._log_line("info", f"scheduler policy -> {policy}")

    def set_spec_mode(self, mode: str) -> None:
        """Speculative decoding of new requests: off, ngram, draft ("" = the workers' default)."""
        if mode and mode not in SPEC_MODES:
            raise ConfigError(f"speculation mode must be one of {', '.join(SPEC_MODES)}, got {mode!r}")
        self.spec_mode = mode

    def spec_modes(self) -> tuple[str, ...]:
        """Modes every ready worker can serve (draft only where all have a draft model)."""
        with self._lock:
            sets = [set(w.info.spec_modes) for w in self._workers if w.state == "ready"]
        common = set.intersection(*sets) if sets else {"off"}
        return tuple(m for m in ("off", "ngram", "draft") if m in common)

    def set_router_policy(self, policy: str) -> None:
        with self._lock:
            self.router.set_policy(policy)
        self._log_line("info", f"router policy -> {policy}")

    def set_worker_profile(self, index: int, prefill_tps: float, decode_tps: float) -> None:
        with self._lock:
            self._workers[index].profile = (prefill_tps, decode_tps)

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
                self._log_line("error", f"observer failed on {kind}: {describe_error(exc)}")

    def outstanding(self) -> int:
        """Requests submitted and not yet finished, on all workers."""
        with self._lock:
            return self.requests.outstanding()

    def capacity(self) -> tuple[int, int]:
        """(requests the ready workers can run at once, the longest context among them)."""
        with self._lock:
            live = [w for w in self._workers if w.state == "ready"]
            return (sum(w.cfg.max_active for w in live),
                    max((w.info.max_context for w in live), default=0))

    # --- snapshot -----------------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        now = time.monotonic()
        with self._lock:
            workers = tuple(self._worker_view(w) for w in self._workers)
            reqs = tuple(self._request_view(r, now) for r in self.requests.records.values())
            uptime = now - self._started_at if self._started_at is not None else 0.0
            live = live_samples_of(self.requests.records.values(), now)
            timelines = self.timelines.timelines(self.requests.records)
            snap = EngineSnapshot(time.time(), workers, reqs, tuple(self._routing),
                                  self.router.policy, tuple(self._log), self.tracing, uptime,
                                  clock=now, timelines=timelines)
        # worked out after the facade's lock is released: the window has its own
        return replace(snap, latency=self.latency.views(now, live), alerts=self.alerts.active(),
                       alert_counts=self.alerts.totals(), history=self.history.histories())

    def _worker_view(self, w: _WorkerSlot) -> WorkerView:
        s, info = w.stats, w.info or msg.WorkerInfo.before_ready(w.cfg)
        pre, dec = self._measured_rates(w)
        cpu, rss = self._worker_usage(w)
        return WorkerView(
            index=w.index, name=info.name, device=w.cfg.device,
            model=info.model if w.cfg.remote and w.info else w.cfg.model,   # a remote: what it serves
            dtype=info.dtype,
            simulated=w.cfg.simulated, state=w.state, message=w.message,
            running=s.running if s else 0, waiting=s.waiting if s else 0,
            prefill_tps=s.prefill_tps if s else 0.0, decode_tps=s.decode_tps if s else 0.0,
            prefill_history=tuple(w.prefill_hist), decode_history=tuple(w.decode_hist),
            pages_total=s.pages_total if s else info.pages, pages_used=s.pages_used if s else 0,
            page_states=s.page_states if s else bytes(info.pages),
            page_size=info.page_size, policy=s.policy if s else w.cfg.policy,
            steps=s.steps if s else 0, profile_prefill_tps=pre, profile_decode_tps=dec,
            max_active=w.cfg.max_active, preemptions=s.preemptions_total if s else 0,
            recomputed_tokens=s.recomputed_tokens_total if s else 0, kv_bytes=info.kv_bytes,
            cpu_percent=cpu, rss_bytes=rss, prefix_cache=info.prefix_cache == "on",
            prefix=dict(s.prefix) if s else {}, hit_rate=_window_rate(w.prefix_hist),
            remote_url=info.url if w.cfg.remote else None,
            kv_usage=s.kv_usage if s else None, note=info.note,
            spec=s.spec if s else None, spec_history=tuple(w.spec_hist),
            spec_modes=tuple(info.spec_modes), draft_model=info.draft_model)

    def _worker_usage(self, w: _WorkerSlot) -> tuple[float | None, int | None]:
        if w.state not in ("ready", "loading") or w.process is None:
            return None, None
        if isinstance(w.process, threading.Thread):
            return self._usage.sample(w.index, None, w.process.native_id)
        return self._usage.sample(w.index, w.process.pid)

    def _request_view(self, r: RequestRecord, now: float) -> RequestView:
        m = r.metrics
        end = r.finished_at or now
        seen = seen_timings(r)     # while running, or where the worker sent no metrics (it died)
        return RequestView(
            id=r.id, worker=r.worker, state=r.state, prompt_tokens=r.prompt_len_on(r.worker),
            prompt_source=r.prompt_source_on(r.worker),
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
        with self._lock:
            records = [r for r in self.requests.records.values()
                       if r.arrival <= until and (r.finished_at is None or r.finished_at >= since)]
            lifecycles = []
            for rec in records:
                m = rec.metrics
                queue_time, ttft = (m.queue_time, m.ttft) if m else seen_timings(rec)[:2]
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
                    end = (RequestState.of_finish(rec.finish_reason).value,
                           rec.arrival + m.e2e if m else rec.finished_at or until)
                lifecycles.append((rec.id, rec.worker, marks, end))
        pid = self._tracer.pid if self._tracer is not None else 0
        return request_track_events(pid, lifecycles, since, until)

    def export_trace(self, path: str | Path | None = None, timeout: float = 5.0) -> str:
        """Collect every worker's trace events plus the facade's and write one Chrome JSON file;
        return its absolute path. A write error is a one-line TokentopError; nothing else is lost."""
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


def _tail_spans(spans: list, text_len: int) -> tuple[tuple[int, int], ...]:
    """Drafted [start, end) ranges, relative to the text tail the snapshot carries."""
    off = max(0, text_len - TEXT_TAIL)
    return tuple((max(0, a - off), b - off) for a, b in spans if b > off)


def _worker_entry(index, cfg, model_path, commands, events, tracing, log_path=None) -> None:
    from engine.worker.loop import worker_main   # imports torch: see engine/__init__.py

    if log_path:   # a worker process must not draw over the dashboard's terminal
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
