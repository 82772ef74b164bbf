"""Immutable pictures of the engine for dashboards and JSON output.

The UI reads these a few times a second; it never reaches into engine internals and never
holds an engine lock while it renders.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from engine.config import SamplingParams
from engine.facade.router import RouteDecision


class RequestState(StrEnum):
    """Where a request is, as the engine, its snapshots, its traces and the UI name it."""
    QUEUED = "queued"        # routed, waiting on its worker (or preempted, waiting to recompute)
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"    # stop or length
    ABORTED = "aborted"
    ERROR = "error"

    @property
    def live(self) -> bool:
        return self in (RequestState.QUEUED, RequestState.PREFILL, RequestState.DECODE)

    @classmethod
    def of_worker(cls, seq_state: str) -> "RequestState":
        """From a worker's sequence state (engine/worker/sequence.py: waiting, prefill, decode, finished)."""
        return cls.QUEUED if seq_state == "waiting" else cls(seq_state)

    @classmethod
    def of_finish(cls, reason: str | None) -> "RequestState":
        """From a finish reason: stop | length | abort | error."""
        return {"abort": cls.ABORTED, "error": cls.ERROR}.get(reason, cls.FINISHED)


LIVE_STATES = tuple(s for s in RequestState if s.live)


@dataclass(frozen=True)
class RequestView:
    id: str
    worker: int | None
    state: RequestState
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    max_tokens: int
    queue_time: float | None
    ttft: float | None
    itl_mean: float | None
    e2e: float | None        # so far, while running
    text_tail: str
    error: str | None
    burst: str | None
    age: float               # seconds since submission
    leader: str | None = None   # single flight: waiting for this request's prefix pages
    finish_reason: str | None = None   # stop | length | abort | error, once it has ended
    prompt: str = ""                   # the text as submitted (a chat rendered by its template)
    params: SamplingParams | None = None
    notice: str | None = None   # how the request was taken, said once (e.g. max_tokens lowered)
    spec: dict | None = None    # speculative decoding: mode, drafts, acceptance, k (None = off)
    drafted_spans: tuple[tuple[int, int], ...] = ()   # [start, end) of text_tail from accepted drafts
    # where prompt_tokens came from: local (our tokenizer, the worker's model), remote (a remote
    # worker's /tokenize: it serves another model), estimate (our count standing in for its)
    prompt_source: str = "local"

    def __post_init__(self) -> None:   # a state given by name is checked and typed
        object.__setattr__(self, "state", RequestState(self.state))


@dataclass(frozen=True)
class WorkerView:
    index: int
    name: str
    device: str
    model: str
    dtype: str
    simulated: bool
    state: str               # engine/facade/workers.py WorkerState: starting | loading | ready | degraded | down | dead | stopped
    message: str
    running: int
    waiting: int
    prefill_tps: float
    decode_tps: float
    prefill_history: tuple[float, ...]
    decode_history: tuple[float, ...]
    pages_total: int
    pages_used: int
    page_states: bytes
    page_size: int
    policy: str
    steps: int
    profile_prefill_tps: float
    profile_decode_tps: float
    max_active: int
    prefix_cache: bool = False
    # counters from engine/kv/reuse.py stats(): prefix_cache_queries / prefix_cache_hits
    # (tokens; vLLM's names), cached_pages, evictions, single_flight_waits, ...
    prefix: dict = field(default_factory=dict)
    hit_rate: float | None = None   # hit / looked-up tokens over the last ~30 s
    kv_bytes: int = 0                  # memory of the whole KV page pool
    kv_dtype: str = "?"                # what its K/V store holds
    cpu_percent: float | None = None   # 100 = one core; None where it cannot be measured
    rss_bytes: int | None = None       # the worker process's resident memory (process mode)
    preemptions: int = 0          # since the worker started
    recomputed_tokens: int = 0    # tokens whose KV preemptions threw away, computed again
    spec: dict | None = None      # speculative decoding totals (engine/speculative/stats.py), None = sim
    roofline: dict | None = None  # decode read GB/s and shares of the machine's ceilings; None = not measured
    spec_history: tuple[float, ...] = ()   # acceptance rate of each stats report that verified drafts
    spec_modes: tuple[str, ...] = ("off",)
    draft_model: str = ""
    remote_url: str | None = None    # remote workers: the server requests are forwarded to
    kv_usage: float | None = None    # remote workers: KV usage scraped from its /metrics, if any
    kv_residency: dict | None = None   # engine/kv/residency.py's bucket counts (local workers)
    note: str = ""                   # e.g. how prompt lengths are counted for a remote
    respawns: int = 0                # times its process was started again after dying
    kernels: str = ""                # its linear layers' forms (e.g. gguf-avx512, dense-bfloat16)
    kernels_building: bool = False   # on the torch fallback while its kernels build
    kernels_since: float = 0.0       # wall time it switched from that fallback to the kernels


@dataclass(frozen=True)
class LogLine:
    time: float
    level: str               # info | warning | error
    text: str


@dataclass(frozen=True)
class EngineSnapshot:
    time: float
    workers: tuple[WorkerView, ...]
    requests: tuple[RequestView, ...]
    routing: tuple[RouteDecision, ...]
    router_policy: str
    log: tuple[LogLine, ...]
    tracing: bool
    uptime: float = 0.0                # seconds since the engine started
    trace_detail: str = "light"        # what the flight recorder records: off | light | full
    latency: dict = field(default_factory=dict)   # window name -> LatencyView (engine/facade/latency.py)
    alerts: tuple = ()                 # the Alerts active now (engine/facade/alerts.py)
    alert_counts: dict = field(default_factory=dict)   # (kind, worker name) -> episodes so far
    clock: float = 0.0                 # time.monotonic() when taken: the timelines' "now"
    timelines: dict = field(default_factory=dict)   # request id -> Timeline (engine/facade/timeline.py)
    history: dict = field(default_factory=dict)     # worker index -> History (engine/facade/history.py)
