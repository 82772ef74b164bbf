"""The dispatcher: one thread that applies workers' events to the facade's state.

Events arrive on one queue from every worker (engine/messages.py): tokens and finished
requests (delivered to their handles), stats, readiness, deaths, reroutes, trace events. It
also notices a worker process that exited without a word, fails its requests, and starts a
worker again when its slot says a respawn is due (engine/facade/workers.py). It uses the
engine's public attributes only: workers, requests, lock, event_log, router, tracer, traces.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from engine import messages as msg
from engine.facade.devices import too_many_threads
from engine.errors import WorkerDied
from engine.facade.requests import TEXT_TAIL, seen_timings
from engine.facade.snapshot import RequestState
from engine.facade.workers import WorkerState

if TYPE_CHECKING:
    from engine.facade.engine import Engine


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
    def __init__(self, engine: Engine):
        self.engine = engine
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
                w.state = WorkerState.STOPPED
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
        if isinstance(event, msg.StepEvents):
            self.on_step(event)
        elif isinstance(event, msg.WorkerStats):
            self._on_stats(event)
        elif isinstance(event, msg.WorkerReady):
            too_many = too_many_threads(event.worker, [w.cfg for w in self.engine.workers])
            if too_many:   # logged before "ready": a caller that waits for it finds the warning
                self.engine.log("warning", f"worker {event.worker} (cpu): {too_many}")
            # a CUDA worker's graphs get a line of their own (before "ready", as the warning); a
            # CPU worker asked for them says in its ready line that it ignores the flag
            device = self.engine.workers[event.worker].cfg.device
            on_cuda = device.startswith("cuda")
            if event.info.cuda_graphs and on_cuda:
                self.engine.log("info", f"worker {event.worker} ({device}) CUDA graphs: {event.info.cuda_graphs}")
            with self.engine.lock:
                w = self.engine.workers[event.worker]
                w.state, w.info, w.message = WorkerState.READY, event.info, ""
                if w.profile == (0.0, 0.0):   # unless set_worker_profile came first
                    w.profile = (event.info.profile_prefill_tps, event.info.profile_decode_tps)
            info = event.info
            capped = " (all its KV pool holds: raise `kv_cache_memory` for more)" \
                if info.context_capped_by_kv else ""
            capped += contiguous_room(info)
            kernels = f"; linear layers: {info.kernels}" if info.kernels else ""
            graphs = f"; {info.cuda_graphs}" if info.cuda_graphs and not on_cuda else ""
            self.engine.log("info", f"worker {event.worker} ({w.cfg.device}) ready: " + (
                info.summary or f"{info.pages} KV pages of {info.page_size} tokens, "
                f"context {info.max_context} tokens{capped}") + kernels + graphs)
        elif isinstance(event, msg.WorkerDown):
            with self.engine.lock:
                w = self.engine.workers[event.worker]
                w.state, w.message = WorkerState.DOWN, event.message
            self.engine.log("error", f"worker {event.worker} ({w.cfg.device}) down: {event.message}")
        elif isinstance(event, msg.WorkerDegraded):
            with self.engine.lock:
                w = self.engine.workers[event.worker]
                w.state, w.message = WorkerState.DEGRADED, event.message
            self.engine.log("warning", f"worker {event.worker} ({w.cfg.device}) degraded: {event.message}")
        elif isinstance(event, msg.Reroute):
            self._reroute(event)
        elif isinstance(event, msg.KernelsSwitched):
            self._on_kernels(event)
        elif isinstance(event, msg.ProfileUpdate):
            with self.engine.lock:
                self.engine.workers[event.worker].profile = (event.prefill_tps, event.decode_tps)
        elif isinstance(event, msg.WorkerLoading):
            with self.engine.lock:
                w = self.engine.workers[event.worker]
                w.state, w.message = WorkerState.LOADING, event.message
        elif isinstance(event, msg.WorkerDead):
            self._on_dead(event)
        elif isinstance(event, msg.TraceEvents):
            self.engine.recorder.on_ring(event)

    def on_step(self, event: msg.StepEvents) -> None:
        deliveries = []
        with self.engine.lock:
            self.engine.timelines.on_step(event, time.monotonic(), self.engine.requests.records)
            if event.cache_delta:
                keys = self.engine.workers[event.worker].cache_keys
                for added, key in event.cache_delta:
                    if added:
                        keys.add(key)
                    else:
                        keys.discard(key)
            for d in event.tokens:
                rec = self.engine.requests.get(d.request_id)
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
                rec.state = RequestState.DECODE
                self.engine.requests.recount(rec)
                deliveries.append((rec.id, d))
            for f in event.finished:
                rec = self.engine.requests.get(f.request_id)
                if rec is None:
                    continue
                rec.finish_reason, rec.error, rec.metrics = f.reason, f.error, f.metrics
                if f.metrics is not None and f.metrics.spec is not None:
                    rec.spec = f.metrics.spec
                rec.state = RequestState.of_finish(f.reason)
                rec.finished_at = time.monotonic()
                self.engine.requests.finished(rec)
                self.engine.latency.add_finished(rec)
                deliveries.append((rec.id, f))
                if f.reason == "error":
                    self.engine.log("error", f"{rec.id}: {f.error}")
                deliveries.append((None, (rec.worker, f)))
            for rid in event.preempted:
                self.engine.event_log.repeated(("preempted", event.worker, rid), "warning",
                                               f"{rid} preempted{{times}} on worker {event.worker} (will recompute)")
                self.engine.recorder.tracer.instant("preempted", request=rid, worker=event.worker)
        if event.kv_blocks:
            self.engine.notify("kv_blocks", (event.worker, event.kv_blocks))
        for rid, d in deliveries:
            if rid is None:
                self.engine.notify("finished", d)
                continue
            handle = self.engine.requests.handles.get(rid)
            if handle is not None:
                handle._deliver(d)

    def _on_stats(self, s: msg.WorkerStats) -> None:
        with self.engine.lock:
            w = self.engine.workers[s.worker]
            if w.state == WorkerState.DEAD:
                return   # a report its process sent just before it died
            w.stats = s
            self.engine.history.add(s.worker, time.monotonic(), s)
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
                rec = self.engine.requests.get(v.request_id)
                if rec is None or rec.finish_reason is not None:
                    continue
                rec.computed, rec.cached, rec.leader = v.computed_tokens, v.cached_tokens, v.leader
                if v.leader and rec.follow_at is None:
                    rec.follow_at = time.monotonic()
                rec.spec = v.spec
                rec.state = RequestState.of_worker(v.state)
                self.engine.requests.recount(rec)
                if rec.state != RequestState.QUEUED and rec.prefill_at is None:
                    rec.prefill_at = time.monotonic()

    def _on_kernels(self, event: msg.KernelsSwitched) -> None:
        with self.engine.lock:
            w = self.engine.workers[event.worker]
            if w.info is not None:
                w.info = replace(w.info, kernels=event.kernels, kernels_building=False,
                                 kernels_since=0.0 if event.error else time.time())
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
            w.message = event.message.splitlines()[0] if event.message else "died"
            after = self.engine.workers.note_death(w, time.monotonic())
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
            rec = self.engine.requests.get(event.request_id)
            if rec is None or rec.finish_reason is not None or rec.worker != event.worker:
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
                rec.worker, rec.state = decision.chosen, RequestState.QUEUED
                self.engine.requests.recount(rec)
                self.engine.record_route(decision)
                slot = self.engine.workers[decision.chosen]
                self.engine.log("warning", f"{rec.id} rerouted from worker {event.worker} to "
                                f"{decision.chosen}: {event.reason}")
        if error is not None:
            m = msg.RequestMetrics(len(rec.prompt_ids), 0, len(rec.output_ids), None, None, None, None,
                                   time.monotonic() - rec.arrival)
            self.on_step(msg.StepEvents(event.worker, (), (msg.Finished(rec.id, "error", error, m),)))
            return
        self.engine.send_to(slot, rec, rec.arrival)
        self.engine.notify("route", decision)
