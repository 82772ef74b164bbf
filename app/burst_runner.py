"""Fire a burst of requests at an interval from a background thread, then summarise it.

The dashboard never blocks on a burst: submissions happen on a daemon thread (a Textual
thread worker would make quitting wait for it), and the summary is computed from the
request handles once every request has finished.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from engine.errors import describe_error
from engine.pacing import paced
from engine.stats import percentile
from app.bursts import BurstItem


@dataclass(frozen=True)
class BurstPlan:
    path: Path
    count: int
    interval_ms: int
    max_tokens: int | None      # None: each line's own setting (or the default)
    temperature: float | None


@dataclass(frozen=True)
class BurstSummary:
    name: str
    requests: int
    ok: int
    failed: int
    aborted: int
    ttft_mean: float | None
    ttft_p95: float | None
    tokens_per_s: float
    seconds: float

    def text(self) -> str:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1000:.0f} ms"

        return (f"burst {self.name} done: {self.requests} requests ({self.ok} ok, {self.failed} failed, "
                f"{self.aborted} aborted), TTFT mean {ms(self.ttft_mean)} p95 {ms(self.ttft_p95)}, "
                f"{self.tokens_per_s:.0f} tok/s aggregate over {self.seconds:.1f} s")


class BurstRun:
    """One burst in flight against an Engine; `done` once it has fired and every request ended."""

    def __init__(self, engine, spec: BurstPlan, items: list[BurstItem], name: str):
        self.engine = engine
        self.spec = spec
        self.items = items
        self.name = name
        self.handles: list[tuple[float, object]] = []   # (submit time, RequestHandle)
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fire, name=f"burst-{name}", daemon=True)

    def start(self) -> "BurstRun":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop submitting (requests already submitted keep running)."""
        self._stop.set()

    @property
    def submitted(self) -> int:
        return len(self.handles)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive() and all(h.done for _, h in self.handles)

    def _fire(self) -> None:
        for i in paced(self.spec.count, self.spec.interval_ms / 1000, self._stop):
            item = self.items[i % len(self.items)]
            overrides = {"max_tokens": self.spec.max_tokens, "temperature": self.spec.temperature}
            params = replace(item.params, **{k: v for k, v in overrides.items() if v is not None})
            try:
                handle = self.engine.submit(item.prompt, messages=item.messages, params=params,
                                            burst=self.name)
            except Exception as exc:  # counted and logged; the burst goes on
                self.refused += 1
                self.engine.log("error", f"burst {self.name}: {item.source}: {describe_error(exc)}")
                continue
            self.handles.append((time.monotonic(), handle))

    def summary(self) -> BurstSummary:
        results = [(t, h.result(0)) for t, h in self.handles]
        ttfts = [r.metrics.ttft for _, r in results if r.metrics and r.metrics.ttft is not None]
        reasons = [r.finish_reason for _, r in results]
        tokens = sum(len(r.token_ids) for _, r in results)
        if results:
            first = min(t for t, _ in results)
            last = max(t + (r.metrics.e2e if r.metrics else 0.0) for t, r in results)
            seconds = max(last - first, 1e-9)
        else:
            seconds = 0.0
        return BurstSummary(
            name=self.name, requests=len(results) + self.refused,
            ok=sum(reason in ("stop", "length") for reason in reasons),
            failed=sum(reason == "error" for reason in reasons) + self.refused,
            aborted=sum(reason == "abort" for reason in reasons),
            ttft_mean=sum(ttfts) / len(ttfts) if ttfts else None,
            ttft_p95=percentile(ttfts, 95) if ttfts else None,
            tokens_per_s=tokens / seconds if seconds else 0.0, seconds=seconds)
