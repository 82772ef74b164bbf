"""The model runner of a real worker: turns a scheduler plan into one forward pass + sampling."""
from __future__ import annotations

import contextlib

import torch

from engine import kernels
from engine.config import WorkerConfig
from engine.dtypes import check_activation_dtype, resolve_kv_dtype
from engine.errors import describe_error
from engine.kv.pages import BlockManager
from engine.models.batch import KV_TORCH_DTYPES, ForwardBatch, KVStore, SeqSlice
from engine.models.catalog import resolve_model
from engine.models.decoder import Decoder
from engine.models.gguf import load_gguf
from engine.models.quant import LinearPolicy, QuantLinear, pack_for_batches
from engine.models.selfcheck import check_linears
from engine.models.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.worker.cuda_graphs import DecodeGraphs, TorchCudaGraphs
from engine.worker.output import SampledToken, StepOutput
from engine.worker.prefetch import choose as choose_prefetch
from engine.worker.roofline import weight_traffic
from engine.worker.runner_api import Runner
from engine.worker.sampling import RequestSampler, SamplingError, sample
from engine.worker.scheduler import StepPlan
from engine.speculative.draft import DraftModel
from engine.speculative.verify import verify
from engine.trace import get_tracer


def pick_activation_dtype(device: str, requested: str) -> torch.dtype:
    """bf16 unless asked otherwise: the activation dtype of dense forms (float tensors, no
    compiler; the GGUF kernels quantize activations to int8 themselves); a dtype measured
    unfaithful on this device type is refused (engine/facade/devices.py)."""
    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    return table[check_activation_dtype(device, requested)]


def _kernel_label(model) -> str:
    """Which weight forms the linear layers use, e.g. 'gguf-avx512+gguf-avx512-tiles' (direct
    decode kernel, unpacked tiles for larger calls) or 'dense-bfloat16'."""
    forms = sorted({f for m in model.modules() if isinstance(m, QuantLinear) for f in m.kernel_forms()})
    return "+".join(f.replace("gguf", f"gguf-{kernels.isa_name()}", 1) if f.startswith("gguf") else f
                    for f in forms)


def wants_cuda_graphs(device: torch.device, cfg: WorkerConfig) -> bool:
    """Decode steps as CUDA graphs (engine/worker/cuda_graphs.py): on CUDA unless turned off.
    Deterministic mode stays eager: a padded batch's kernels are not the ones the same rows
    would get unpadded."""
    return device.type == "cuda" and cfg.cuda_graphs == "on" and not cfg.deterministic


