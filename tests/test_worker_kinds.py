"""Worker kinds (engine/worker_kinds.py): each device kind is one line of KINDS, and the code asks
its capabilities instead of testing device names."""
from dataclasses import replace

import pytest

from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.facade.devices import parse_devices
from engine.worker_kinds import KINDS, WorkerKind, kind_of, load


def test_every_kind_names_what_exists():
    for kind in KINDS.values():
        assert kind.runner or kind.io_worker, kind.name
        for target in (kind.parse, kind.runner, kind.io_worker, kind.token_counter):
            assert not target or callable(load(target)), target


def test_each_spec_is_read_by_its_kind_and_carries_its_capabilities():
    cpu, sim, remote = parse_devices(["cpu", "sim:gpu0", "remote:http://127.0.0.1:9"], WorkerConfig())
    assert [w.kind.name for w in (cpu, sim, remote)] == ["cpu", "sim", "remote"]
    assert cpu.kind.quantized_kernels and cpu.kind.speculates and cpu.kind.local
    assert sim.simulated and sim.kind.declared_rates and not sim.kind.speculates
    assert remote.remote and not remote.kind.local and remote.kind.takes_messages
    assert kind_of("tpu") is None and kind_of("cuda:1") is KINDS["cuda"]


def parse_echo(spec: str, base: WorkerConfig, earlier: list) -> WorkerConfig:
    """The scratch kind's spec: echo:NAME, a simulated device at fixed rates."""
    return replace(base, device=spec, name=spec, sim_prefill_tps=5000.0, sim_decode_tps=2000.0)


@pytest.fixture
def echo_kind(monkeypatch):
    """A kind added the way the architecture doc says: its parser and one line of KINDS."""
    monkeypatch.setitem(KINDS, "echo", WorkerKind("echo", "tests.test_worker_kinds:parse_echo",
                                                  runner="engine.worker.sim:SimRunner", declared_rates=True,
                                                  speculates=False, checks_dtype=False))


def test_a_kind_added_by_one_registry_line_serves(echo_kind, tiny_model_path):
    from engine.facade.engine import Engine

    workers = parse_devices(["echo:a", "echo:b"], WorkerConfig(model=str(tiny_model_path("qwen2")), max_active=4))
    assert [w.name for w in workers] == ["echo:a", "echo:b"]
    with Engine(EngineConfig(workers=workers, worker_mode="thread")).start(timeout=120) as engine:
        result = engine.generate("hello there", params=SamplingParams(max_tokens=3))
        assert result.finish_reason == "length" and len(result.token_ids) == 3
        views = engine.snapshot().workers
        assert [w.device for w in views] == ["echo:a", "echo:b"]
        # its profile is the declared one, as the kind says (no calibration ran)
        assert all((w.profile_prefill_tps, w.profile_decode_tps) == (5000.0, 2000.0) for w in views)
