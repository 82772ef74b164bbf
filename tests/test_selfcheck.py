"""The load-time self-check: each weight form in use is compared with its GGUF bytes."""
from __future__ import annotations

import re

import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.cpuinfo import cpu_summary
from engine.errors import ModelError
from engine.models import quant
from engine.models.decoder import Decoder
from engine.models.gguf import load_gguf
from engine.models.quant import LinearPolicy, make_linear
from engine.models.selfcheck import TOLERANCE, check_linears
from tests.test_quant import make_td


def _stack(*layers) -> torch.nn.Module:
    return torch.nn.ModuleList(layers)


@pytest.mark.parametrize("weights", ["faithful", "fast"])
def test_tiny_model_passes_and_every_form_is_checked(tiny_model_path, weights):
    model = Decoder.from_gguf(load_gguf(tiny_model_path("qwen2")), LinearPolicy(weights=weights))
    results = check_linears(model, weights)
    forms = {r.form for r in results}
    assert any(f.startswith("int4x") for f in forms) and any(f.startswith("dense") for f in forms)
    assert all(r.error <= TOLERANCE[weights] for r in results)


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_rejects_int4_weight_with_shuffled_row_blocks(qtype):
    """Simulates the AVX-512 layout bug on any CPU: two packed row blocks swap places."""
    block = quant.int4_row_block()
    td = make_td(qtype, rows=4 * block, cols=256, seed=7, name=f"blk.0.{qtype.name}")
    layer = make_linear(td, bias=None, policy=LinearPolicy(dense_threshold=None))
    check_linears(_stack(layer))                               # intact: passes
    packed = layer.int4.packed
    packed[:block], packed[block:2 * block] = packed[block:2 * block].clone(), packed[:block].clone()
    with pytest.raises(ModelError, match=rf"blk\.0\.{qtype.name} \({qtype.name}, int4x\d kernel\).* on {re.escape(cpu_summary())}"):
        check_linears(_stack(layer))


def test_rejects_a_corrupted_dense_form():
    td = make_td(T.Q6_K, rows=64, cols=256, seed=8, name="blk.0.ffn_down.weight")
    layer = make_linear(td, bias=None, policy=LinearPolicy())
    assert set(layer.kernel_forms()) == {f"dense-{str(layer.dense.dtype).removeprefix('torch.')}"}
    layer.dense.copy_(layer.dense.roll(1, dims=0))
    with pytest.raises(ModelError, match="ffn_down.*Q6_K, dense"):
        check_linears(_stack(layer))


def test_a_worker_with_a_mispacked_model_refuses_to_start(tiny_model_path, monkeypatch):
    """End to end: a packer that scrambles blocks makes the runner refuse with a ModelError."""
    from engine.config import WorkerConfig
    from engine.runner import ModelRunner

    real_finish = quant._Int4Packer.finish

    def scrambled(self, dtype):
        weight = real_finish(self, dtype)
        weight.packed.copy_(weight.packed.flip(0))
        return weight

    monkeypatch.setattr(quant._Int4Packer, "finish", scrambled)
    path = tiny_model_path("qwen2")
    with pytest.raises(ModelError, match="self-check failed"):
        ModelRunner(WorkerConfig(model=str(path), threads=1, calibrate=False), str(path))
