"""Every architecture and quant type tokentop runs, against llama.cpp on the same tiny files.

tests/data/llama_cpp_reference.json holds what llama.cpp (tools/llama_cpp_refs.py) computed on
each tiny model of tests/fixtures/llama_cpp_cases.py: per prompt, 16 greedy ids and each
step's top-5 logits. Here the same files are rebuilt from their seeds (the sha256 proves they
are the files llama.cpp ran) and tokentop's decoder runs as the engine runs it: the prompt as
one prefill, then one decode step per token, fed llama.cpp's own choices so that every step is
checked. Its greedy choice must equal llama.cpp's at every step, and its logits of llama.cpp's
top 5 must agree to LOGITS_ATOL. Both the default path (GGUF kernels with int8 activations; a
bf16 or fp32 dense copy for the dense-fallback types) and dense fp32 run. No llama.cpp needed.
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
# Both sides round activations (llama.cpp to 8-bit blocks, tokentop's kernels to int8 per 32
# values, or bf16 dense weights) and sum in different orders; a wrong rope, norm or weight
# moves logits by whole units.
LOGITS_ATOL = 0.15
# Every reference step's two best logits are further apart than this, so an exact match of the
# greedy ids is a fair demand (the cases' seeds and output spread were chosen for it).
MIN_GAP = 2 * LOGITS_ATOL


@pytest.fixture(scope="module")
def case_files(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("llama_cpp_cases")


def test_every_case_has_a_reference_with_clear_choices():
    assert set(REFERENCE["cases"]) == set(CASES), "rerun tools/llama_cpp_refs.py for the new cases"
    for name, ref in REFERENCE["cases"].items():
        assert [p["prompt_ids"] for p in ref["prompts"]] == prompts(), name
        gap = min(min(p["top2_gap"]) for p in ref["prompts"])
        assert gap > MIN_GAP, f"{name}: llama.cpp's choice is a near-tie ({gap:.3f}); pick another seed"


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
    for run in ref["prompts"]:
        logits = run_fed(model, run["prompt_ids"], run["greedy_ids"])
        assert logits.argmax(-1).tolist() == run["greedy_ids"], f"{name}: greedy ids differ from llama.cpp's"
        ours = logits.gather(1, torch.tensor(run["top_ids"]))
        torch.testing.assert_close(ours, torch.tensor(run["top_logits"]), atol=LOGITS_ATOL, rtol=0,
                                   msg=lambda m: f"{name}: top-5 logits differ from llama.cpp's: {m}")
