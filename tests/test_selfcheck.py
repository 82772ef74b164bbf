"""The load-time self-check: each weight form in use is compared with its GGUF bytes."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine import kernels
from engine.cpuinfo import cpu_summary
from engine.errors import ModelError
from engine.models.decoder import Decoder
from engine.models.gguf import load_gguf
from engine.models.quant import LinearPolicy, make_linear
from engine.models.selfcheck import TOLERANCE, check_linears
from tests.fixtures.gguf_fields import corrupted
from tests.test_quant import make_td

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="quantized kernels could not be built")


def _stack(*layers) -> torch.nn.Module:
    return torch.nn.ModuleList(layers)


@pytest.mark.parametrize("policy", [LinearPolicy(), LinearPolicy(dense_threshold=8)], ids=["gguf", "gguf+dense"])
def test_tiny_model_passes_and_every_form_is_checked(tiny_model_path, policy):
    model = Decoder.from_gguf(load_gguf(tiny_model_path("qwen2")), policy)
    results = check_linears(model)
    forms = {r.form for r in results}
    assert ("gguf" in forms) == kernels.available()
    # both GGUF kernels: the direct one of decode rows and the tiles of larger calls
    assert ("gguf-tiles" in forms) == (kernels.available() and kernels.direct_rows() > 0
                                       and (policy.dense_threshold or 1 << 30) > kernels.batch_rows())
    quantized_dense = any(r.form.startswith("dense") and all(t.startswith("Q") for t in r.types.split("+"))
                          for r in results)
    assert quantized_dense == (policy.dense_threshold is not None or not kernels.available())
    assert all(r.error <= TOLERANCE for r in results)


@needs_kernels
@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_rejects_a_gguf_weight_read_in_the_wrong_order(qtype):
    """Simulates a kernel that reads rows from the wrong place: two row blocks swap places."""
    td = make_td(qtype, rows=64, cols=256, seed=7, name=f"blk.0.{qtype.name}")
    layer = make_linear(td, bias=None, policy=LinearPolicy())
    check_linears(_stack(layer))                               # intact: passes
    w = layer.gguf.tensors[0].view(64, -1).clone()
    layer.gguf.tensors[0] = torch.cat([w[16:32], w[:16], w[32:]]).reshape(-1)
    with pytest.raises(ModelError, match=rf"blk\.0\.{qtype.name} \({qtype.name}, gguf kernel\).* on {re.escape(cpu_summary())}"):
        check_linears(_stack(layer))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_a_weight_retyped_to_a_type_of_its_size_is_blamed_on_the_file_not_the_cpu(tiny_model_path):
    """Q4_K read as Q4_0 (both 144 bytes per 256 values) fills its place in the file, so only
    its values show it: NaN scales. The self-check said the weight layout "does not match
    this CPU's kernel"."""
    path = tiny_model_path("qwen2", hidden=256, ffn=512, n_heads=4, head_dim=64)
    assert load_gguf(path).tensor("blk.0.attn_output.weight").ggml_type == T.Q4_K
    path = corrupted(path, "type", "blk.0.attn_output.weight", int(T.Q4_0))
    model = Decoder.from_gguf(load_gguf(path), LinearPolicy())
    with pytest.raises(ModelError, match=rf"^model file {re.escape(str(path))} is corrupt: tensor "
                                         rf"'blk\.0\.attn_output\.weight' \(Q4_0\) decodes to NaN or infinite") as err:
        check_linears(model)
    assert "CPU" not in str(err.value)


def test_weights_whose_outputs_overflow_fp32_are_blamed_on_the_file():
    td = make_td(T.F32, rows=64, cols=256, name="blk.0.ffn_up.weight")
    td.raw.view(np.float32)[:] = 3e38       # finite, but any sum of them is not
    layer = make_linear(td, bias=None, policy=LinearPolicy(use_kernels=False))
    with pytest.raises(ModelError, match=r"is corrupt: layer blk\.0\.ffn_up\.weight gives outputs fp32 cannot hold"):
        check_linears(_stack(layer))


def test_rejects_a_corrupted_dense_form():
    td = make_td(T.Q6_K, rows=64, cols=256, seed=8, name="blk.0.ffn_down.weight")
    layer = make_linear(td, bias=None, policy=LinearPolicy(use_kernels=False))
    assert set(layer.kernel_forms()) == {f"dense-{str(layer.dense.dtype).removeprefix('torch.')}"}
    layer.dense.copy_(layer.dense.roll(1, dims=0))
    with pytest.raises(ModelError, match="ffn_down.*Q6_K, dense"):
        check_linears(_stack(layer))


@needs_kernels
def test_a_worker_whose_kernel_computes_wrongly_refuses_to_start(tiny_model_path, monkeypatch):
    """End to end: a kernel that scrambles its output rows makes the runner refuse with a ModelError."""
    from engine.config import WorkerConfig
    from engine.models import quant
    from engine.worker.runner import ModelRunner

    real = quant.QuantLinear._forward

    def scrambled(self, x):
        return real(self, x).flip(-1)

    monkeypatch.setattr(quant.QuantLinear, "_forward", scrambled)
    path = tiny_model_path("qwen2")
    with pytest.raises(ModelError, match="self-check failed"):
        ModelRunner(WorkerConfig(model=str(path), threads=1, calibrate=False), str(path))
