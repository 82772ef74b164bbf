"""Validated settings: one dataclass per concern, no behaviour beyond checking itself."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import ConfigError, InvalidRequest
from engine.worker_kinds import WorkerKind, kind_of


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
    return_logprobs: bool = False     # the client wants logprobs back (a remote worker asks for them)
    speculate: str = ""               # "" = the worker's default, or off | ngram | suffix | draft
    spec_k: str = ""                  # "" = the worker's --spec-k, or N | adaptive:POLICY
    spec_tv_budget: float | None = None   # None = the worker's --spec-tv-budget
    cache_salt: str | None = None     # requests share cached KV pages only with the same salt

    def validate(self) -> "SamplingParams":
        """Refuse any value the engine cannot compute with: every number finite and in range,
        every count small enough for the int64 tensors it ends up in (one request's bad value
        must never reach a batch it shares with others)."""
        def bad(msg: str) -> None:
            raise InvalidRequest(msg)

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def number(name: str, lo: float | None = None, hi: float | None = None) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                bad(f"{name} must be a number, got {shown(v)}")
            try:
                v = float(v)
            except OverflowError:
                v = float("inf")
            if not math.isfinite(v):
                bad(f"{name} must be a finite number, got {shown(getattr(self, name))}")
            if (lo is not None and v < lo) or (hi is not None and v > hi):
                bad(f"{name} must be in [{lo:g}, {hi:g}], got {v:g}")
            return v

        if not is_int(self.max_tokens) or not 0 < self.max_tokens <= MAX_COUNT:
            bad(f"max_tokens must be a positive integer up to {MAX_COUNT}, got {shown(self.max_tokens)}")
        temperature = number("temperature")
        if temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
            bad(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature:g}")
        if not (0.0 < number("top_p") <= 1.0):
            bad(f"top_p must be in (0, 1], got {shown(self.top_p)}")
        if not is_int(self.top_k) or not 0 <= self.top_k <= MAX_COUNT:
            bad(f"top_k must be an integer from 0 (off) to {MAX_COUNT}, got {shown(self.top_k)}")
        if not (0.0 <= number("min_p") < 1.0):
            bad(f"min_p must be in [0, 1), got {shown(self.min_p)}")
        number("repetition_penalty", *REPETITION_PENALTY_RANGE)
        number("presence_penalty", *OPENAI_PENALTY_RANGE)
        number("frequency_penalty", *OPENAI_PENALTY_RANGE)
        if self.seed is not None and (not is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            bad(f"seed must be an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]}, got {shown(self.seed)}")
        if not is_int(self.logprobs) or not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be between 0 and 20, got {shown(self.logprobs)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop strings must be non-empty strings")
        if len(self.stop) > MAX_STOPS:
            bad(f"stop must hold at most {MAX_STOPS} strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            bad(f"stop strings must be at most {MAX_STOP_CHARS} characters each")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(
                not is_int(t) or not 0 <= t <= MAX_COUNT for t in self.stop_token_ids):
            bad(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids from 0 to {MAX_COUNT}")
        if self.speculate not in ("",) + SPEC_MODES:
            bad(f"speculate must be one of {', '.join(SPEC_MODES)}, got {shown(self.speculate)}")
        if self.spec_k and not spec_k_ok(self.spec_k):
            bad(f"spec_k must be a number 0-16 or one of {', '.join(SPEC_K_POLICIES)}, got {shown(self.spec_k)}")
        if self.spec_tv_budget is not None and not 0.0 <= number("spec_tv_budget") <= 1.0:
            bad(f"spec_tv_budget must be in [0, 1] (0 = lossless), got {shown(self.spec_tv_budget)}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            bad("cache_salt must be a non-empty string (or None to share the cache with unsalted requests)")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# Bounds of SamplingParams.validate
MAX_COUNT = 2**31 - 1                   # max_tokens, top_k, token ids: far past any model's
MIN_TEMPERATURE = 1e-5                  # below, (logit - max) / T leaves float32's range
REPETITION_PENALTY_RANGE = (0.01, 100.0)   # a seen logit is divided or multiplied by it
OPENAI_PENALTY_RANGE = (-2.0, 2.0)      # presence / frequency, as OpenAI and vLLM allow
SEED_RANGE = (-2**63, 2**64 - 1)        # what a torch.Generator takes
# every stop string is searched for in the held-back text after every token: the caps bound
# that work (64 searches of under 512 characters) and the text held back (255 characters)
MAX_STOPS = 64
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256

SPEC_MODES = ("off", "ngram", "suffix", "draft")
SPEC_K_POLICIES = ("adaptive:cost", "adaptive:acceptance", "adaptive:length")
KV_MODES = ("paged", "contiguous")
KV_DTYPES = ("auto", "fp32", "bf16", "fp16")   # auto: engine/facade/devices.py DEFAULT_KV_DTYPE
DEFAULT_MAX_CONTEXT = 4096   # when --max-context is not given (and the model allows that much)
SCHED_POLICIES = ("fcfs", "spf")
ROUTER_POLICIES = ("round-robin", "least-loaded", "cost", "cache-aware")
PREFIX_CACHE = ("on", "off")
SINGLE_FLIGHT = ("off", "after-prefill", "at-completion")
CUDA_GRAPHS = ("on", "off")

# Every setting field the command line sets, by the name it gives it: the flag `--NAME`, and
# `NAME=VALUE` among compare's settings. Engine messages say the field; app/flags.py renders
# the flag from this one map.
SETTING_NAMES = {name: name.replace("_", "-") for name in (
    # WorkerConfig: the engine flags, which every `device` starts from
    "device", "model", "threads", "max_active", "max_batched_tokens", "max_context", "page_size",
    "kv_cache_memory", "kv_cache", "kv_dtype", "policy", "deterministic", "activation_dtype",
    "recalibrate", "speculate", "draft_model", "spec_k", "spec_tv_budget", "ngram_min", "ngram_max",
    "prefix_cache", "single_flight",
    # EngineConfig
    "router_policy", "trace_dir", "routing_log", "worker_mode", "trace_detail", "trace_memory", "cuda_graphs",
    "trace_keep", "trace_keep_mib",
    # ServeConfig: the server's settings
    "host", "port", "api_key", "max_queue", "max_body")}
SETTING_NAMES |= {"workers": "device", "trace_window_s": "trace-window", "allowed_hosts": "allowed-host",
                  "per_request_metrics": "enable-per-request-metrics"}


def shown(value) -> str:
    """A client's value in an error message: its repr, cut short."""
    try:
        text = repr(value)
    except ValueError:            # an int too long to print
        text = "a number of more than 4300 digits"
    return text if len(text) <= 60 else text[:57] + "..."


