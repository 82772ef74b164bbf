"""Build the snapshot's views (engine/facade/snapshot.py) from the facade's state.

A view field that a worker report (WorkerStats) or the worker's ready message (WorkerInfo)
already carries under the same name is taken from it by name, so a field added to both
travels without a line here; only fields that are computed or renamed are spelled out.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import fields

from engine import messages as msg
from engine.facade.procstat import UsageSampler
from engine.facade.requests import TEXT_TAIL, RequestRecord, seen_timings
from engine.facade.snapshot import RequestView, WorkerView
from engine.facade.workers import WorkerSlot, WorkerState

# view fields worker_view() computes; every other field of the same name in WorkerInfo or
# WorkerStats is carried over as it is
_COMPUTED = frozenset({"index", "device", "model", "simulated", "state", "message", "prefill_history",
                       "decode_history", "profile_prefill_tps", "profile_decode_tps", "max_active",
                       "preemptions", "recomputed_tokens", "cpu_percent", "rss_bytes", "prefix_cache",
                       "hit_rate", "remote_url", "spec_history", "respawns"})
_CARRIED = frozenset(f.name for f in fields(WorkerView)) - _COMPUTED
_FROM_INFO = tuple(f.name for f in fields(msg.WorkerInfo) if f.name in _CARRIED)
_FROM_STATS = tuple(f.name for f in fields(msg.WorkerStats) if f.name in _CARRIED)
# what the view shows before the first report
_STATS_DEFAULTS = {"running": 0, "waiting": 0, "prefill_tps": 0.0, "decode_tps": 0.0, "steps": 0,
                   "pages_used": 0, "prefix": {}, "kv_usage": None, "spec": None}


class SnapshotBuilder:
    def __init__(self):
        self._usage = UsageSampler()

    def worker_view(self, w: WorkerSlot) -> WorkerView:
        s, info = w.stats, w.info_or_config()
        carried = {name: getattr(info, name) for name in _FROM_INFO}
        if s is not None:
            carried |= {name: getattr(s, name) for name in _FROM_STATS}
        else:
            carried |= _STATS_DEFAULTS | {"pages_total": info.pages, "page_states": bytes(info.pages),
                                          "policy": w.cfg.policy}
        cpu, rss = self._usage_of(w)
        pre, dec = w.profile
        return WorkerView(
            **carried, index=w.index, device=w.cfg.device,
            model=info.model if w.cfg.remote and w.info else w.cfg.model,   # a remote: what it serves
            simulated=w.cfg.simulated, state=w.state.value, message=w.message,
            prefill_history=tuple(w.prefill_hist), decode_history=tuple(w.decode_hist),
            profile_prefill_tps=pre, profile_decode_tps=dec, max_active=w.cfg.max_active,
            preemptions=s.preemptions_total if s else 0,
            recomputed_tokens=s.recomputed_tokens_total if s else 0,
            cpu_percent=cpu, rss_bytes=rss, prefix_cache=info.prefix_cache == "on",
            hit_rate=window_rate(w.prefix_hist), remote_url=info.url if w.cfg.remote else None,
            spec_history=tuple(w.spec_hist), respawns=w.respawns)

    def _usage_of(self, w: WorkerSlot) -> tuple[float | None, int | None]:
        if w.state not in (WorkerState.READY, WorkerState.LOADING) or w.process is None:
            return None, None
        if isinstance(w.process, threading.Thread):
            return self._usage.sample(w.index, None, w.process.native_id)
        return self._usage.sample(w.index, w.process.pid)


def request_view(r: RequestRecord, now: float | None = None) -> RequestView:
    now = time.monotonic() if now is None else now
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
        spec=r.spec, drafted_spans=tail_spans(r.drafted, len(r.text)),
        finish_reason=r.finish_reason, prompt=r.prompt_text, params=r.params,
        notice=r.notice, leader=r.leader if r.finish_reason is None else None)


def window_rate(hist: deque) -> float | None:
    """Hit tokens / looked-up tokens over the samples in hist (None: no lookups there)."""
    if len(hist) < 2:
        return None
    (q0, h0), (q1, h1) = hist[0], hist[-1]
    return (h1 - h0) / (q1 - q0) if q1 > q0 else None


def tail_spans(spans: list, text_len: int) -> tuple[tuple[int, int], ...]:
    """Drafted [start, end) ranges, relative to the text tail the snapshot carries."""
    off = max(0, text_len - TEXT_TAIL)
    return tuple((max(0, a - off), b - off) for a, b in spans if b > off)
