"""Every architecture and quant type tokentop runs, against llama.cpp on the same tiny files.

tests/data/llama_cpp_reference.json holds what llama.cpp (tools/llama_cpp_refs.py) computed on
each tiny model of tests/fixtures/llama_cpp_cases.py: per prompt, 16 greedy ids and each
step's top-5 logits. Here the same files are rebuilt from their seeds (the sha256 proves they
are the files llama.cpp ran) and tokentop's decoder runs as the engine runs it: the prompt as
one prefill, then one decode step per token, fed llama.cpp's own choices so that every step is
checked. Both the default path (GGUF kernels with int8 activations; a bf16 or fp32 dense copy
for the dense-fallback types) and dense fp32 run. No llama.cpp needed.

How close is close: on an all-F32 model tokentop's logits equal llama.cpp's exactly, and a
quantized embedding table (dequantized by both, no matmul) too. A quantized matrix in a matmul
differs by up to ~5% of the step's largest logit: llama.cpp rounds the activations to 8 bits per block of 32
(or, for K-quants and IQ4_XS, of 256) for it.
So each of llama.cpp's top-5 logits must be matched within LOGITS_ATOL + LOGITS_RTOL * the
largest of them,
and the greedy id must equal llama.cpp's at every step but near-ties, where it must be one
of llama.cpp's top 5 within twice that of its best; at least 90% of the steps agree exactly. A wrong rope, norm or weight moves logits
by whole units and fails both.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.models.batch import ForwardBatch, SeqSlice
from engine.models.decoder import Decoder
from engine.models.gguf import load_gguf
from engine.models.quant import LinearPolicy
from tests.fixtures.llama_cpp_cases import CASES, REFERENCE_PATH, prompts, sha256, write_case

REFERENCE = json.loads(REFERENCE_PATH.read_text(encoding="utf-8"))
POLICIES = {
    "default": LinearPolicy(),
    "fp32-dense": LinearPolicy(activation_dtype=torch.float32, use_kernels=False),
}
LOGITS_ATOL = 0.15
LOGITS_RTOL = 0.05


@pytest.fixture(scope="module")
def case_files(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("llama_cpp_cases")


def test_every_case_has_a_reference():
    assert set(REFERENCE["cases"]) == set(CASES), "rerun tools/llama_cpp_refs.py for the new cases"
    for name, ref in REFERENCE["cases"].items():
        assert [p["prompt_ids"] for p in ref["prompts"]] == prompts(), name


def run_fed(model: Decoder, prompt: list[int], fed: list[int]) -> torch.Tensor:
    """Logits [len(fed), vocab]: after the prompt (one prefill), then after each fed token
    but the last (one decode step each), as the engine runs a sequence."""
    kv = model.new_kv_store(128)
    slots = torch.arange(128)
    out, tokens = [], list(prompt)
    first = 0
    for new in [prompt] + [[t] for t in fed[:-1]]:
        if new is not prompt:
            tokens.append(new[0])
        n = len(tokens)
        batch = ForwardBatch(torch.tensor(tokens[first:]), torch.arange(first, n), slots[first:n],
                             [SeqSlice(0, n - first, n, slots[:n])], torch.tensor([n - first - 1]))
        out.append(model(batch, kv))
        first = n
    return torch.cat(out)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name", list(CASES))
def test_matches_llama_cpp(case_files, name, policy):
    ref = REFERENCE["cases"][name]
    path = write_case(name, case_files)
    assert sha256(path) == ref["sha256"], (
        f"{name}: the rebuilt tiny model differs from the file llama.cpp ran (the writer or gguf "
        f"changed): rerun tools/llama_cpp_refs.py --case {name}")
    model = Decoder.from_gguf(load_gguf(path), POLICIES[policy])
    worst, exact, steps = compare(model, ref, name)
    assert worst <= 1, f"{name}: a top-5 logit is {worst:.2f}x the tolerance away from llama.cpp's"
    assert exact >= 0.9 * steps, f"{name}: only {exact} of {steps} greedy ids equal llama.cpp's"


def compare(model: Decoder, ref: dict, name: str) -> tuple[float, int, int]:
    """(largest |ours - llama.cpp| over top-5 logits, in tolerances; steps whose greedy id
    equals llama.cpp's; steps). Asserts that every other step is a near-tie."""
    worst, exact, steps = 0.0, 0, 0
    for run in ref["prompts"]:
        logits = run_fed(model, run["prompt_ids"], run["greedy_ids"])
        want = torch.tensor(run["top_logits"])
        tol = LOGITS_ATOL + LOGITS_RTOL * want.abs().amax(-1, keepdim=True)
        ours = logits.gather(1, torch.tensor(run["top_ids"]))
        worst = max(worst, float(((ours - want).abs() / tol).max()))
        for step, (got, top_ids, top, t) in enumerate(zip(logits.argmax(-1).tolist(), run["top_ids"],
                                                         run["top_logits"], tol[:, 0].tolist())):
            near_tie = got in top_ids and top[0] - top[top_ids.index(got)] < 2 * t
            assert got == top_ids[0] or near_tie, (
                f"{name}: step {step} picks {got}, llama.cpp {top_ids[0]} (its top 5: {top_ids} {top})")
            exact += got == top_ids[0]
            steps += 1
    return worst, exact, steps


def test_the_tolerance_catches_a_missing_llama3_rope_scaling(case_files):
    """The smallest of the bugs the comparison must catch: Llama 3's frequency factors left
    out (the rope of Llama 2) moves the tiny model's logits past the tolerance."""
    name = "llama3-rope-tied"
    gf = load_gguf(write_case(name, case_files))
    del gf.tensors["rope_freqs.weight"]
    model = Decoder.from_gguf(gf, POLICIES["fp32-dense"])
    worst, _, _ = compare(model, REFERENCE["cases"][name], name)
    assert worst > 1.5