def spec_k_ok(text: str) -> bool:
    """A draft length 0-16 in ASCII digits, or one of SPEC_K_POLICIES."""
    return text in SPEC_K_POLICIES or (len(text) <= 2 and text.isascii() and text.isdigit() and int(text) <= 16)


def check_scheduler_policy(policy: str) -> str:
    if policy not in SCHED_POLICIES:
        raise ConfigError(f"unknown scheduler policy {policy!r}: set `policy` to "
                          f"{' or '.join(SCHED_POLICIES)}")
    return policy


def check_router_policy(policy: str) -> str:
    if policy not in ROUTER_POLICIES:
        raise ConfigError(f"unknown router policy {policy!r}: set `router_policy` to "
                          f"{', '.join(ROUTER_POLICIES[:-1])} or {ROUTER_POLICIES[-1]}")
    return policy


@dataclass(frozen=True)
class RemoteOptions:
    """remote:URL's options (engine/remote/spec.py). The API key itself is never kept here, only
    the name of the environment variable that holds it: configs appear in logs and snapshots."""
    api_key_env: str = ""                 # the variable holding the Bearer key ("" = none)
    read_timeout: float = 120.0           # s a stream may stay silent before it counts as stalled
    ca_file: str = ""                     # CA bundle for an https server's certificate ("" = system)


