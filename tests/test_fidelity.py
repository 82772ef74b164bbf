"""Greedy fidelity of the decoder on the real models.

tests/data/greedy_reference.json holds, per model and prompt, the prompt ids, the first 32
greedy tokens of transformers' fp32 implementation loaded from the *same* GGUF file
(tools/make_greedy_reference.py) and the gap between its two best logits at each step.

We teacher-force the reference's tokens and compare our argmax at every step. Up to the first
divergence this is exactly free-running greedy decoding; past it, every later step is still
checked. A step may pick another token than the reference only at a near-tie: the GGUF
kernels quantize activations to int8 per 32 values (as llama.cpp does). NEAR_TIE is well above
the largest shift of the reference token's margin over its runner-up that lossy activations
give (0.10 logits with bf16 inputs over 192 teacher-forced 0.5B steps), and the int8 kernels
pass the same checks on all three models (top logits are refined in fp32). A real bug
(rope, masks, norms, a wrong weight) moves logits by whole units and flips steps whose gap
is large. The first step's top-8 logits are also compared as numbers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.models.batch import ForwardBatch, SeqSlice
from engine.models.decoder import Decoder
from engine.models.gguf import load_gguf
from engine.models.quant import LinearPolicy
from tests.conftest import resolve_real_model

pytestmark = pytest.mark.realmodel

REFERENCE = json.loads((Path(__file__).parent / "data" / "greedy_reference.json").read_text(encoding="utf-8"))
NEAR_TIE = 0.25          # logits; see the module docstring
FIRST_LOGITS_ATOL = 0.3  # |ours - reference| for the first step's top-8 logits
PAGE = 16

DEFAULT = LinearPolicy()                      # GGUF kernels for every call (int8 activations)
# fp32 activations, dense fp32 weights (exact GGUF values): only summation order differs from
# the reference, so logits agree to ~1e-4 and the checks can be tight.
FP32_DENSE = LinearPolicy(activation_dtype=torch.float32, dense_threshold=1)
FP32_NEAR_TIE = 0.01
FP32_FIRST_ATOL = 0.01

# llama-cpp-python 0.3.36 (n_threads=2, greedy) on the same 0.5B file.
LLAMA_CPP_FRANCE = " Paris. The capital of the United States is Washington D. C."


@dataclass
class Outcome:
    argmax: list[int]          # our best token at each of the 32 steps
    first_logits: list[float]  # our logits of the reference's first-step top-8 tokens


def paged_slots(n_seqs: int, per_seq: int) -> list[torch.Tensor]:
    """Each sequence gets pages scattered over the store, as the KV manager hands them out."""
    pages_each = -(-per_seq // PAGE)
    order = torch.randperm(n_seqs * pages_each, generator=torch.Generator().manual_seed(0))
    return [(order[i * pages_each:(i + 1) * pages_each, None] * PAGE + torch.arange(PAGE)).reshape(-1)
            for i in range(n_seqs)]


def flat_batch(chunks: list[tuple[list[int], int, int]], slots: list[torch.Tensor],
               rows_per_seq: int = 1) -> ForwardBatch:
    """chunks: (new tokens, position of the first, index of the sequence)."""
    ids, pos, write, seqs, rows = [], [], [], [], []
    for new, first, s in chunks:
        start, ctx = len(ids), first + len(new)
        ids += new
        pos += range(first, ctx)
        write.append(slots[s][first:ctx])
        seqs.append(SeqSlice(start, len(new), ctx, slots[s][:ctx]))
        rows += range(start + len(new) - rows_per_seq, start + len(new))
    return ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.cat(write), seqs, torch.tensor(rows))


def outcome(logits: torch.Tensor, ref: dict) -> Outcome:
    return Outcome(logits.argmax(-1).tolist(), logits[0, ref["first_topk_ids"]].tolist())


def run_greedy(model: Decoder, prompts: list[dict], prefill_steps: int,
               kv_dtype: torch.dtype = torch.float32, logits_out: list | None = None) -> list[Outcome]:
    """Teacher-forced, the way the engine runs: one flat prefill of every prompt plus its first
    reference tokens (logits of `prefill_steps` rows each, dense kernels under the default
    policy), then the remaining steps decoding all prompts together. K/V are stored in
    kv_dtype; logits_out receives the [prompts, steps, vocab] logits."""
    n_new = len(prompts[0]["greedy_ids"])
    slots = paged_slots(len(prompts), max(len(p["prompt_ids"]) for p in prompts) + n_new)
    kv = model.new_kv_store(sum(len(s) for s in slots), dtype=kv_dtype)
    chunks = [(p["prompt_ids"] + p["greedy_ids"][:prefill_steps - 1], 0, i) for i, p in enumerate(prompts)]
    steps = [model(flat_batch(chunks, slots, rows_per_seq=prefill_steps), kv).view(len(prompts), prefill_steps, -1)]
    for t in range(prefill_steps - 1, n_new - 1):
        chunks = [([p["greedy_ids"][t]], len(p["prompt_ids"]) + t, i) for i, p in enumerate(prompts)]
        steps.append(model(flat_batch(chunks, slots), kv)[:, None])
    per_prompt = torch.cat(steps, dim=1)      # [prompts, steps, vocab]
    if logits_out is not None:
        logits_out.append(per_prompt)
    return [outcome(per_prompt[i], p) for i, p in enumerate(prompts)]


def check(model_name: str, prompts: list[dict], outcomes: list[Outcome], *,
          near_tie: float = NEAR_TIE, first_atol: float = FIRST_LOGITS_ATOL) -> list[str]:
    """Assert fidelity; returns the near-tie divergences (reported, allowed)."""
    notes = []
    for ref, got in zip(prompts, outcomes):
        first = max(abs(a - b) for a, b in zip(got.first_logits, ref["first_topk_logits"]))
        assert first < first_atol, (
            f"{model_name}/{ref['name']}: first-step top-8 logits differ from the reference by {first:.3f}")
        for step, (ours, want) in enumerate(zip(got.argmax, ref["greedy_ids"])):
            if ours == want:
                continue
            gap = ref["top2_gap"][step]
            msg = (f"{model_name}/{ref['name']} step {step}: we pick {ours}, the reference {want} "
                   f"(its top-2 gap {gap:.4f})")
            assert gap < near_tie, msg + f": not a near-tie (< {near_tie}), the decoder is wrong"
            notes.append(msg)
    print("\n".join(notes) or f"{model_name}: all {32 * len(prompts)} greedy steps match the reference")
    return notes


@pytest.fixture(scope="module")
def qwen05(real_model_path) -> tuple:
    gf = load_gguf(real_model_path)
    return gf, Decoder.from_gguf(gf, DEFAULT)


def test_qwen05_greedy_default_kernels(qwen05):
    """24 steps from a prefill, 8 decode steps of all six prompts (GGUF kernels throughout)."""
    prompts = REFERENCE["models"]["qwen2.5-coder-0.5b"]["prompts"]
    check("qwen2.5-coder-0.5b", prompts, run_greedy(qwen05[1], prompts, prefill_steps=24))


def test_qwen05_greedy_fp16_kv_store(qwen05):
    """--kv-dtype fp16 (K/V rounded to fp16 when stored): the same checks hold on the 0.5B. It is
    not the default: the Gemma 270M leaves the reference with it at a step that is no near-tie
    (docs/kernels.md, "Measurements behind defaults")."""
    prompts = REFERENCE["models"]["qwen2.5-coder-0.5b"]["prompts"]
    check("qwen2.5-coder-0.5b", prompts, run_greedy(qwen05[1], prompts, prefill_steps=24, kv_dtype=torch.float16))


def test_qwen05_agrees_with_llama_cpp(qwen05):
    """llama.cpp's greedy text is a near-greedy path of ours: each of its tokens is our best,
    or within a near-tie of it (llama.cpp also rounds: it quantizes activations to 8 bits in
    its dot products). The fp32 reference itself leaves llama.cpp's path at a 0.07 gap."""
    from engine.models.tokenizer import Tokenizer

    gf, model = qwen05
    tok = Tokenizer.from_metadata(gf.metadata)
    prompt = tok.encode("The capital of France is")
    theirs = tok.encode(LLAMA_CPP_FRANCE)
    ref = next(p for p in REFERENCE["models"]["qwen2.5-coder-0.5b"]["prompts"] if p["name"] == "france")
    assert prompt == ref["prompt_ids"]
    slots = paged_slots(1, len(prompt) + len(theirs))
    batch = flat_batch([(prompt + theirs[:-1], 0, 0)], slots, rows_per_seq=len(theirs))
    logits = model(batch, model.new_kv_store(len(slots[0])))
    behind = logits.max(-1).values - logits.gather(1, torch.tensor(theirs)[:, None])[:, 0]
    worst = int(behind.argmax())
    assert float(behind[worst]) < NEAR_TIE, (
        f"llama.cpp's token {tok.decode(theirs[worst:worst + 1])!r} after "
        f"{tok.decode(theirs[:worst])!r} is {float(behind[worst]):.3f} logits behind our best")
    assert tok.decode(logits[:2].argmax(-1).tolist()) == " Paris."


def test_gemma3_270m_greedy_fp32():
    """fp32 activations: the architecture (sliding windows, local rope base, QK-norm, post-norms,
    embedding scale, tied head) checked tightly, on prompts that include one longer than the
    512-token sliding window."""
    path = resolve_real_model("gemma-3-270m")
    prompts = REFERENCE["models"]["gemma-3-270m"]["prompts"]
    assert any(len(p["prompt_ids"]) > 512 for p in prompts)
    model = Decoder.from_gguf(load_gguf(path), FP32_DENSE)
    check("gemma-3-270m", prompts, run_greedy(model, prompts, prefill_steps=32),
          near_tie=FP32_NEAR_TIE, first_atol=FP32_FIRST_ATOL)


def test_qwen15_greedy_gguf_kernels():
    """Two prompts only (the 1.5B is slow to run here)."""
    path = resolve_real_model("qwen2.5-coder-1.5b")
    prompts = [p for p in REFERENCE["models"]["qwen2.5-coder-1.5b"]["prompts"] if p["name"] in ("france", "code")]
    model = Decoder.from_gguf(load_gguf(path), DEFAULT)
    check("qwen2.5-coder-1.5b", prompts, run_greedy(model, prompts, prefill_steps=28))
