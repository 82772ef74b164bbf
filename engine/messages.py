"""What crosses the boundary between the engine facade and a worker (process or thread).

Plain picklable dataclasses only: a worker in another process receives commands and sends
events through multiprocessing queues, a worker thread through queue.Queue, same types.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import SamplingParams


# --- commands: facade -> worker --------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    arrival: float                 # time.monotonic() at the facade
    messages: tuple | None = None  # the chat messages, for a remote serving another model
    prompt_tokens: int | None = None   # the prompt's length on this worker, where it differs


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class SetPolicy:
    policy: str


@dataclass(frozen=True)
class SetTraceDetail:
    detail: str                   # off | light | full (engine/trace.py)


@dataclass(frozen=True)
class SendTrace:
    """Ask the worker to send a copy of its trace ring (it keeps recording)."""


@dataclass(frozen=True)
class Stop:
    pass


# --- events: worker -> facade ------------------------------------------------------------
@dataclass(frozen=True)
class WorkerLoading:
    worker: int
    message: str


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker tells the facade once it is ready: its model, memory and settings."""
    name: str
    model: str
    device: str
    dtype: str = "?"
    kv_dtype: str = "?"            # what its K/V store holds (float32, bfloat16, float16)
    arch: str = ""
    layers: int = 0
    simulated: bool = False
    pages: int = 0                 # KV pages in its pool (0: a remote worker has none here)
    page_size: int = 0
    max_context: int = 0           # per request, prompt + output
    context_capped_by_kv: bool = False
    kv_bytes: int = 0
    max_active: int = 0
    policy: str = ""
    kv_cache: str = ""
    prefix_cache: str = "off"      # on | off
    single_flight: str = "off"
    profile_prefill_tps: float = 0.0   # the speed profile (0: not calibrated)
    profile_decode_tps: float = 0.0
    profile_source: str = "none"
    sim_prefill_tps: float = 0.0   # a simulated worker's declared rates
    sim_decode_tps: float = 0.0
    remote: bool = False
    url: str | None = None         # a remote worker's server
    tokenize: str = ""             # a remote's prompt-length source (engine/remote/tokens.py TOKENIZE_*)
    spec_modes: tuple[str, ...] = ("off",)   # speculative decoding modes it can serve
    draft_model: str = ""          # its draft model, when it has one
    kernels: str = ""              # which weight forms its linear layers use, when it says
    kernels_building: bool = False  # on the torch fallback while its kernels build (first use)
    kernels_since: float = 0.0     # wall time it switched from that fallback to the kernels
    cuda_graphs: str = ""          # its captured decode graphs (buckets, memory), or why none
    note: str = ""
    summary: str = ""              # the ready line for the log, when the default one does not fit

    @classmethod
    def before_ready(cls, cfg) -> "WorkerInfo":
        """What is known of a worker from its WorkerConfig alone, until it reports ready."""
        return cls(name=cfg.name or cfg.device, model=cfg.model, device=cfg.device, page_size=cfg.page_size)


@dataclass(frozen=True)
class WorkerReady:
    worker: int
    info: WorkerInfo


@dataclass(frozen=True)
class WorkerDead:
    worker: int
    message: str


@dataclass(frozen=True)
class TokenDelta:
    request_id: str
    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    drafted: bool = False          # an accepted draft token (speculative decoding), not the target's
    # a remote worker's logprobs name tokens by their text (another model's ids mean nothing here)
    token_str: str | None = None
    top_strs: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class RequestMetrics:
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    queue_time: float | None       # arrival -> first scheduled (s)
    ttft: float | None             # arrival -> first token (s)
    itl_mean: float | None         # mean inter-token latency (s)
    itl_max: float | None
    e2e: float                     # arrival -> finished (s)
    preemptions: int = 0
    spec: dict | None = None       # speculative decoding counters (engine/speculative/stats.py)
    follow_start: float | None = None   # arrival -> started waiting on a leader (s)
    follow_time: float = 0.0            # seconds spent waiting on leaders (single flight)


@dataclass(frozen=True)
class Finished:
    request_id: str
    reason: str                    # stop | length | abort | error
    error: str | None
    metrics: RequestMetrics


@dataclass(frozen=True)
class StepEvents:
    """Everything one worker step produced, sent as one message to keep IPC cheap."""
    worker: int
    tokens: tuple[TokenDelta, ...]
    finished: tuple[Finished, ...]
    preempted: tuple[str, ...] = ()
    # prefix cache keys (8-byte prefixes) published (True) / evicted (False), in order:
    # the facade's picture of this worker's cache, for routing estimates
    cache_delta: tuple[tuple[bool, bytes], ...] = ()
    # the same pages in full for KV events (engine/serve/kv_events.py), in order: (key prefix,
    # parent's key prefix or None, page tokens) published, (key prefix, None, None) evicted
    kv_blocks: tuple[tuple[bytes, bytes | None, tuple[int, ...] | None], ...] = ()
    # (request id, prompt tokens) of each prefill chunk computed in the step: the timeline's chunks
    prefilled: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class SeqView:
    request_id: str
    state: str
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    output_tokens: int
    max_tokens: int
    spec: dict | None = None       # mode + speculative decoding counters, None = not speculating
    leader: str | None = None      # single flight: waiting for this request's pages


@dataclass(frozen=True)
class WorkerStats:
    """A worker's periodic self-portrait (a few Hz)."""
    worker: int
    running: int
    waiting: int
    pages_total: int
    pages_used: int
    page_states: bytes
    prefill_tps: float             # recent, measured over the last second or so
    decode_tps: float
    steps: int
    tokens_in_last_step: int
    policy: str
    seqs: tuple[SeqView, ...] = field(default_factory=tuple)
    prefill_tokens_total: int = 0
    decode_tokens_total: int = 0
    spec: dict | None = None       # the worker's speculative decoding totals
    # prefix cache counters (engine/kv/reuse.py stats(); empty when the cache is off)
    prefix: dict = field(default_factory=dict)
    preemptions_total: int = 0
    recomputed_tokens_total: int = 0   # prefill tokens spent recomputing preempted sequences
    kv_usage: float | None = None  # a remote's scraped KV cache usage (0..1), when it exposes one
    # a remote's requests from other clients: its scraped running + waiting beyond ours
    external_requests: int = 0
    # KV page residency (engine/kv/residency.py): {histogram: (counts per bucket, sum)}
    kv_residency: dict | None = None
    # decode steps' read GB/s and shares of the measured ceilings (engine/worker/roofline.py)
    roofline: dict | None = None


@dataclass(frozen=True)
class WorkerDown:
    """A remote worker stopped answering: no new requests until it is ready again."""
    worker: int
    message: str


@dataclass(frozen=True)
class WorkerDegraded:
    """A remote worker's stream stalled: no new requests until a probe sees it generate again."""
    worker: int
    message: str


@dataclass(frozen=True)
class Reroute:
    """A remote worker could not start this request (no token streamed): route it elsewhere."""
    worker: int
    request_id: str
    reason: str


@dataclass(frozen=True)
class KernelsSwitched:
    """A worker that started on the torch fallback while its kernels built now runs them
    (error: why it stays on the fallback)."""
    worker: int
    kernels: str                   # its linear layers' forms now (WorkerInfo.kernels)
    error: str = ""


@dataclass(frozen=True)
class ProfileUpdate:
    """A worker's measured rates changed (remote workers measure them from their streams)."""
    worker: int
    prefill_tps: float
    decode_tps: float


@dataclass(frozen=True)
class TraceEvents:
    worker: int
    events: list
