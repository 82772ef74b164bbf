"""The interface between a worker loop and what runs its steps: the real model
(engine/worker/runner.py, ModelRunner) or a simulated device (engine/worker/sim.py, SimRunner).

A worker kind names its runner class in engine/worker_kinds.py; the loop builds it as
`Runner(cfg, model_path)`, sizes the KV pool from `bytes_per_slot` and `model_context`, and
calls `allocate_kv` once, then `start_sequence` / `execute` / `end_sequence` per request."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from engine.trace import get_tracer

if TYPE_CHECKING:
    from engine.kv.pages import BlockManager
    from engine.models.tokenizer import Tokenizer
    from engine.worker.output import StepOutput
    from engine.worker.scheduler import StepPlan
    from engine.worker.sequence import Sequence


class Runner(Protocol):
    tokenizer: Tokenizer
    model_context: int         # the model's own context length
    bytes_per_slot: int        # KV bytes per token position, for sizing the page pool
    info: dict                 # WorkerInfo fields the runner knows (model, arch, dtype, ...)

    wants_cuda_graphs: bool = False   # capture_cuda_graphs should run once the KV store exists

    def allocate_kv(self, num_slots: int) -> None: ...

    def capture_cuda_graphs(self, page_size: int, max_context: int) -> str:
        """Capture the decode steps as CUDA graphs (engine/worker/cuda_graphs.py); returns the
        summary line for the log."""
        raise NotImplementedError

    def start_sequence(self, seq: Sequence) -> None:
        """Give a new sequence what sampling and detokenization need (seq.sampler, seq.detok)."""

    def end_sequence(self, seq: Sequence) -> None: ...

    def execute(self, plan: StepPlan, blocks: BlockManager) -> StepOutput:
        """Run one step of the scheduler's plan; a token per sequence that samples."""

    # tracing goes through the thread's tracer, the same for every runner
    def set_trace_detail(self, detail: str) -> None:
        get_tracer().set_detail(detail)

    def trace_ring(self) -> list:
        return get_tracer().ring()
