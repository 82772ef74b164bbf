"""The dispatcher: one thread that applies workers' events to the facade's state.

Events arrive on one queue from every worker (engine/messages.py): tokens and finished
requests (delivered to their handles), stats, readiness, deaths, reroutes, trace events. It
also notices a worker process that exited without a word, fails its requests, and starts a
worker again when its slot says a respawn is due (engine/facade/workers.py). It uses the
engine through engine/facade/engine_parts.py's `EngineParts` only. Each event type has one
handler (`Dispatcher.handlers`); the state it changes changes through the methods of
`RequestTable` and `WorkerSlot`.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Callable

from engine import messages as msg
from engine.facade.devices import too_many_threads
from engine.errors import WorkerDied
from engine.facade.requests import seen_timings
from engine.facade.workers import WorkerState

if TYPE_CHECKING:
    from engine.facade.engine_parts import EngineParts


def contiguous_room(info) -> str:
    """Contiguous K/V reserves a whole context per sequence: say so when that, not --max-active,
    caps how many sequences run at once (256 MiB of the 0.5B's fp32 K/V holds two of 4096 tokens)."""
    if info.kv_cache != "contiguous" or info.max_context < 1:
        return ""
    room = info.pages // -(-info.max_context // info.page_size)
    if room >= info.max_active:
        return ""
    return (f"; contiguous K/V holds {room} sequence{'s' if room != 1 else ''} of {info.max_context} tokens at "
            f"once (`max_active={info.max_active}`): lower `max_context` or raise `kv_cache_memory` for more")


class Dispatcher:
    def __init__(self, engine: EngineParts):
        self.engine = engine
        self.handlers: dict[type, Callable] = {
            msg.StepEvents: self.on_step,
            msg.WorkerStats: self._on_stats,
            msg.WorkerLoading: self._on_state(WorkerState.LOADING),
            msg.WorkerReady: self._on_ready,
            msg.WorkerDown: self._on_state(WorkerState.DOWN, "error", "down"),
            msg.WorkerDegraded: self._on_state(WorkerState.DEGRADED, "warning", "degraded"),
            msg.WorkerDead: self._on_dead,
            msg.Reroute: self._reroute,
            msg.KernelsSwitched: self._on_kernels,
            msg.ProfileUpdate: self._on_profile,
            msg.TraceEvents: lambda event: self.engine.recorder.on_ring(event),
        }
        self._thread = threading.Thread(target=self.run, name="tokentop-dispatch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def run(self) -> None:
        while True:
            try:
                event = self.engine.workers.events.get(timeout=0.2)
            except queue.Empty:
                event = None
            except (EOFError, OSError):
                return
            if event is not None:
                self.apply(event)
            self._check_liveness()
            self._respawn_due()
            if self.engine.stopping and all(not w.alive for w in self.engine.workers):
                self._drain()
                return

    def _drain(self) -> None:
        """Apply every event already queued."""
        try:
            while True:
                self.apply(self.engine.workers.events.get_nowait())
        except (queue.Empty, EOFError, OSError):
            pass

    def _check_liveness(self) -> None:
        for w in self.engine.workers:
            if w.state in (WorkerState.DEAD, WorkerState.STOPPED) or w.alive:
                continue
            if self.engine.stopping:
                w.set_state(WorkerState.STOPPED, w.message)
                continue
            # A worker that fails says why (WorkerDead) and then exits: its last words may still
            # sit in the queue, so apply them before calling the exit silent.
            self._drain()
            if w.state == WorkerState.DEAD:
                continue
            code = getattr(w.process, "exitcode", None)
            self.apply(msg.WorkerDead(w.index, f"worker process exited (exit code {code})"))

    def _respawn_due(self) -> None:
        if self.engine.stopping:
            return
        with self.engine.lock:
            due = self.engine.workers.respawn_due(time.monotonic())
            for w in due:
                self.engine.workers.respawn(w)
        for w in due:
            self.engine.log("warning", f"worker {w.index} ({w.cfg.device}) restarting (restart {w.respawns})")

    def apply(self, event) -> None:
        handler = self.handlers.get(type(event))
        if handler is not None:
            handler(event)

    def _on_state(self, state: WorkerState, level: str = "", said: str = "") -> Callable:
        """The handler of an event that only moves a worker to `state` with its message, logged
        as "worker N (device) {said}: message" when `level` is given."""
        def handle(event) -> None:
            with self.engine.lock:
                w = self.engine.workers[event.worker]
                w.set_state(state, event.message)
            if level:
                self.engine.log(level, f"worker {event.worker} ({w.cfg.device}) {said}: {event.message}")
        return handle

    def _on_profile(self, event: msg.ProfileUpdate) -> None:
        with self.engine.lock:
            self.engine.workers[event.worker].set_profile(event.prefill_tps, event.decode_tps)

    def _on_ready(self, event: msg.WorkerReady) -> None:
        too_many = too_many_threads(event.worker, [w.cfg for w in self.engine.workers])
        if too_many:   # logged before "ready": a caller that waits for it finds the warning
            self.engine.log("warning", f"worker {event.worker} (cpu): {too_many}")
        # a CUDA worker's graphs get a line of their own (before "ready", as the warning); a
        # CPU worker asked for them says in its ready line that it ignores the flag
        device = self.engine.workers[event.worker].cfg.device
        on_cuda = device.startswith("cuda")
        info = event.info
        if info.cuda_graphs and on_cuda:
            self.engine.log("info", f"worker {event.worker} ({device}) CUDA graphs: {info.cuda_graphs}")
        with self.engine.lock:
            self.engine.workers[event.worker].became_ready(info)
        capped = " (all its KV pool holds: raise `kv_cache_memory` for more)" \
            if info.context_capped_by_kv else ""
        capped += contiguous_room(info)
        kernels = f"; linear layers: {info.kernels}" if info.kernels else ""
        graphs = f"; {info.cuda_graphs}" if info.cuda_graphs and not on_cuda else ""
        self.engine.log("info", f"worker {event.worker} ({device}) ready: " + (
            info.summary or f"{info.pages} KV pages of {info.page_size} tokens, "
            f"context {info.max_context} tokens{capped}") + kernels + graphs)

    def on_step(self, event: msg.StepEvents) -> None:
        engine = self.engine
        with engine.lock:
            engine.timelines.on_step(event, time.monotonic(), engine.requests.records)
            if event.cache_delta:
                engine.workers[event.worker].update_cache_keys(event.cache_delta)
            delivered = [d for d in event.tokens if engine.requests.on_delta(d)]
            finished = [(rec, f) for f in event.finished
                        if (rec := engine.requests.on_finished(f)) is not None]
            for rec, f in finished:
                engine.latency.add_finished(rec)
                if f.reason == "error":
                    engine.log("error", f"{rec.id}: {f.error}")
            for rid in event.preempted:
                engine.event_log.repeated(("preempted", event.worker, rid), "warning",
                                          f"{rid} preempted{{times}} on worker {event.worker} (will recompute)")
                engine.recorder.tracer.instant("preempted", request=rid, worker=event.worker)
        if event.kv_blocks:
            engine.notify("kv_blocks", (event.worker, event.kv_blocks))
        for d in delivered:
            engine.requests.deliver(d.request_id, d)
        for rec, f in finished:
            engine.requests.deliver(rec.id, f)
            engine.notify("finished", (rec.worker, f))

    def _on_stats(self, s: msg.WorkerStats) -> None:
        with self.engine.lock:
            if not self.engine.workers[s.worker].add_stats(s):
                return
            self.engine.history.add(s.worker, time.monotonic(), s)
            for v in s.seqs:
                self.engine.requests.on_view(v)

    def _on_kernels(self, event: msg.KernelsSwitched) -> None:
        with self.engine.lock:
            w = self.engine.workers[event.worker]
            w.kernels_switched(event)
        if event.error:
            self.engine.log("warning", f"worker {event.worker} ({w.cfg.device}) stays on torch matmuls: "
                            f"{event.error}")
        else:
            self.engine.log("info", f"worker {event.worker} ({w.cfg.device}) switched to the quantized "
                            f"kernels: {event.kernels}")

    def _on_dead(self, event: msg.WorkerDead) -> None:
        with self.engine.lock:
            w = self.engine.workers[event.worker]
            if w.state == WorkerState.DEAD:
                return
            said = event.message.splitlines()[0] if event.message else "died"
            after = self.engine.workers.note_death(w, time.monotonic(), said)
            failed = self.engine.requests.open_on(event.worker)
        self.engine.log("error", f"worker {event.worker} ({w.cfg.device}) died: {w.message}; "
                        f"{len(failed)} request(s) failed" + (f"; {after}" if after else ""))
        self.engine.notify("kv_lost", event.worker)        # its cached pages are gone with it
        for rid in failed:
            rec = self.engine.requests.records[rid]
            err = WorkerDied(f"worker {event.worker} ({w.cfg.device}) died: {w.message}")
            metrics = msg.RequestMetrics(len(rec.prompt_ids), rec.cached, len(rec.output_ids),
                                         *seen_timings(rec), time.monotonic() - rec.arrival)
            self.on_step(msg.StepEvents(event.worker, (), (msg.Finished(rid, "error", str(err), metrics),)))

    def _reroute(self, event: msg.Reroute) -> None:
        """A request its remote worker could not start (nothing streamed yet) goes elsewhere once."""
        with self.engine.lock:
            rec = self.engine.requests.live(event.request_id)
            if rec is None or rec.worker != event.worker:
                return
            loads = [ld for ld in self.engine.loads() if ld.worker != event.worker and ld.alive]
            error = None
            if rec.output_ids or rec.text:
                error = f"worker {event.worker} failed mid-stream: {event.reason}"
            elif not loads:
                error = f"worker {event.worker} failed ({event.reason}) and no other worker is ready"
            if error is None:
                decision = self.engine.router.choose(rec.id, len(rec.prompt_ids), rec.params.max_tokens, loads,
                                                     prompt_lens=rec.prompt_lens)
                self.engine.requests.move(rec, decision.chosen)
                self.engine.record_route(decision)
                slot = self.engine.workers[decision.chosen]
                self.engine.log("warning", f"{rec.id} rerouted from worker {event.worker} to "
                                f"{decision.chosen}: {event.reason}")
        if error is not None:
            m = msg.RequestMetrics(len(rec.prompt_ids), 0, len(rec.output_ids), None, None, None, None,
                                   time.monotonic() - rec.arrival)
            self.on_step(msg.StepEvents(event.worker, (), (msg.Finished(rec.id, "error", error, m),)))
            return
        slot.send_request(rec, rec.arrival)
        self.engine.notify("route", decision)