@contextlib.contextmanager
def _one_thread_while_dequantizing(device: str):
    """Without the kernels (first use, while they build; no compiler) every linear layer is
    dequantized into a dense copy: torch's copies into it run on one thread, since OpenMP
    threads that share busy cores (the kernel build's compiler) wait for each other and took
    twice as long as one thread alone."""
    if device != "cpu" or kernels.available():
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class ModelRunner(Runner):
    def __init__(self, cfg: WorkerConfig, model_path: str):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        dtype = pick_activation_dtype(cfg.device, cfg.activation_dtype)
        gf = load_gguf(model_path)
        self.model_path = model_path
        self.config = gf.config
        self.tokenizer = Tokenizer.from_gguf(model_path, gf.metadata)
        self.policy = LinearPolicy(activation_dtype=dtype,
                                   deterministic=cfg.deterministic, device=cfg.device)
        with _one_thread_while_dequantizing(cfg.device):
            self.model = Decoder.from_gguf(gf, self.policy)
        with get_tracer().span("selfcheck", model=cfg.model):
            check_linears(self.model)   # refuses a layout this CPU computes wrongly
            pack_for_batches(self.model)
            choose_prefetch(self.model, model_path, cfg.recalibrate)
        self.draft = None   # speculative decoding's draft model, on this worker (engine/speculative/draft.py)
        if cfg.draft_model:
            with get_tracer().span("load draft", model=cfg.draft_model):
                self.draft = DraftModel(cfg, str(resolve_model(cfg.draft_model)), self.policy,
                                        self.tokenizer, gf.config.vocab_size)
                pack_for_batches(self.draft.model)
        self.model_context = gf.config.context_length
        self.kv_dtype = KV_TORCH_DTYPES[resolve_kv_dtype(cfg.device, cfg.kv_dtype)]
        self.bytes_per_slot = KVStore.bytes_per_slot(
            gf.config.n_layers, gf.config.n_kv_heads, gf.config.head_dim, self.kv_dtype)
        self.kv_bytes_per_token = self.bytes_per_slot          # the target's own, read by its steps
        self.weight_bytes, self.weight_macs = weight_traffic(gf)   # what one decode step reads
        if self.draft is not None:   # the draft's K/V share the slots (and the memory budget)
            self.bytes_per_slot += self.draft.bytes_per_slot
        self.kv: KVStore | None = None
        self.spec_bonus = cfg.spec_bonus
        self.wants_cuda_graphs = wants_cuda_graphs(self.device, cfg)
        self.graphs: DecodeGraphs | None = None
        self.scratch_slot: int | None = None
        self.info = {"model": cfg.model, "arch": gf.config.arch, "dtype": str(dtype).replace("torch.", ""),
                     "kv_dtype": str(self.kv_dtype).replace("torch.", ""),
                     "simulated": False, "layers": gf.config.n_layers,
                     "kernels": _kernel_label(self.model), "cuda_graphs": self._graphs_note()}

    def _graphs_note(self) -> str:
        """What the ready line says of CUDA graphs before any capture (empty: nothing to say)."""
        cfg = self.cfg
        if self.device.type != "cuda":
            return "`cuda_graphs` ignored: a CPU worker runs no CUDA graphs" if cfg.cuda_graphs_asked else ""
        if cfg.cuda_graphs == "off":
            return "off (`cuda_graphs=off`): every step runs eagerly"
        if cfg.deterministic:
            return "off under `deterministic`: every step runs eagerly"
        return ""

    def switch_to_kernels(self) -> str:
        """The model again, on the GGUF kernels a background build has just loaded, checked like
        the first; it replaces the torch-fallback model between two steps. The KV store and every
        sequence stay as they are: both models read and write the same K/V layout. A draft
        model keeps the form it was built with. Returns the new kernel label."""
        with get_tracer().span("switch to kernels", model=self.cfg.model):
            model = Decoder.from_gguf(load_gguf(self.model_path), self.policy)
            check_linears(model)
            pack_for_batches(model)
            choose_prefetch(model, self.model_path, self.cfg.recalibrate)
        self.model = model
        self.info["kernels"] = _kernel_label(model)
        return self.info["kernels"]

    def allocate_kv(self, num_slots: int) -> None:
        # with CUDA graphs: one slot more, past the pool, for the padded rows of a graph's batch
        self.scratch_slot = num_slots if self.wants_cuda_graphs else None
        self.kv = self.model.new_kv_store(num_slots + (1 if self.wants_cuda_graphs else 0), dtype=self.kv_dtype)
        if self.draft is not None:
            self.draft.allocate_kv(num_slots)

    def capture_cuda_graphs(self, page_size: int, max_context: int, api=None) -> str:
        """Capture the decode graphs over the KV store (after allocate_kv); returns the summary
        line. `api`: the graph calls (default torch.cuda's; tests pass a stand-in)."""
        if not self.wants_cuda_graphs or self.kv is None:
            raise RuntimeError("capture_cuda_graphs needs a CUDA worker with `cuda_graphs=on`, after allocate_kv")
        try:
            graphs = DecodeGraphs(self.model, self.kv, page_size, max_context, self.scratch_slot,
                                  api or TorchCudaGraphs(self.device))
            with get_tracer().scope("capture cuda graphs"):
                self.info["cuda_graphs"] = graphs.capture()
        except Exception as exc:   # a driver or op that refuses capture: the worker serves eagerly
            self.info["cuda_graphs"] = f"capture failed ({describe_error(exc)}): every step runs eagerly"
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return self.info["cuda_graphs"]
        self.graphs = graphs
        return self.info["cuda_graphs"]

    def start_sequence(self, seq) -> None:
        seq.sampler = RequestSampler(seq.params, seq.prompt_ids)
        seq.detok = IncrementalDetokenizer(self.tokenizer)

    def end_sequence(self, seq) -> None:
        seq.sampler = None

    @torch.inference_mode()
    def execute(self, plan: StepPlan, blocks: BlockManager) -> StepOutput:
        """A SampledToken per sampling sequence, a spec Verdict per verifying one; or its error."""
        batch, samplers, sample_ids, verifies = self.build_batch(plan, blocks)
        step = self.graphs.run(batch) if self.graphs is not None and not verifies else None
        picked = None
        if step is not None:
            logits, picked = step.logits, step.picked[:len(sample_ids)]
        elif verifies:
            with get_tracer().span("verify", requests=len(verifies), tokens=batch.num_tokens):
                logits = self.model(batch, self.kv)
        else:
            logits = self.model(batch, self.kv)
        sampled, errors = {}, {}
        if sample_ids:
            with get_tracer().span("sampler", rows=len(samplers)):
                result = sample(logits[:len(sample_ids)], samplers, picked)
            for row in range(len(sample_ids)):
                seq_id = sample_ids[row]
                if row in result.errors:
                    errors[seq_id] = str(result.errors[row])
                    continue
                top = result.top_logprobs[row] if result.top_logprobs else ()
                logprob = float(result.logprobs[row])   # NaN: not computed (nobody asked)
                sampled[seq_id] = SampledToken(int(result.tokens[row]), None if logprob != logprob else logprob, top)
        if verifies:
            with get_tracer().span("spec accept", requests=len(verifies)):
                for seq, first, n in verifies:
                    try:
                        sampled[seq.id] = verify(
                            logits[first:first + n], seq.draft_ids[:n - 1], seq.sampler,
                            draft_probs=seq.spec.draft_probs, tv_budget=seq.spec.tv_budget,
                            bonus=self.spec_bonus)
                    except SamplingError as exc:
                        errors[seq.id] = str(exc)
        return StepOutput(sampled, errors)

    def build_batch(self, plan: StepPlan, blocks: BlockManager):
        """The flat batch; logits rows: one per sampling sequence, then every row of each
        speculative verify (its pending token and drafts)."""
        token_ids: list[int] = []
        positions: list[int] = []
        write_slots: list[torch.Tensor] = []
        seqs: list[SeqSlice] = []
        logits_rows: list[int] = []
        verify_rows: list[tuple] = []   # (seq, first flat row, rows)
        samplers, sample_ids = [], []
        for item in plan.items:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed
            row = len(token_ids)
            token_ids += seq.pending_ids(n)
            positions += range(start, start + n)
            slots = blocks.slots(seq, 0, start + n)
            write_slots.append(slots[start:])
            seqs.append(SeqSlice(row, n, start + n, slots, blocks.contiguous_start(seq),
                                 rowwise=item.draft > 0, pages=seq.block_table))
            if item.draft:
                verify_rows.append((seq, row, n))
            elif item.samples:
                logits_rows.append(row + n - 1)
                samplers.append(seq.sampler)
                sample_ids.append(seq.id)
        verifies = []
        for seq, row, n in verify_rows:
            verifies.append((seq, len(logits_rows), n))
            logits_rows += range(row, row + n)
        batch = ForwardBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            write_slots=torch.cat(write_slots),
            seqs=seqs,
            logits_rows=torch.tensor(logits_rows, dtype=torch.int64))
        return batch, samplers, sample_ids, verifies
