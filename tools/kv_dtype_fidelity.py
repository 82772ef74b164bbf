"""Greedy fidelity of 16-bit K/V stores on the bundled models (teacher-forced, as tests/test_fidelity.py).

For each model and K/V dtype: the steps whose argmax leaves the fp32 transformers reference
(and the reference's top-2 gap there: a divergence is allowed only at a near-tie), the first
step's top-8 logit error against the reference, and how far the logits move against the same
model with an fp32 store (max |difference|, and argmax changes). Prints one JSON object.

    PYTHONPATH=. python tools/kv_dtype_fidelity.py [MODEL ...]
"""
from __future__ import annotations

import json
import sys

import torch

from engine.models.batch import KV_TORCH_DTYPES
from engine.models.decoder import Decoder
from engine.models.gguf import load_gguf
from engine.models.catalog import resolve_model
from tests.test_fidelity import DEFAULT, NEAR_TIE, REFERENCE, run_greedy

PREFILL_STEPS = {"qwen2.5-coder-0.5b": 24, "qwen2.5-coder-1.5b": 28, "gemma-3-270m": 32}


def main(models: list[str]) -> None:
    torch.set_num_threads(2)
    report = {}
    for name in models:
        prompts = REFERENCE["models"][name]["prompts"]
        model = Decoder.from_gguf(load_gguf(resolve_model(name)), DEFAULT)
        logits, rows = {}, {}
        for kv in ("fp32", "fp16", "bf16"):
            out: list = []
            outcomes = run_greedy(model, prompts, PREFILL_STEPS[name], KV_TORCH_DTYPES[kv], out)
            logits[kv] = out[0]
            diverged, worst_gap, first_err = 0, 0.0, 0.0
            for ref, got in zip(prompts, outcomes):
                first_err = max(first_err, max(abs(a - b) for a, b in zip(got.first_logits, ref["first_topk_logits"])))
                for step, (ours, want) in enumerate(zip(got.argmax, ref["greedy_ids"])):
                    if ours != want:
                        diverged += 1
                        worst_gap = max(worst_gap, ref["top2_gap"][step])
            rows[kv] = {"steps": 32 * len(prompts), "argmax_differs_from_reference": diverged,
                        "largest_reference_gap_at_a_difference": round(worst_gap, 4),
                        "passes_near_tie_rule": worst_gap < NEAR_TIE,
                        "first_step_top8_max_error": round(first_err, 4)}
        for kv in ("fp16", "bf16"):
            d = (logits[kv] - logits["fp32"]).abs()
            rows[kv]["max_abs_logit_change_vs_fp32_kv"] = round(float(d.max()), 4)
            rows[kv]["mean_abs_logit_change_vs_fp32_kv"] = round(float(d.mean()), 5)
            rows[kv]["argmax_changes_vs_fp32_kv"] = int((logits[kv].argmax(-1) != logits["fp32"].argmax(-1)).sum())
        report[name] = rows
        print(json.dumps({name: rows}), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:] or list(PREFILL_STEPS))
