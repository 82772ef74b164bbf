"""What the engine's helpers (its dispatcher, its flight recorder) may use of it: a Protocol,
so that they depend on these parts and not on engine/facade/engine.py, which builds them."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.facade.event_log import EventLog
    from engine.facade.history import HistoryStore
    from engine.facade.latency import LatencyWindow
    from engine.facade.recorder import FlightRecorder
    from engine.facade.requests import RequestTable
    from engine.facade.router import RouteDecision, Router, WorkerLoad
    from engine.facade.timeline import TimelineStore
    from engine.facade.workers import WorkerSet


class EngineParts(Protocol):
    config: EngineConfig
    lock: threading.RLock           # guards the request table, the worker slots and the router
    stopping: bool
    workers: WorkerSet
    requests: RequestTable
    router: Router
    event_log: EventLog
    recorder: FlightRecorder
    latency: LatencyWindow
    timelines: TimelineStore
    history: HistoryStore

    def log(self, level: str, text: str) -> None: ...

    def notify(self, kind: str, payload) -> None: ...

    def add_observer(self, fn: Callable[[str, object], None]) -> None: ...

    def loads(self) -> list[WorkerLoad]: ...

    def record_route(self, decision: RouteDecision) -> None: ...
