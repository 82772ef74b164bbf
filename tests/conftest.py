"""Fixtures shared by the test suite: tiny random GGUF models and the real bundled models."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from engine.errors import ModelError
from engine.models.catalog import resolve_model
from tests.fixtures.tiny_gguf import write_tiny_model

# Two cores are shared by everyone running tests here.
torch.set_num_threads(min(2, torch.get_num_threads()))

DEFAULT_REAL_MODEL = "qwen2.5-coder-0.5b"


def resolve_real_model(name: str = DEFAULT_REAL_MODEL) -> Path:
    """Path of a real catalog model, or pytest.skip with the reason it is unavailable."""
    try:
        return Path(resolve_model(name))
    except ModelError as e:
        pytest.skip(f"real model {name!r} is not available: {e}")


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    """The real Qwen2.5-Coder-0.5B GGUF (catalog), or skip with the reason."""
    return resolve_real_model(DEFAULT_REAL_MODEL)


@pytest.fixture(scope="session")
def real_gemma_path() -> Path:
    """The real Gemma 3 270M GGUF (catalog, needs tokentop[models]), or skip with the reason."""
    return resolve_real_model("gemma-3-270m")


@pytest.fixture
def tiny_model_path(tmp_path: Path) -> Callable[..., Path]:
    """Factory: tiny_model_path("gemma3", n_layers=6, ...) writes a tiny random GGUF into
    tmp_path and returns its path (arguments as tests.fixtures.tiny_gguf.write_tiny_model)."""
    counter = iter(range(1_000_000))

    def make(arch: str = "qwen2", **kwargs) -> Path:
        return write_tiny_model(tmp_path / f"tiny-{arch}-{next(counter)}.gguf", arch, **kwargs)

    return make
