"""The facade's side of its workers: one slot per worker (its command queue, process or
thread, state and what it last reported), spawning, respawning and stopping them.

A local worker runs `engine/worker/loop.py` in its own process (or a thread, for tests); a
remote worker is a thread of I/O (`engine/remote/`). All of them send their events to the
one queue `events`, which the dispatcher reads.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import cached_property

from engine import messages as msg
from engine.config import WorkerConfig
from engine.trace import set_tracer
from engine.worker_kinds import kind_of, load

HISTORY = 60          # samples of tok/s kept per worker for sparklines
HIT_WINDOW = 150      # WorkerStats samples (~30 s at 5 Hz) behind a worker's prefix hit rate
# A local worker process that dies while serving is started again, at most this many times
# in RESPAWN_WINDOW_S, each after a wait that doubles from RESPAWN_BACKOFF_S: a worker that
# keeps dying (its model cannot load any more, a kernel crash on every step) stays dead.
RESPAWN_LIMIT = 3
RESPAWN_WINDOW_S = 300.0
RESPAWN_BACKOFF_S = 1.0


class WorkerState(StrEnum):
    STARTING = "starting"   # spawned, not heard from
    LOADING = "loading"     # loading its model
    READY = "ready"         # takes requests
    DEGRADED = "degraded"   # a remote whose stream stalled: no new requests until a probe streams in time
    DOWN = "down"           # a remote that stopped answering; probed until it answers again
    DEAD = "dead"           # failed; respawned if it may be (WorkerSet.respawn_due)
    STOPPED = "stopped"     # shut down by the engine

    @property
    def settled(self) -> bool:
        """Done starting, one way or the other."""
        return self in (WorkerState.READY, WorkerState.DEAD, WorkerState.DOWN, WorkerState.DEGRADED)


@dataclass
class WorkerSlot:
    index: int
    cfg: WorkerConfig
    commands: object
    process: object = None
    state: WorkerState = WorkerState.STARTING
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
    deaths: deque = field(default_factory=deque)          # monotonic times of its recent deaths
    respawns: int = 0                                     # since the engine started
    respawn_at: float | None = None                       # when the next respawn is due

    @property
    def ready(self) -> bool:
        return self.state == WorkerState.READY

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def send(self, command) -> None:
        self.commands.put(command)

    def send_request(self, rec, arrival: float) -> None:
        """Hand a routed request (a RequestRecord) to this worker: its token ids, and its chat
        messages where the worker's kind takes them."""
        messages = rec.messages if kind_of(self.cfg.device).takes_messages else None
        self.send(msg.Submit(rec.id, tuple(rec.prompt_ids), rec.params, arrival, messages,
                             rec.prompt_len_on(self.index)))

    @cached_property
    def cache_ident(self) -> str:
        """The model identity its prefix cache hashes pages under (routing's reuse estimate)."""
        from engine.kv.prefix_cache import model_identity   # imports torch (see engine/__init__.py)
        return model_identity(self.cfg.model, self.cfg.activation_dtype, self.cfg.simulated)

    def info_or_config(self) -> msg.WorkerInfo:
        return self.info or msg.WorkerInfo.before_ready(self.cfg)

    # --- what the worker reports, applied by the dispatcher under the facade's lock ---------
    def set_state(self, state: WorkerState, message: str) -> None:
        self.state, self.message = state, message

    def became_ready(self, info: msg.WorkerInfo) -> None:
        self.state, self.info, self.message = WorkerState.READY, info, ""
        if self.profile == (0.0, 0.0):   # unless set_worker_profile came first
            self.profile = (info.profile_prefill_tps, info.profile_decode_tps)

    def set_profile(self, prefill_tps: float, decode_tps: float) -> None:
        self.profile = (prefill_tps, decode_tps)

    def update_cache_keys(self, delta) -> None:
        """(added, key) pairs: the pages it published or evicted."""
        for added, key in delta:
            if added:
                self.cache_keys.add(key)
            else:
                self.cache_keys.discard(key)

    def add_stats(self, s: msg.WorkerStats) -> bool:
        """Keep a report and its histories; False (kept nothing) once the worker is dead: a
        report its process sent just before it died."""
        if self.state == WorkerState.DEAD:
            return False
        self.stats = s
        self.prefill_hist.append(s.prefill_tps)
        self.decode_hist.append(s.decode_tps)
        if s.spec is not None:
            drafted, accepted = s.spec["draft_tokens"], s.spec["accepted_tokens"]
            if drafted > self.spec_seen[0]:
                self.spec_hist.append((accepted - self.spec_seen[1]) / (drafted - self.spec_seen[0]))
            self.spec_seen = (drafted, accepted)
        if s.prefix:
            self.prefix_hist.append((s.prefix["prefix_cache_queries"], s.prefix["prefix_cache_hits"]))
        return True

    def kernels_switched(self, event: msg.KernelsSwitched) -> None:
        if self.info is not None:
            self.info = replace(self.info, kernels=event.kernels, kernels_building=False,
                                kernels_since=0.0 if event.error else time.time())


