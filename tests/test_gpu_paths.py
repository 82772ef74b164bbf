"""The CUDA paths without a GPU (they import and refuse cleanly), the refusal of activation
dtypes measured unfaithful, and tools/gpu_check.py in its CPU dry-run mode. With a GPU, the
last test checks the CUDA decoder against the CPU fp32 path on a tiny model."""
from __future__ import annotations

import json

import pytest
import torch

from engine import dtypes
from engine.config import WorkerConfig
from engine.dtypes import check_activation_dtype
from engine.facade.devices import parse_devices
from engine.errors import ConfigError

NO_GPU = not torch.cuda.is_available()


@pytest.mark.skipif(not NO_GPU, reason="a GPU is visible")
def test_cuda_workers_refused_cleanly_without_a_gpu():
    from app.cli import main

    for spec in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(ConfigError, match="no CUDA GPU is visible"):
            parse_devices([spec], WorkerConfig())
    assert main(["generate", "hi", "--device", "cuda", "--model", "/nonexistent.gguf"]) == 2


def test_cuda_code_paths_import_without_a_gpu():
    from engine.models import attention, decoder, quant  # noqa: F401 - importing is the check
    from engine.models.quant import LinearPolicy

    policy = LinearPolicy(device="cuda:0")
    assert policy.on_cuda and policy.dense_weight_dtype == torch.bfloat16


def test_unfaithful_dtype_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(dtypes, "UNFAITHFUL_ACTIVATION_DTYPES",
                        {"cpu": {"fp16": "greedy output left the fp32 reference on X"}})
    with pytest.raises(ConfigError, match=r"`activation_dtype=fp16` is refused on cpu: greedy output left .* use `activation_dtype=bf16`"):
        parse_devices(["cpu"], WorkerConfig(activation_dtype="fp16"))
    from engine.worker.runner import pick_activation_dtype
    with pytest.raises(ConfigError, match="refused"):
        pick_activation_dtype("cpu", "fp16")
    assert pick_activation_dtype("cpu", "bf16") == torch.bfloat16
    assert parse_devices(["cpu"], WorkerConfig(activation_dtype="auto"))[0].activation_dtype == "auto"
    # other device kinds are not affected; simulated workers have no activations
    assert check_activation_dtype("cuda:0", "fp16") == "fp16"
    assert parse_devices(["sim:gpu0"], WorkerConfig(activation_dtype="fp16"))


def test_auto_never_picks_a_refused_dtype(monkeypatch):
    monkeypatch.setattr(dtypes, "UNFAITHFUL_ACTIVATION_DTYPES", {"cuda": {"bf16": "why"}})
    assert check_activation_dtype("cuda:1", "auto") == "fp32"
    assert check_activation_dtype("cpu", "auto") == "bf16"
    with pytest.raises(ConfigError, match="use `activation_dtype=fp32`"):
        check_activation_dtype("cuda:0", "bf16")
    with pytest.raises(ConfigError, match="auto, bf16, fp16 or fp32"):
        check_activation_dtype("cpu", "int8")


def test_benches_run_on_the_given_device():
    from engine.bench.common import base_worker
    from app.cli import build_parser, with_worker

    args = with_worker(build_parser().parse_args(["bench", "single", "--device", "sim:gpu0"]))
    assert base_worker(args).device == "sim:gpu0"
    assert base_worker(with_worker(build_parser().parse_args(["bench", "single"]))).device == "cpu"


def test_causal_mask_is_built_on_the_queries_device():
    from engine.models.attention import _chunk_mask

    mask = _chunk_mask(4, 4, 0, None, device="meta")
    assert mask.device.type == "meta" and mask.shape == (4, 4)
    assert _chunk_mask(3, 2, 0, None)[0].tolist() == [0.0, 0.0, float("-inf")]


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    """The check script's own logic, on the CPU with a tiny model: fidelity against the CPU
    fp32 path, the kernel comparison, NVTX pushes/pops against the Chrome trace."""
    from tools.gpu_check import main

    main(["--dry-run", "--sections", "env,gpu_tests,fidelity,kernels,step,nvtx,two_gpus", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    sec = res["sections"]
    assert {k: v["status"] for k, v in sec.items()} == {
        "env": "ok", "gpu_tests": "ok", "fidelity": "ok", "kernels": "ok", "step": "ok", "nvtx": "ok",
        "two_gpus": "skipped"}
    # without a GPU every CUDA path refuses in one line; the GPU tests are collected and skip
    assert sec["env"]["cuda_refused"].startswith("refused: `device=cuda:0`: no CUDA GPU is visible")
    assert sec["env"]["cli_cuda_refused"]["exit"] == 2 and "\n" not in sec["env"]["cli_cuda_refused"]["stderr"]
    assert "skipped" in sec["gpu_tests"]["summary"] and not sec["gpu_tests"]["failed"]
    assert sec["step"]["graphs_on"] == {"skipped": "CUDA graphs need a GPU"} and sec["step"]["graphs_off"]["wall_ms"] > 0
    assert sec["fidelity"]["dtypes"]["fp32"]["faithful"] and sec["fidelity"]["dtypes"]["fp32"]["mismatches"] == 0
    assert sec["kernels"]["int4_error"] is None
    exact = [op for op in sec["kernels"]["ops"] if op["int4_ms"] is not None]
    assert exact and all(op["int4_rel_err"] < 2e-2 for op in exact)
    nvtx = sec["nvtx"]
    assert nvtx["balanced"] and nvtx["pushes"] > 100 and nvtx["matches_trace"], nvtx["difference"]
    assert "gpu_check: dry-run" in (tmp_path / "gpu_check.txt").read_text()


@pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU")
def test_cuda_decoder_matches_cpu_fp32(tiny_model_path):
    from engine.models.decoder import Decoder
    from engine.models.gguf import load_gguf
    from engine.models.quant import LinearPolicy
    from tools.gpu_check import free_running_greedy

    gf = load_gguf(tiny_model_path("qwen2", hidden=256, head_dim=64, ffn=512))
    prompts = [[5, 9, 12, 40], [7, 3, 3, 100, 2, 8]]
    ref = free_running_greedy(Decoder.from_gguf(gf, LinearPolicy(activation_dtype=torch.float32, dense_threshold=1)),
                              prompts, 16)
    got = free_running_greedy(Decoder.from_gguf(gf, LinearPolicy(activation_dtype=torch.float32, device="cuda:0")),
                              prompts, 16)
    for r, g in zip(ref, got):
        assert (r - g).abs().max() < 1e-2


def test_gpu_check_refuses_an_unknown_dtype_with_a_model_error():
    """_round_np named ModelError without importing it: the refusal was a NameError."""
    import numpy as np

    from engine.errors import ModelError
    from tools.gpu_check import _round_np

    assert _round_np(np.array([1.0, 2.5], np.float32), torch.float16).tolist() == [1.0, 2.5]
    with pytest.raises(ModelError, match="activation dtype torch.int8 is not supported"):
        _round_np(np.zeros(2, np.float32), torch.int8)
