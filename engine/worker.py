"""One worker = one device: its own runner (model copy), KV page pool, scheduler and loop.

The loop runs in its own OS process (default) or a thread (tests, `--worker-mode thread`).
It talks to the facade only through two queues: commands in, events out (engine/messages.py).
"""
from __future__ import annotations

import queue
import time
import traceback
from collections import deque
from contextlib import nullcontext

from engine import messages as msg
from engine.config import DEFAULT_MAX_CONTEXT, WorkerConfig
from engine.errors import ConfigError, TokentopError
from engine.kv.pages import BlockManager, PagePool
from engine.profile import worker_profile
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SeqState
from engine.trace import get_tracer

STATS_INTERVAL = 0.2     # seconds between WorkerStats events (5 Hz)
RATE_WINDOW = 2.0        # seconds of history behind the prefill / decode tok/s shown


class Worker:
    def __init__(self, index: int, cfg: WorkerConfig, model_path: str, emit):
        self.index = index
        self.cfg = cfg
        self.emit = emit
        emit(msg.WorkerLoading(index, f"loading {cfg.model} on {cfg.device}"))
        if cfg.simulated:
            from engine.sim import SimRunner
            self.runner = SimRunner(cfg, model_path)
        else:
            from engine import kernels
            from engine.runner import ModelRunner
            if cfg.device == "cpu" and not kernels.is_loaded():
                emit(msg.WorkerLoading(index, "building the quantized kernels (first use only, ~1 min)"))
                kernels.load()
            self.runner = ModelRunner(cfg, model_path)
        self.tokenizer = self.runner.tokenizer
        self.max_context = min(cfg.max_context or DEFAULT_MAX_CONTEXT, self.runner.model_context)
        num_pages = cfg.kv_cache_memory // (self.runner.bytes_per_slot * cfg.page_size)
        if num_pages < 1:   # also refused at start-up, from the model's header
            raise ConfigError(f"--kv-cache-memory {cfg.kv_cache_memory} bytes is less than one KV page; "
                              "use e.g. --kv-cache-memory 256MiB")
        region_pages = -(-self.max_context // cfg.page_size)
        capped_by_kv = False
        if cfg.kv_cache == "contiguous":
            num_pages = max(num_pages, region_pages)
        elif num_pages * cfg.page_size < self.max_context:
            # no sequence can outgrow the pool: its size is the real context limit
            self.max_context, capped_by_kv = num_pages * cfg.page_size, True
        self.runner.allocate_kv(num_pages * cfg.page_size)
        self.pool = PagePool(num_pages, cfg.page_size)
        self.blocks = BlockManager(self.pool, cfg.kv_cache, region_pages)
        self.scheduler = Scheduler(
            self.blocks, max_active=cfg.max_active, max_batched_tokens=cfg.max_batched_tokens,
            max_context=self.max_context, policy=cfg.policy,
            prefill_chunk=64 if cfg.deterministic else 0)
        # speculative decoding (engine/spec/): real runners only
        self.spec = None
        if not cfg.simulated:
            from engine.spec.controller import SpecController
            self.spec = SpecController(cfg, self.runner, self.blocks)
            if cfg.speculate != "off" or self.spec.draft is not None:
                emit(msg.WorkerLoading(index, "measuring verify and draft step costs"))
                self.spec.calibrate()   # else on the first speculating request
        self.reuse = None
        if cfg.prefix_cache == "on" and cfg.kv_cache == "paged":
            from engine.kv.prefix_cache import model_identity
            from engine.kv.reuse import PrefixReuse
            self.reuse = PrefixReuse(
                self.pool, model_identity(cfg.model, cfg.weights, cfg.activation_dtype, cfg.simulated),
                cfg.single_flight, align=self.scheduler.prefill_chunk, tracer=get_tracer())
            self.scheduler.enable_reuse(self.reuse)
        profile = {}
        if cfg.calibrate or cfg.simulated:
            emit(msg.WorkerLoading(index, "measuring prefill / decode speed (first use only)"))
            profile = worker_profile(self.runner, self.blocks, cfg, model_path)
        self.seqs: dict[str, Sequence] = {}
        self.steps = 0
        self.last_step_tokens = 0
        self.prefill_total = 0
        self.decode_total = 0
        self._history: deque[tuple[float, int, int]] = deque()
        self._last_stats = 0.0
        self.stopping = False
        emit(msg.WorkerReady(index, {
            **self.runner.info, "pages": num_pages, "page_size": cfg.page_size,
            "max_context": self.max_context, "context_capped_by_kv": capped_by_kv,
            "kv_bytes": num_pages * cfg.page_size * self.runner.bytes_per_slot,
            "device": cfg.device, "simulated": cfg.simulated, "name": cfg.name or cfg.device,
            "max_active": cfg.max_active, "policy": cfg.policy, "kv_cache": cfg.kv_cache,
            "prefix_cache": "on" if self.reuse else "off", "single_flight": cfg.single_flight,
            "profile_prefill_tps": profile.get("prefill_tps", 0.0),
            "profile_decode_tps": profile.get("decode_tps", 0.0),
            "profile_source": profile.get("source", "none"),
            "spec_modes": self.spec.modes if self.spec else ("off",),
            "draft_model": cfg.draft_model if self.spec and self.spec.draft else "",
        }))

    # --- loop -------------------------------------------------------------------------
    def run(self, commands) -> None:
        while not self.stopping:
            self._drain_commands(commands, block=self.scheduler.idle)
            if self.stopping:
                break
            if not self.scheduler.idle:
                self.step()
            self._maybe_send_stats()
        for seq in list(self.seqs.values()):
            self._finish(seq, "abort", "the engine shut down", [])
        self._maybe_send_stats(force=True)

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
                self._finish(seq, "abort", None, [])
                self.emit(msg.StepEvents(self.index, (), (self._finished_event(seq),)))
        elif isinstance(cmd, msg.SetPolicy):
            self.scheduler.set_policy(cmd.policy)
        elif isinstance(cmd, msg.SetTracing):
            self.runner.set_tracing(cmd.enabled)
        elif isinstance(cmd, msg.DrainTrace):
            self.emit(msg.TraceEvents(self.index, self.runner.drain_trace()))
        elif isinstance(cmd, msg.Stop):
            self.stopping = True

    def submit(self, cmd: msg.Submit) -> None:
        seq = Sequence(cmd.request_id, list(cmd.prompt_ids), cmd.params, arrival=cmd.arrival)
        try:
            pages_needed = -(-(len(seq.prompt_ids) + 1) // self.cfg.page_size)
            if len(seq.prompt_ids) + 1 > self.max_context:
                raise TokentopError(
                    f"prompt has {len(seq.prompt_ids)} tokens but this worker's context is "
                    f"{self.max_context}; shorten the prompt or raise --max-context")
            if pages_needed > self.pool.num_pages:
                raise TokentopError(
                    f"prompt needs {pages_needed} KV pages but the worker has {self.pool.num_pages}; "
                    "raise --kv-cache-memory")
            self.runner.start_sequence(seq)
            if self.spec is not None:
                self.spec.start(seq)
        except Exception as exc:  # refuse this one request, keep serving
            seq.finish_reason, seq.error = "error", _describe(exc)
            seq.finished_at = time.monotonic()
            self.emit(msg.StepEvents(self.index, (), (self._finished_event(seq),)))
            return
        self.seqs[seq.id] = seq
        self.scheduler.add(seq)

    # --- one step ---------------------------------------------------------------------
    def step(self) -> None:
        tracer = get_tracer()
        with tracer.scope("engine step", step=self.steps):
            self._step(tracer)
        if tracer.enabled:
            tracer.counter("kv pages", used=self.pool.num_used, cached=self.pool.num_cached,
                           free=self.pool.num_free - self.pool.num_cached)
            tracer.counter("requests", running=len(self.scheduler.running),
                           waiting=len(self.scheduler.waiting))
            tracer.counter("tokens in step", tokens=self.last_step_tokens)

    def _step(self, tracer) -> None:
        with tracer.scope("scheduler decision"):
            if self.spec is not None:
                self.spec.prepare(self.scheduler)
            plan = self.scheduler.schedule()
        if not plan.items:
            self._fail_unschedulable()
            return
        try:
            speculating = plan.num_draft > 0
            with tracer.scope("spec", drafts=plan.num_draft) if speculating else nullcontext():
                if speculating:
                    self.spec.propose(plan, self.blocks)
                t0 = time.perf_counter()
                sampled, errors = self.runner.execute(plan, self.blocks)
            if self.spec is not None:
                self.spec.record_step(plan, time.perf_counter() - t0)
        except Exception as exc:   # a fault in the forward fails this step's requests only
            reason = _describe(exc)
            finished = []
            for item in plan.items:
                self._finish(item.seq, "error", f"model step failed: {reason}", finished)
            self.emit(msg.StepEvents(self.index, (), tuple(finished), cache_delta=self._cache_delta()))
            return
        decode = plan.num_decode
        self.scheduler.advance(plan)
        if self.reuse is not None:
            self.reuse.publish(plan, errors)
        now = time.monotonic()
        # a verify round emits 1 + accepted tokens (or more with the bonus): count them all
        decode += sum(len(v.tokens) - 1 for v in sampled.values() if not isinstance(v, tuple))
        self._account(now, plan.num_tokens - plan.num_decode - plan.num_draft, decode, plan.num_tokens)

        tokens: list[msg.TokenDelta] = []
        finished: list[msg.Finished] = []
        for item in plan.items:
            seq = item.seq
            if seq.id in errors:
                self._finish(seq, "error", errors[seq.id], finished)
            elif item.samples and seq.spec is not None:
                self._append_spec(item, sampled[seq.id], now, tokens, finished)
            elif item.samples:
                self._append(seq, sampled[seq.id], now, tokens, finished)
        self.emit(msg.StepEvents(self.index, tuple(tokens), tuple(finished),
                                 tuple(s.id for s in plan.preempted), self._cache_delta()))

    def _cache_delta(self) -> tuple:
        return self.reuse.cache.take_delta() if self.reuse is not None else ()

    def _append_spec(self, item, result, now: float, tokens: list, finished: list) -> None:
        """A speculating request: roll back what was rejected, then append the emitted tokens
        one by one exactly as plain decoding would (a stop inside the run ends it there)."""
        from engine.spec.verify import Verdict

        seq = item.seq
        verdict = result if isinstance(result, Verdict) else None
        self.spec.settle(item, verdict, self.blocks)
        if verdict is None:
            self._append(seq, result, now, tokens, finished)
            return
        for i, token in enumerate(verdict.tokens):
            if seq.state == SeqState.FINISHED:
                break
            top = verdict.top[i] if verdict.top else ()
            self._append(seq, (token, verdict.logprobs[i], top), now, tokens, finished,
                         drafted=i < verdict.accepted)

    def _append(self, seq: Sequence, sample, now: float, tokens: list, finished: list,
                drafted: bool = False) -> None:
        token_id, logprob, top = sample
        seq.record_token(now)
        p = seq.params
        is_eog = token_id in self.tokenizer.eog_ids and not p.ignore_eos
        if is_eog or token_id in p.stop_token_ids:
            seq.output_ids.append(token_id)
            tail = seq.detok.flush() if seq.detok else ""
            self._emit_text(seq, tail, None, tokens, final=True)
            self._finish(seq, "stop", None, finished)
            return
        seq.output_ids.append(token_id)
        if seq.sampler is not None:
            seq.sampler.observe(token_id)
        delta = seq.detok.push(token_id) if seq.detok else ""
        stopped = self._emit_text(seq, delta, (token_id, logprob, top), tokens, final=False, drafted=drafted)
        if stopped:
            self._finish(seq, "stop", None, finished)
        elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_context:
            self._emit_text(seq, seq.detok.flush() if seq.detok else "", None, tokens, final=True)
            self._finish(seq, "length", None, finished)

    def _emit_text(self, seq: Sequence, delta: str, token, tokens: list, final: bool,
                   drafted: bool = False) -> bool:
        """Append text, honouring stop strings (held back until they can't start a stop)."""
        stops = seq.params.stop
        pending = seq.held_text + delta
        stopped = False
        if stops:
            hits = [(pending.find(s), s) for s in stops if s in pending]
            if hits:
                cut = min(h for h, _ in hits)
                pending, stopped = pending[:cut], True
                out, held = pending, ""
            elif final:
                out, held = pending, ""
            else:
                cut = max(0, len(pending) - (max(len(s) for s in stops) - 1))
                out, held = pending[:cut], pending[cut:]
        else:
            out, held = pending, ""
        seq.held_text = held
        seq.text += out
        if token is not None or out:
            token_id, logprob, top = token if token is not None else (-1, None, ())
            tokens.append(msg.TokenDelta(seq.id, token_id, out, logprob, tuple(top), drafted))
        return stopped

    def _finish(self, seq: Sequence, reason: str, error: str | None, finished: list) -> None:
        if seq.state == SeqState.FINISHED:
            return
        self.scheduler.remove(seq)
        self.runner.end_sequence(seq)
        seq.state = SeqState.FINISHED
        seq.finish_reason, seq.error = reason, error
        seq.finished_at = time.monotonic()
        self.seqs.pop(seq.id, None)
        finished.append(self._finished_event(seq))

    def _finished_event(self, seq: Sequence) -> msg.Finished:
        n_out = len(seq.output_ids)
        m = msg.RequestMetrics(
            prompt_tokens=len(seq.prompt_ids), cached_tokens=seq.num_cached, output_tokens=n_out,
            queue_time=None if seq.first_scheduled is None else seq.first_scheduled - seq.arrival,
            ttft=None if seq.first_token_at is None else seq.first_token_at - seq.arrival,
            itl_mean=seq.itl_sum / (n_out - 1) if n_out > 1 else None,
            itl_max=seq.itl_max if n_out > 1 else None,
            e2e=(seq.finished_at or time.monotonic()) - seq.arrival, preemptions=seq.preemptions,
            follow_start=None if seq.follow_since is None else seq.follow_since - seq.arrival,
            follow_time=seq.follow_time, spec=_spec_dict(seq))
        return msg.Finished(seq.id, seq.finish_reason or "error", seq.error, m)

    def _fail_unschedulable(self) -> None:
        """Nothing fits although nothing runs: the head request can never fit this pool."""
        if self.scheduler.running or not self.scheduler.waiting:
            return
        seq = self.scheduler.waiting[0]
        finished: list[msg.Finished] = []
        pages = f"{self.pool.num_pages} page{'s' if self.pool.num_pages != 1 else ''}"
        self._finish(seq, "error", f"the request needs more KV pages than this worker has ({pages} of "
                     f"{self.cfg.page_size} tokens); raise --kv-cache-memory or lower max_tokens", finished)
        self.emit(msg.StepEvents(self.index, (), tuple(finished)))

    # --- stats ------------------------------------------------------------------------
    def _account(self, now: float, prefill: int, decode: int, total: int) -> None:
        self.steps += 1
        self.last_step_tokens = total
        self.prefill_total += prefill
        self.decode_total += decode
        self._history.append((now, prefill, decode))
        while self._history and now - self._history[0][0] > RATE_WINDOW:
            self._history.popleft()

    def _rates(self) -> tuple[float, float]:
        if not self._history:
            return 0.0, 0.0
        now = time.monotonic()
        span = max(now - self._history[0][0], 0.25)
        if now - self._history[-1][0] > RATE_WINDOW:
            return 0.0, 0.0
        return (sum(h[1] for h in self._history) / span, sum(h[2] for h in self._history) / span)

    def _maybe_send_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats < STATS_INTERVAL:
            return
        self._last_stats = now
        prefill_tps, decode_tps = self._rates()
        seqs = tuple(msg.SeqView(s.id, s.state.value, len(s.prompt_ids), s.num_cached, s.num_computed,
                                 len(s.output_ids), s.params.max_tokens, leader=s.leader, spec=_spec_dict(s))
                     for s in self.seqs.values())
        self.emit(msg.WorkerStats(
            worker=self.index, running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            pages_total=self.pool.num_pages, pages_used=self.pool.num_used,
            page_states=self.pool.states(), prefill_tps=prefill_tps, decode_tps=decode_tps,
            steps=self.steps, tokens_in_last_step=self.last_step_tokens, policy=self.scheduler.policy,
            seqs=seqs, prefill_tokens_total=self.prefill_total, decode_tokens_total=self.decode_total,
            preemptions_total=self.scheduler.preemptions,
            recomputed_tokens_total=self.scheduler.recomputed_tokens,
            prefix=self.reuse.stats() if self.reuse is not None else {},
            spec=self.spec.stats.as_dict() if self.spec is not None else None))


def _spec_dict(seq: Sequence) -> dict | None:
    if seq.spec is None:
        return None
    return {"mode": seq.spec.mode, **seq.spec.stats.as_dict()}


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TokentopError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def worker_main(index: int, cfg: WorkerConfig, model_path: str, commands, events) -> None:
    """Entry point of a worker process or thread. Never raises: death is an event."""
    try:
        if cfg.threads:
            import torch
            torch.set_num_threads(cfg.threads)
        worker = Worker(index, cfg, model_path, events.put)
        worker.run(commands)
    except BaseException as exc:  # noqa: BLE001 - report, then die quietly
        detail = _describe(exc)
        if not isinstance(exc, TokentopError):
            detail += "\n" + traceback.format_exc(limit=8)
        events.put(msg.WorkerDead(index, detail))
