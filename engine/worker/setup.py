"""The steps that build a worker (engine/worker/loop.py's `Worker`), in the order it runs them:
the kernels, its runner (by its kind, engine/worker_kinds.py), the KV pool's size, speculation,
prefix reuse, and the speed profile. Each says what it is doing through `say` (a WorkerLoading)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine import kernels
from engine import messages as msg
from engine.config import DEFAULT_MAX_CONTEXT, WorkerConfig
from engine.errors import ConfigError, describe_error
from engine.kv.pages import BlockManager, PagePool
from engine.kv.prefix_cache import model_identity
from engine.kv.reuse import PrefixReuse
from engine.speculative.controller import SpecController
from engine.trace import get_tracer
from engine.worker.profile import worker_profile
from engine.worker.runner_api import Runner
from engine.worker.scheduler import Scheduler
from engine.worker_kinds import WorkerKind, load

Say = Callable[[str], None]


def start_kernels(kind: WorkerKind, say: Say) -> bool:
    """Load the quantized kernels where the kind uses them; True while they still build. On first
    use they compile in the background while the worker serves on the torch fallback, and it
    switches to them between steps."""
    if not kind.quantized_kernels:
        return False
    if kernels.building():            # another worker of this process started it
        return True
    if kernels.build_pending():
        say("quantized kernels building in the background (first use only); serving on torch matmuls meanwhile")
        kernels.start_background_build()
        return True
    if not kernels.is_loaded():
        kernels.load()
    return False


def switch_kernels(runner: Runner, index: int, emit: Callable[[msg.KernelsSwitched], None]) -> bool:
    """Load the built kernels and rebuild the model on them; if either fails, say why and keep
    serving on the fallback. True when it switched."""
    ok = kernels.available() if kernels.is_loaded() else kernels.finish_background_build()
    if not ok:
        emit(msg.KernelsSwitched(index, runner.info.get("kernels", ""), kernels.status()["reason"] or "the build failed"))
        return False
    try:
        label = runner.switch_to_kernels()
    except Exception as exc:   # a kernel that fails its self-check: the fallback stays
        emit(msg.KernelsSwitched(index, runner.info.get("kernels", ""), describe_error(exc)))
        return False
    emit(msg.KernelsSwitched(index, label))
    return True


def build_runner(kind: WorkerKind, cfg: WorkerConfig, model_path: str) -> Runner:
    return load(kind.runner)(cfg, model_path)


@dataclass(frozen=True)
class KVSize:
    pages: int
    region_pages: int          # pages of one whole context (a contiguous sequence's region)
    max_context: int
    capped_by_kv: bool         # the pool, not the model or `max_context`, limits the context


def size_kv(cfg: WorkerConfig, runner: Runner) -> KVSize:
    max_context = min(cfg.max_context or DEFAULT_MAX_CONTEXT, runner.model_context)
    pages = cfg.kv_cache_memory // (runner.bytes_per_slot * cfg.page_size)
    if pages < 1:   # also refused at start-up, from the model's header
        raise ConfigError(f"`kv_cache_memory={cfg.kv_cache_memory}` bytes is less than one KV page; "
                          "use e.g. `kv_cache_memory=256MiB`")
    region_pages = -(-max_context // cfg.page_size)
    if cfg.kv_cache == "contiguous":
        return KVSize(max(pages, region_pages), region_pages, max_context, False)
    if pages * cfg.page_size < max_context:
        # no sequence can outgrow the pool: its size is the real context limit
        return KVSize(pages, region_pages, pages * cfg.page_size, True)
    return KVSize(pages, region_pages, max_context, False)


def allocate_kv(runner: Runner, cfg: WorkerConfig, kv: KVSize, say: Say) -> None:
    runner.allocate_kv(kv.pages * cfg.page_size)
    if runner.wants_cuda_graphs:
        say("capturing CUDA graphs")
        runner.capture_cuda_graphs(cfg.page_size, kv.max_context)


def build_scheduler(cfg: WorkerConfig, kv: KVSize) -> Scheduler:
    pool = PagePool(kv.pages, cfg.page_size)
    return Scheduler(BlockManager(pool, cfg.kv_cache, kv.region_pages), max_active=cfg.max_active,
                     max_batched_tokens=cfg.max_batched_tokens, max_context=kv.max_context, policy=cfg.policy,
                     prefill_chunk=64 if cfg.deterministic else 0)


def start_speculation(kind: WorkerKind, cfg: WorkerConfig, runner: Runner, blocks: BlockManager,
                      say: Say) -> SpecController | None:
    """Speculative decoding (engine/speculative/), where the kind runs a model."""
    if not kind.speculates:
        return None
    spec = SpecController(cfg, runner, blocks)
    if cfg.speculate != "off" or spec.draft is not None:
        say("measuring verify and draft step costs")
        spec.calibrate()   # else on the first speculating request
    return spec


def start_prefix_reuse(cfg: WorkerConfig, scheduler: Scheduler) -> PrefixReuse | None:
    if cfg.prefix_cache != "on" or cfg.kv_cache != "paged":
        return None
    reuse = PrefixReuse(scheduler.blocks.pool, model_identity(cfg.model, cfg.activation_dtype, cfg.simulated),
                        cfg.single_flight, align=scheduler.prefill_chunk, tracer=get_tracer())
    scheduler.enable_reuse(reuse)
    return reuse


def speed_profile(kind: WorkerKind, cfg: WorkerConfig, runner: Runner, blocks: BlockManager,
                  model_path: str, say: Say) -> dict:
    """The rates the router divides by: declared, cached or measured; {} when not wanted."""
    if not (cfg.calibrate or kind.declared_rates):
        return {}
    say("measuring prefill / decode speed (first use only)")
    return worker_profile(runner, blocks, cfg, model_path)


def ready_info(worker, kv: KVSize, profile: dict) -> msg.WorkerInfo:
    """What the facade learns of a worker once it is ready (`WorkerReady`)."""
    cfg = worker.cfg
    return msg.WorkerInfo(**{
        **worker.runner.info, "pages": kv.pages, "page_size": cfg.page_size,
        "max_context": worker.max_context, "context_capped_by_kv": kv.capped_by_kv,
        "kv_bytes": kv.pages * cfg.page_size * worker.runner.bytes_per_slot,
        "device": cfg.device, "simulated": cfg.simulated, "name": cfg.name or cfg.device,
        "max_active": cfg.max_active, "policy": cfg.policy, "kv_cache": cfg.kv_cache,
        "prefix_cache": "on" if worker.reuse else "off", "single_flight": cfg.single_flight,
        "profile_prefill_tps": profile.get("prefill_tps", 0.0),
        "profile_decode_tps": profile.get("decode_tps", 0.0),
        "profile_source": profile.get("source", "none"),
        "spec_modes": worker.spec.modes if worker.spec else ("off",),
        "draft_model": cfg.draft_model if worker.spec and worker.spec.draft else "",
        "kernels_building": worker.kernels_pending,
    })
