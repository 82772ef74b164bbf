"""The model runner of a real worker: turns a scheduler plan into one forward pass + sampling."""
from __future__ import annotations

import torch

from engine.config import WorkerConfig
from engine.errors import ConfigError
from engine.kv.pages import BlockManager
from engine.models.batch import ForwardBatch, KVStore, SeqSlice
from engine.scheduler import StepPlan
from engine.trace import get_tracer


def pick_activation_dtype(device: str, requested: str) -> torch.dtype:
    """bf16 on CPU: the activation dtype of dense forms (float tensors, no compiler); the GGUF
    kernels quantize activations to int8 themselves."""
    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if requested == "auto":
        return torch.bfloat16
    if requested not in table:
        raise ConfigError(f"--activation-dtype must be auto, bf16, fp16 or fp32, got {requested!r}")
    return table[requested]


def _kernel_label(model) -> str:
    """Which weight forms the linear layers use, e.g. 'gguf-avx512' or 'dense-bfloat16'."""
    from engine import kernels
    from engine.models.quant import QuantLinear

    forms = sorted({f for m in model.modules() if isinstance(m, QuantLinear) for f in m.kernel_forms()})
    return "+".join(f"gguf-{kernels.isa_name()}" if f == "gguf" else f for f in forms)


class ModelRunner:
    def __init__(self, cfg: WorkerConfig, model_path: str):
        from engine.models.decoder import Decoder
        from engine.models.gguf import load_gguf
        from engine.models.quant import LinearPolicy
        from engine.models.selfcheck import check_linears
        from engine.models.tokenizer import Tokenizer

        self.cfg = cfg
        self.device = torch.device(cfg.device)
        dtype = pick_activation_dtype(cfg.device, cfg.activation_dtype)
        gf = load_gguf(model_path)
        self.config = gf.config
        self.tokenizer = Tokenizer.from_metadata(gf.metadata)
        self.policy = LinearPolicy(activation_dtype=dtype, weights=cfg.weights,
                                   deterministic=cfg.deterministic, device=cfg.device)
        self.model = Decoder.from_gguf(gf, self.policy)
        with get_tracer().scope("selfcheck", model=cfg.model):
            check_linears(self.model, cfg.weights)   # refuses a layout this CPU computes wrongly
        self.model_context = gf.config.context_length
        self.kv_dtype = torch.float32
        self.bytes_per_slot = KVStore.bytes_per_slot(
            gf.config.n_layers, gf.config.n_kv_heads, gf.config.head_dim, self.kv_dtype)
        self.kv: KVStore | None = None
        self.info = {"model": cfg.model, "arch": gf.config.arch, "dtype": str(dtype).replace("torch.", ""),
                     "weights": cfg.weights, "simulated": False, "layers": gf.config.n_layers,
                     "kernels": _kernel_label(self.model)}

    def allocate_kv(self, num_slots: int) -> None:
        self.kv = self.model.new_kv_store(num_slots, dtype=self.kv_dtype)

    def start_sequence(self, seq) -> None:
        from engine.models.tokenizer import IncrementalDetokenizer
        from engine.sampling import RequestSampler

        seq.sampler = RequestSampler(seq.params, seq.prompt_ids)
        seq.detok = IncrementalDetokenizer(self.tokenizer)

    def end_sequence(self, seq) -> None:
        seq.sampler = None

    @torch.inference_mode()
    def execute(self, plan: StepPlan, blocks: BlockManager) -> tuple[dict, dict]:
        batch, samplers, sample_ids = self.build_batch(plan, blocks)
        logits = self.model(batch, self.kv)
        if not sample_ids:
            return {}, {}
        from engine.sampling import sample

        with get_tracer().scope("sampler", rows=len(samplers)):
            result = sample(logits, samplers)
        sampled, errors = {}, {}
        for row, seq_id in enumerate(sample_ids):
            if row in result.errors:
                errors[seq_id] = str(result.errors[row])
                continue
            top = result.top_logprobs[row] if result.top_logprobs else ()
            sampled[seq_id] = (int(result.tokens[row]), float(result.logprobs[row]), top)
        return sampled, errors

    def build_batch(self, plan: StepPlan, blocks: BlockManager):
        token_ids: list[int] = []
        positions: list[int] = []
        write_slots: list[torch.Tensor] = []
        seqs: list[SeqSlice] = []
        logits_rows: list[int] = []
        samplers, sample_ids = [], []
        for item in plan.items:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed
            row = len(token_ids)
            token_ids += seq.pending_ids(n)
            positions += range(start, start + n)
            slots = blocks.slots(seq, 0, start + n)
            write_slots.append(slots[start:])
            seqs.append(SeqSlice(row, n, start + n, slots, blocks.contiguous_start(seq)))
            if item.samples:
                logits_rows.append(row + n - 1)
                samplers.append(seq.sampler)
                sample_ids.append(seq.id)
        batch = ForwardBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            write_slots=torch.cat(write_slots),
            seqs=seqs,
            logits_rows=torch.tensor(logits_rows, dtype=torch.int64))
        return batch, samplers, sample_ids

    def set_tracing(self, enabled: bool) -> None:
        get_tracer().set_enabled(enabled)

    def drain_trace(self) -> list:
        return get_tracer().drain()