@dataclass(frozen=True)
class WorkerConfig:
    """One worker = one device with its own model copy, scheduler, KV cache and runner."""

    device: str = "cpu"                   # cpu | cuda:N | sim:NAME
    model: str = "qwen2.5-coder-0.5b"     # catalog name, .gguf path or hub ref
    threads: int = 0                      # 0 = all cores torch sees (parse_devices splits them among CPU workers)
    max_active: int = 8
    max_batched_tokens: int = 512
    max_context: int = 0                  # per sequence, prompt + output; 0 = the model's, at most 4096
    page_size: int = 16
    kv_cache_memory: int = 256 * 2**20    # bytes for K and V pages together
    kv_cache: str = "paged"
    kv_dtype: str = "auto"                # K/V store dtype: auto | fp32 | bf16 | fp16
    policy: str = "fcfs"
    deterministic: bool = False
    activation_dtype: str = "auto"        # auto | bf16 | fp16 | fp32
    recalibrate: bool = False             # measure the speed profile again instead of the cached one
    calibrate: bool = True                # False: skip the profile (tests, benchmarks of one worker)
    # speculative decoding (engine/speculative/)
    speculate: str = "off"                # default mode of requests: off | ngram | suffix | draft
    draft_model: str = ""                 # catalog name or .gguf path of the draft model
    spec_k: str = "adaptive:cost"         # N (fixed draft length) or one of SPEC_K_POLICIES
    spec_tv_budget: float = 0.0           # mentored decoding: TV budget D (0 = lossless)
    spec_bonus: bool = True               # emit the target's token after a fully accepted draft
    ngram_min: int = 1                    # prompt lookup: shortest / longest n-gram matched
    ngram_max: int = 4
    prefix_cache: str = "on"              # on | off (paged KV only)
    single_flight: str = "after-prefill"  # off | after-prefill | at-completion
    cuda_graphs: str = "on"               # on | off: decode steps replay captured CUDA graphs (CUDA only)
    cuda_graphs_asked: bool = False       # --cuda-graphs was given: a CPU worker says it ignores it
    # simulated workers only
    sim_prefill_tps: float = 0.0
    sim_decode_tps: float = 0.0
    sim_jitter: float = 0.0
    remote_options: RemoteOptions = RemoteOptions()   # remote workers only
    name: str = ""

    @property
    def kind(self) -> WorkerKind | None:
        """What builds this worker and what it can do (engine/worker_kinds.py)."""
        return kind_of(self.device)

    @property
    def simulated(self) -> bool:
        """Labelled simulated: no model runs (sim:NAME)."""
        return self.kind is not None and self.kind.simulated

    @property
    def remote(self) -> bool:
        """Forwards requests to another server from a thread of the facade (remote:URL)."""
        return self.kind is not None and not self.kind.local

    def validate(self) -> "WorkerConfig":
        if self.threads < 0:
            raise ConfigError(f"`threads` must be 0 (all cores) or a positive count, got {self.threads}")
        if self.max_context == 1 or self.max_context < 0:
            raise ConfigError(f"`max_context` must be at least 2 tokens (a prompt token and an output "
                              f"token), got {self.max_context}; e.g. `max_context=4096`")
        if self.max_active < 1:
            raise ConfigError(f"`max_active` must be >= 1, got {self.max_active}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"`page_size` must be a power of two, got {self.page_size}")
        if self.max_batched_tokens < 1:
            raise ConfigError(f"`max_batched_tokens` must be >= 1, got {self.max_batched_tokens}")
        if self.kv_cache not in KV_MODES:
            raise ConfigError(f"`kv_cache` must be one of {', '.join(KV_MODES)}, got {self.kv_cache!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"`kv_dtype` must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        check_scheduler_policy(self.policy)
        if self.prefix_cache not in PREFIX_CACHE:
            raise ConfigError(f"`prefix_cache` must be on or off, got {self.prefix_cache!r}")
        if self.single_flight not in SINGLE_FLIGHT:
            raise ConfigError(f"`single_flight` must be one of {', '.join(SINGLE_FLIGHT)}, "
                              f"got {self.single_flight!r}")
        if self.cuda_graphs not in CUDA_GRAPHS:
            raise ConfigError(f"`cuda_graphs` must be on or off, got {self.cuda_graphs!r}")
        if self.kv_cache_memory <= 0:
            raise ConfigError("`kv_cache_memory` must be positive, e.g. `kv_cache_memory=256MiB`")
        # what the model needs per page is checked once its header is read (facade.limits.check_model_limits)
        if self.speculate not in SPEC_MODES:
            raise ConfigError(f"`speculate` must be one of {', '.join(SPEC_MODES)}, got {self.speculate!r}")
        if self.speculate == "draft" and not self.draft_model:
            raise ConfigError("`speculate=draft` needs `draft_model=NAME|PATH` "
                              "(e.g. `model=qwen2.5-coder-1.5b` `draft_model=qwen2.5-coder-0.5b`)")
        if self.draft_model and self.kv_cache == "contiguous":
            raise ConfigError("`draft_model` needs `kv_cache=paged` (the draft's pages come from the pool)")
        if not spec_k_ok(self.spec_k):
            raise ConfigError(f"`spec_k` must be a number 0-16 or one of {', '.join(SPEC_K_POLICIES)}, "
                              f"got {self.spec_k!r}")
        if not 0.0 <= self.spec_tv_budget <= 1.0:
            raise ConfigError(f"`spec_tv_budget` must be in [0, 1] (0 = lossless), got {self.spec_tv_budget}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"`ngram_min`/`ngram_max` need 1 <= min <= max, got {self.ngram_min}/{self.ngram_max}")
        return self


@dataclass(frozen=True)
class EngineConfig:
    workers: tuple[WorkerConfig, ...] = field(default_factory=lambda: (WorkerConfig(),))
    router_policy: str = "cost"
    trace_dir: str | None = None
    routing_log: str | None = None
    worker_mode: str = "process"          # process | thread
    worker_log: str | None = None         # process mode: workers' stdout/stderr go here (dashboard)
    # the flight recorder (engine/facade/recorder.py): what each worker and the facade keep for `t`
    trace_detail: str = ""                # off | light | full; "" = full with trace_dir, else light
    trace_window_s: float = 120.0         # the last this many seconds ...
    trace_memory: int = 64 * 2**20        # ... or this many bytes per ring, whichever is smaller
    trace_keep: int = 20                  # trace files kept in trace_dir, the oldest deleted ...
    trace_keep_mib: int = 512             # ... and at most this many MiB of them


def parse_size(text: str) -> int:
    """'256MiB', '1.5GiB', '512M', '1000000' -> bytes."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    s = text.strip().lower().replace("ib", "").replace("b", "")
    try:
        if s and s[-1] in units:
            return int(float(s[:-1]) * units[s[-1]])
        return int(float(s))
    except (ValueError, OverflowError):
        raise ConfigError(f"cannot read size {text!r}; write e.g. 256MiB or 2GiB") from None


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return ""