class WorkerSet:
    """Every worker of one engine. Its lists are guarded by the engine's lock."""

    def __init__(self, configs, *, worker_mode: str, trace_settings, worker_log: str | None):
        self.configs = tuple(configs)
        self.worker_mode = worker_mode
        self.trace_settings = trace_settings   # () -> engine.trace.TraceSettings a worker starts with
        self.worker_log = worker_log
        self.slots: list[WorkerSlot] = []
        self.events = None
        self._ctx = mp.get_context("spawn")
        self._paths: dict[str, str] = {}

    def __iter__(self):
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, index: int) -> WorkerSlot:
        return self.slots[index]

    def ready(self) -> list[WorkerSlot]:
        return [w for w in self.slots if w.ready]

    # --- spawning -----------------------------------------------------------------------
    def spawn_all(self, paths: dict[str, str], counters: dict) -> None:
        """Start every worker. `counters` receives a RemoteTokenCounter per remote worker."""
        self._paths = dict(paths)
        self.events = self._ctx.Queue() if self.worker_mode == "process" else queue.Queue()
        for i, cfg in enumerate(self.configs):
            counter = kind_of(cfg.device).token_counter
            if counter:
                counters[i] = load(counter)(cfg)
            commands, proc = self._spawn(i, cfg)
            self.slots.append(WorkerSlot(i, cfg, commands, proc))
            proc.start()

    def _spawn(self, i: int, cfg: WorkerConfig):
        path = self._paths[cfg.model]
        kind = kind_of(cfg.device)
        if kind.io_worker:      # forwarding needs no process of its own: a thread of I/O
            commands = queue.Queue()
            return commands, threading.Thread(target=load(kind.io_worker), name=f"tokentop-{kind.name}-{i}",
                                              args=(i, cfg, path, commands, self.events), daemon=True)
        if self.worker_mode == "process":
            commands = self._ctx.Queue()
            return commands, self._ctx.Process(target=worker_entry, name=f"tokentop-worker-{i}",
                                               args=(i, cfg, path, commands, self.events,
                                                     self.trace_settings(), self.worker_log), daemon=True)
        commands = queue.Queue()
        return commands, threading.Thread(target=worker_entry, name=f"tokentop-worker-{i}",
                                          args=(i, cfg, path, commands, self.events, self.trace_settings()),
                                          daemon=True)

    # --- deaths and respawns ------------------------------------------------------------
    def note_death(self, w: WorkerSlot, now: float, message: str | None = None) -> str:
        """Mark `w` dead (saying `message`, when given); schedule its respawn when it may have
        one. Returns what happens next, for the log line ("" when it stays dead)."""
        w.state = WorkerState.DEAD
        if message is not None:
            w.message = message
        w.stats = None
        w.cache_keys.clear()      # a new process starts with an empty prefix cache
        if not self._respawnable(w):
            return ""
        w.deaths.append(now)
        while w.deaths and now - w.deaths[0] > RESPAWN_WINDOW_S:
            w.deaths.popleft()
        if len(w.deaths) > RESPAWN_LIMIT:
            w.respawn_at = None
            return f"not restarted: it died {len(w.deaths)} times in {RESPAWN_WINDOW_S:.0f} s"
        wait = RESPAWN_BACKOFF_S * 2 ** (len(w.deaths) - 1)
        w.respawn_at = now + wait
        return f"restarting in {wait:.0f} s (restart {len(w.deaths)} of at most {RESPAWN_LIMIT})"

    def _respawnable(self, w: WorkerSlot) -> bool:
        """Only a local worker process that had been serving: one that failed to start would
        fail the same way again, and a thread's failure is the program's."""
        return (self.worker_mode == "process" and kind_of(w.cfg.device).local and w.info is not None
                and bool(self._paths))

    def respawn_due(self, now: float) -> list[WorkerSlot]:
        return [w for w in self.slots if w.state == WorkerState.DEAD and w.respawn_at is not None
                and now >= w.respawn_at]

    def respawn(self, w: WorkerSlot) -> None:
        """A fresh process for slot `w`, with a fresh command queue (the old one may hold
        commands for requests that failed with the old process)."""
        w.respawn_at = None
        w.respawns += 1
        old = w.process
        if isinstance(old, mp.process.BaseProcess):
            old.join(0.1)
        w.commands, w.process = self._spawn(w.index, w.cfg)
        w.state, w.message = WorkerState.STARTING, "restarting"
        w.process.start()

    # --- stopping -----------------------------------------------------------------------
    def stop_all(self, timeout: float, on_undelivered) -> None:
        for w in self.slots:
            if w.state != WorkerState.DEAD:
                try:
                    w.send(msg.Stop())
                except (ValueError, OSError) as exc:   # its queue is closed or its pipe broken
                    on_undelivered(w, exc)
        deadline = time.monotonic() + timeout
        for w in self.slots:
            if w.process is not None:
                w.process.join(max(0.0, deadline - time.monotonic()))
                if isinstance(w.process, mp.process.BaseProcess) and w.process.is_alive():
                    w.process.terminate()


def worker_entry(index, cfg, model_path, commands, events, trace_settings, log_path=None) -> None:
    """The target of a local worker's process (or thread)."""
    from engine.worker.loop import worker_main   # imports torch: see engine/__init__.py

    if log_path:   # a worker process must not draw over the dashboard's terminal
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    # the worker's flight recorder; on CUDA workers full detail adds NVTX ranges for Nsight
    tracer = trace_settings.tracer(f"worker {index} ({cfg.device})", nvtx=cfg.device.startswith("cuda"),
                                   nvtx_when_full=True)
    set_tracer(tracer)
    tracer.set_thread_name("worker loop")
    worker_main(index, cfg, model_path, commands, events)
