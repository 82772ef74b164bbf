"""Validated settings: one dataclass per concern, no behaviour beyond checking itself."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import ConfigError, InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0                # in (0, 1]
    top_k: int = 0                    # 0 = off
    min_p: float = 0.0                # in [0, 1)
    repetition_penalty: float = 1.0   # > 0; 1 = off (HF/llama.cpp style, on logits)
    presence_penalty: float = 0.0     # OpenAI style, subtracted once per seen token
    frequency_penalty: float = 0.0    # OpenAI style, subtracted per occurrence
    seed: int | None = None           # same seed => same output
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0                 # top-n logprobs per generated token, 0 = off

    def validate(self) -> "SamplingParams":
        def bad(msg: str) -> None:
            raise InvalidRequest(msg)

        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 <= self.min_p < 1.0):
            bad(f"min_p must be in [0, 1), got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if not (0 <= self.logprobs <= 20):
            bad(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop strings must be non-empty strings")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


KV_MODES = ("paged", "contiguous")
SCHED_POLICIES = ("fcfs", "spf")


@dataclass(frozen=True)
class WorkerConfig:
    """One worker = one device with its own model copy, scheduler, KV cache and runner."""

    device: str = "cpu"                   # cpu | cuda:N | sim:NAME
    model: str = "qwen2.5-coder-0.5b"     # catalog name, .gguf path or hub ref
    threads: int = 0                      # 0 = all cores torch sees
    max_active: int = 8
    max_batched_tokens: int = 512
    max_context: int = 4096               # per sequence, prompt + output (capped by the model's)
    page_size: int = 16
    kv_cache_memory: int = 256 * 2**20    # bytes for K and V pages together
    kv_cache: str = "paged"
    policy: str = "fcfs"
    deterministic: bool = False
    activation_dtype: str = "auto"        # auto | bf16 | fp16 | fp32
    weights: str = "faithful"             # faithful (the only mode: GGUF types as stored)
    compile: bool = False
    recalibrate: bool = False             # measure the speed profile again instead of the cached one
    calibrate: bool = True                # False: skip the profile (tests, benchmarks of one worker)
    # simulated workers only
    sim_prefill_tps: float = 0.0
    sim_decode_tps: float = 0.0
    sim_jitter: float = 0.0
    name: str = ""

    @property
    def simulated(self) -> bool:
        return self.device.startswith("sim:")

    def validate(self) -> "WorkerConfig":
        if self.max_active < 1:
            raise ConfigError(f"--max-active must be >= 1, got {self.max_active}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"--page-size must be a power of two, got {self.page_size}")
        if self.max_batched_tokens < 1:
            raise ConfigError(f"--max-batched-tokens must be >= 1, got {self.max_batched_tokens}")
        if self.kv_cache not in KV_MODES:
            raise ConfigError(f"--kv-cache must be one of {', '.join(KV_MODES)}, got {self.kv_cache!r}")
        if self.policy not in SCHED_POLICIES:
            raise ConfigError(f"--policy must be one of {', '.join(SCHED_POLICIES)}, got {self.policy!r}")
        if self.kv_cache_memory <= 0:
            raise ConfigError("--kv-cache-memory must be positive, e.g. 256MiB")
        return self


@dataclass(frozen=True)
class EngineConfig:
    workers: tuple[WorkerConfig, ...] = field(default_factory=lambda: (WorkerConfig(),))
    router_policy: str = "cost"
    trace_dir: str | None = None
    routing_log: str | None = None
    worker_mode: str = "process"          # process | thread
    worker_log: str | None = None         # process mode: workers' stdout/stderr go here (dashboard)
