"""One worker = one device: its own runner (model copy), KV page pool, scheduler and loop.

The loop runs in its own OS process (default) or a thread (tests, `--worker-mode thread`).
It talks to the facade only through two queues: commands in, events out (engine/messages.py).
"""
from __future__ import annotations

import queue
import time
import traceback
from contextlib import nullcontext

import torch

from engine import kernels
from engine import messages as msg
from engine.config import WorkerConfig
from engine.errors import TokentopError, describe_error
from engine.worker.output import OutputProcessor, SampledToken, spec_dict
from engine.worker.profile import worker_profile
from engine.worker.roofline import machine_ceilings, worker_traffic
from engine.worker.runner_api import Runner
from engine.worker.scheduler import ScheduledSeq, StepPlan
from engine.worker.sequence import Sequence, SeqState
from engine.worker.step_counts import StepCounts
from engine.worker.setup import (allocate_kv, build_runner, build_scheduler, ready_info, size_kv, speed_profile,
                                 start_kernels, start_prefix_reuse, start_speculation, switch_kernels)
from engine.worker_kinds import kind_of
from engine.speculative.verify import Verdict
from engine.trace import get_tracer

STATS_INTERVAL = 0.2     # seconds between WorkerStats events (5 Hz)


class Worker:
    def __init__(self, index: int, cfg: WorkerConfig, model_path: str, emit):
        self.index, self.cfg, self.emit, self.model_path = index, cfg, emit, model_path
        kind = kind_of(cfg.device)

        def say(text: str) -> None:
            emit(msg.WorkerLoading(index, text))
        say(f"loading {cfg.model} on {cfg.device}")
        self.kernels_pending = start_kernels(kind, say)
        # while the compiler has the cores, one thread: OpenMP threads that share busy cores
        # wait for each other at every op, and the fallback crawled at a fraction of one thread
        self._threads = torch.get_num_threads()
        if self.kernels_pending:
            torch.set_num_threads(1)
        self._recalibrate = False
        self.runner: Runner = build_runner(kind, cfg, model_path)
        self.tokenizer = self.runner.tokenizer
        kv = size_kv(cfg, self.runner)
        self.max_context = kv.max_context   # the model's, `max_context` or the pool's, the least
        self.output = OutputProcessor(self.tokenizer.eog_ids, self.max_context)
        allocate_kv(self.runner, cfg, kv, say)
        self.scheduler = build_scheduler(cfg, kv)
        self.blocks, self.pool = self.scheduler.blocks, self.scheduler.blocks.pool
        self.spec = start_speculation(kind, cfg, self.runner, self.blocks, say)
        # the live roofline: not measured while a kernel build holds the cores (then at the switch)
        self.traffic = worker_traffic(self.runner, cfg, self._threads, measure=not self.kernels_pending)
        self.reuse = start_prefix_reuse(cfg, self.scheduler)
        profile = speed_profile(kind, cfg, self.runner, self.blocks, model_path, say)
        self._reset_counters()
        emit(msg.WorkerReady(index, ready_info(self, kv, profile)))

    def _reset_counters(self) -> None:
        self.seqs: dict[str, Sequence] = {}
        self.counts = StepCounts()
        self._last_stats = 0.0
        self.stopping = False

    # --- loop -------------------------------------------------------------------------
    def run(self, commands) -> None:
        while not self.stopping:
            self._drain_commands(commands, block=self.scheduler.idle)
            if self.stopping:
                break
            if not self.scheduler.idle:
                self.step()
            if self.kernels_pending:
                self._switch_kernels_when_built()
            if self._recalibrate and self.scheduler.idle:
                self._recalibrate_profile()
            self._maybe_send_stats()
        # the facade fails what is still open itself once its workers are gone
        self._end([(seq, "abort", "the engine shut down") for seq in self.seqs.values()], emit=False)
        self._maybe_send_stats(force=True)

    def _switch_kernels_when_built(self) -> None:
        """Between two steps: once the background build is done, switch to it."""
        if not (kernels.is_loaded() or kernels.background_build_done()):
            return
        self.kernels_pending = False
        torch.set_num_threads(self._threads)   # the build no longer holds the cores
        if self.traffic is not None and not self.traffic.ceilings:
            self.traffic.ceilings = machine_ceilings(self._threads)
        if switch_kernels(self.runner, self.index, self.emit):
            self._recalibrate = self.cfg.calibrate   # the router's rates were the fallback's

    def _recalibrate_profile(self) -> None:
        self._recalibrate = False
        profile = worker_profile(self.runner, self.blocks, self.cfg, self.model_path)
        self.emit(msg.ProfileUpdate(self.index, profile["prefill_tps"], profile["decode_tps"]))

    def _drain_commands(self, commands, block: bool) -> None:
        timeout = STATS_INTERVAL if block else 0
        while True:
            try:
                cmd = commands.get(timeout=timeout) if timeout else commands.get_nowait()
            except queue.Empty:
                return
            timeout = 0
            self.handle(cmd)

    def handle(self, cmd) -> None:
        if isinstance(cmd, msg.Submit):
            self.submit(cmd)
        elif isinstance(cmd, msg.Abort):
            seq = self.seqs.get(cmd.request_id)
            if seq is not None:
                self._end([(seq, "abort", None)])
        elif isinstance(cmd, msg.SetPolicy):
            self.scheduler.set_policy(cmd.policy)
        elif isinstance(cmd, msg.SetTraceDetail):
            self.runner.set_trace_detail(cmd.detail)
        elif isinstance(cmd, msg.SendTrace):
            self.emit(msg.TraceEvents(self.index, self.runner.trace_ring()))
        elif isinstance(cmd, msg.Stop):
            self.stopping = True

    def submit(self, cmd: msg.Submit) -> None:
        seq = Sequence(cmd.request_id, list(cmd.prompt_ids), cmd.params, arrival=cmd.arrival)
        try:
            pages_needed = -(-(len(seq.prompt_ids) + 1) // self.cfg.page_size)
            if len(seq.prompt_ids) + 1 > self.max_context:
                raise TokentopError(
                    f"prompt has {len(seq.prompt_ids)} tokens but this worker's context is "
                    f"{self.max_context}; shorten the prompt or raise `max_context`")
            if pages_needed > self.pool.num_pages:
                raise TokentopError(
                    f"prompt needs {pages_needed} KV pages but the worker has {self.pool.num_pages}; "
                    "raise `kv_cache_memory`")
            self.runner.start_sequence(seq)
            if self.spec is not None:
                self.spec.start(seq)
        except Exception as exc:  # refuse this one request, keep serving
            self._end([(seq, "error", describe_error(exc))])
            return
        self.seqs[seq.id] = seq
        self.scheduler.add(seq)

    # --- one step ---------------------------------------------------------------------
    def step(self) -> None:
        tracer = get_tracer()
        with tracer.span("engine step", step=self.counts.steps):
            self._step(tracer)
        if tracer.enabled:
            tracer.counter("kv pages", used=self.pool.num_used, cached=self.pool.num_cached,
                           free=self.pool.num_free - self.pool.num_cached)
            tracer.counter("requests", running=len(self.scheduler.running),
                           waiting=len(self.scheduler.waiting))
            tracer.counter("tokens in step", tokens=self.counts.last_step_tokens)

    def _step(self, tracer) -> None:
        with tracer.span("scheduler decision"):
            if self.spec is not None:
                self.spec.prepare(self.scheduler)
            plan = self.scheduler.schedule()
        if not plan.items:
            self._fail_unschedulable()
            return
        speculating = plan.num_draft > 0
        with tracer.span("spec", drafts=plan.num_draft) if speculating else nullcontext():
            t0 = time.perf_counter()
            if speculating:
                plan = self._propose(plan)
            drafting = time.perf_counter() - t0
            t0 = time.perf_counter()
            sampled, errors, whole = self._execute(plan.items)
            seconds = time.perf_counter() - t0
        decode_only = all(i.seq.state == SeqState.DECODE for i in plan.items)
        context = sum(i.seq.num_computed + i.num_tokens for i in plan.items)   # K/V positions read
        decode = plan.num_decode
        chunks = tuple((i.seq.id, i.num_tokens) for i in plan.items
                       if i.seq.state != SeqState.DECODE and i.seq.id not in errors)
        self.scheduler.advance(plan)
        if self.reuse is not None:
            self.reuse.publish(plan, errors)
        now = time.monotonic()
        # a verify round emits 1 + accepted tokens (or more with the bonus): count them all
        decode += sum(len(v.tokens) - 1 for v in sampled.values() if not isinstance(v, tuple))
        if self.spec is not None and whole:
            self.spec.record_step(plan, seconds, decode, drafting)
        if self.traffic is not None and whole and decode_only:
            self.traffic.add(now, seconds, plan.num_tokens, context)
        self.counts.add(now, plan.num_tokens - plan.num_decode - plan.num_draft, decode, plan.num_tokens)

        tokens: list[msg.TokenDelta] = []
        ends: list[tuple[Sequence, str, str | None]] = []
        for item in plan.items:
            seq = item.seq
            if seq.id in errors:
                ends.append((seq, "error", errors[seq.id]))
                continue
            if not item.samples:
                continue
            mine: list[msg.TokenDelta] = []
            try:
                if seq.spec is not None:
                    reason = self._append_spec(item, sampled[seq.id], now, mine)
                else:
                    deltas, reason = self.output.on_token(seq, sampled[seq.id], now)
                    mine += deltas
            except Exception as exc:   # this request's output went wrong: it ends, the others go on
                ends.append((seq, "error", f"output processing failed: {describe_error(exc)}"))
                continue
            tokens += mine
            if reason:
                ends.append((seq, reason, None))
        self._end(ends, tokens, tuple(s.id for s in plan.preempted), prefilled=chunks)

    def _propose(self, plan: StepPlan) -> StepPlan:
        """The draft model's proposals; when it fails, the requests it drafted for fail with it
        and the rest of the step runs."""
        try:
            self.spec.propose(plan, self.blocks)
            return plan
        except Exception as exc:
            drafted = [i for i in plan.items if i.draft and i.seq.spec is not None and i.seq.spec.mode == "draft"]
            self._end([(i.seq, "error", f"the draft model failed: {describe_error(exc)}") for i in drafted])
            return StepPlan([i for i in plan.items if i not in drafted], plan.preempted)

    def _execute(self, items: list[ScheduledSeq]) -> tuple[dict, dict, bool]:
        """The runner's step for items: (sampled, errors by request, whether it ran in one go).

        A step that raises is run again in halves, each request's random stream rewound first,
        down to the request whose part of the batch makes it fail: that request alone ends with
        the error, and the others get the tokens they would have had without it."""
        if not items:
            return {}, {}, True
        streams = [(s, s.stream_position()) for s in (i.seq.sampler for i in items)
                   if s is not None and not s.params.greedy]
        try:
            sampled, errors = self.runner.execute(StepPlan(items, []), self.blocks)
            return sampled, errors, True
        except Exception as exc:
            for sampler, position in streams:
                sampler.rewind(position)
            if len(items) == 1:
                return {}, {items[0].seq.id: f"model step failed: {describe_error(exc)}"}, False
        half = len(items) // 2
        first, second = self._execute(items[:half]), self._execute(items[half:])
        return {**first[0], **second[0]}, {**first[1], **second[1]}, False

    def _cache_delta(self) -> tuple:
        return self.reuse.cache.take_delta() if self.reuse is not None else ()

    def _kv_blocks(self) -> tuple:
        return self.reuse.cache.take_blocks() if self.reuse is not None else ()

    def _end(self, ends, tokens=(), preempted: tuple[str, ...] = (), emit: bool = True,
             prefilled: tuple[tuple[str, int], ...] = ()) -> None:
        """The one way requests finish: each (seq, reason, error) leaves the scheduler, gives
        its pages back and becomes a Finished event, emitted in one StepEvents with `tokens`.
        A request refused at submission never entered the scheduler: it only gets its event."""
        finished = []
        for seq, reason, error in list(ends):
            if seq.state == SeqState.FINISHED:
                continue
            if seq.id in self.seqs:
                self.scheduler.remove(seq)
                self.runner.end_sequence(seq)
            if self.spec is not None:
                self.spec.end(seq)
            seq.state = SeqState.FINISHED
            seq.finish_reason, seq.error = reason, error
            seq.finished_at = time.monotonic()
            self.seqs.pop(seq.id, None)
            finished.append(self.output.finished_event(seq))
        if emit and (tokens or finished or preempted or prefilled):
            self.emit(msg.StepEvents(self.index, tuple(tokens), tuple(finished), preempted,
                                     self._cache_delta(), self._kv_blocks(), prefilled))

    def _append_spec(self, item, result, now: float, tokens: list) -> str | None:
        """A speculating request: roll back what was rejected, then process the emitted tokens
        one by one exactly as plain decoding would (a stop inside the run ends it there).
        Returns the finish reason when one of them ends the request."""
        seq = item.seq
        verdict = result if isinstance(result, Verdict) else None
        self.spec.settle(item, verdict, self.blocks)
        runs = [(result, False)] if verdict is None else [
            (SampledToken(token, verdict.logprobs[i], verdict.top[i] if verdict.top else ()), i < verdict.accepted)
            for i, token in enumerate(verdict.tokens)]
        for sample, drafted in runs:
            deltas, reason = self.output.on_token(seq, sample, now, drafted=drafted)
            tokens += deltas
            if reason:
                return reason
        return None

    def _fail_unschedulable(self) -> None:
        """Nothing fits although nothing runs: the head request can never fit this pool."""
        if self.scheduler.running or not self.scheduler.waiting:
            return
        seq = self.scheduler.waiting[0]
        pages = f"{self.pool.num_pages} page{'s' if self.pool.num_pages != 1 else ''}"
        self._end([(seq, "error", f"the request needs more KV pages than this worker has ({pages} of "
                    f"{self.cfg.page_size} tokens); raise `kv_cache_memory` or lower max_tokens")])

    # --- stats ------------------------------------------------------------------------
    def _maybe_send_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats < STATS_INTERVAL:
            return
        self._last_stats = now
        prefill_tps, decode_tps = self.counts.rates()
        seqs = tuple(msg.SeqView(s.id, s.state.value, len(s.prompt_ids), s.num_cached, s.num_computed,
                                 len(s.output_ids), s.params.max_tokens, leader=s.leader, spec=spec_dict(s))
                     for s in self.seqs.values())
        self.emit(msg.WorkerStats(
            worker=self.index, running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            pages_total=self.pool.num_pages, pages_used=self.pool.num_used,
            page_states=self.pool.states(), prefill_tps=prefill_tps, decode_tps=decode_tps,
            steps=self.counts.steps, tokens_in_last_step=self.counts.last_step_tokens, policy=self.scheduler.policy,
            seqs=seqs, prefill_tokens_total=self.counts.prefill_total, decode_tokens_total=self.counts.decode_total,
            preemptions_total=self.scheduler.preemptions,
            recomputed_tokens_total=self.scheduler.recomputed_tokens,
            prefix=self.reuse.stats() if self.reuse is not None else {},
            kv_residency=self.pool.residency.as_dict(),
            spec=self.spec.stats_dict() if self.spec is not None else None,
            roofline=self.traffic.as_dict(now) if self.traffic is not None else None))


def worker_main(index: int, cfg: WorkerConfig, model_path: str, commands, events) -> None:
    """Entry point of a worker process or thread. Never raises: death is an event."""
    try:
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        worker = Worker(index, cfg, model_path, events.put)
        worker.run(commands)
    except BaseException as exc:  # noqa: BLE001 - report, then die quietly
        detail = describe_error(exc)
        if not isinstance(exc, TokentopError):
            detail += "\n" + traceback.format_exc(limit=8)
        events.put(msg.WorkerDead(index, detail))
