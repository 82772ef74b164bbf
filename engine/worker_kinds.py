"""Worker kinds: what each kind of `device` is built from, and what it can do.

A kind is one line of KINDS, named by the word its `device` spec starts with (`cpu`,
`cuda:N`, `sim:NAME`, `remote:URL`): the function that reads the spec, what runs the worker
(a `Runner` under engine/worker/loop.py's loop, or an I/O thread of the facade), and its
capabilities, which the code asks instead of testing device names. Modules are named, not
imported, so reading the table costs nothing (runners import torch).
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module


@dataclass(frozen=True)
class WorkerKind:
    name: str
    parse: str                      # "module:function" (spec, base, earlier configs) -> WorkerConfig
    runner: str = ""                # "module:Class" (cfg, model_path): the Runner of a worker loop
    io_worker: str = ""             # "module:function": instead of a loop, a thread of the facade
    simulated: bool = False         # the label users see: no model runs, its text is placeholders
    declared_rates: bool = False    # its speed profile is what its config declares, not measured
    speculates: bool = True         # runs speculative decoding (it needs real logits)
    quantized_kernels: bool = False  # the C++ GGUF kernels build and serve its linear layers
    host_cpu: bool = False          # runs on this machine's cores and memory: shares them with its kind
    checks_dtype: bool = True       # its activation dtype is checked (it computes with our model)
    takes_messages: bool = False    # gets chat messages as they came (its server templates them)
    token_counter: str = ""         # "module:function" (cfg): its own count of prompt tokens

    @property
    def local(self) -> bool:
        """Runs engine/worker/loop.py in a process (or thread) of its own: it may be respawned."""
        return not self.io_worker


def load(target: str):
    """The object a "module:name" of KINDS names, its module imported now."""
    module, _, name = target.partition(":")
    return getattr(import_module(module), name)


KINDS = {
    "cpu": WorkerKind("cpu", "engine.facade.devices:parse_cpu", runner="engine.worker.runner:ModelRunner",
                      quantized_kernels=True, host_cpu=True),
    "cuda": WorkerKind("cuda", "engine.facade.devices:parse_cuda", runner="engine.worker.runner:ModelRunner"),
    "sim": WorkerKind("sim", "engine.facade.devices:parse_sim", runner="engine.worker.sim:SimRunner",
                      simulated=True, declared_rates=True, speculates=False, checks_dtype=False),
    "remote": WorkerKind("remote", "engine.remote.spec:parse_remote", io_worker="engine.remote.worker:remote_worker_main",
                         speculates=False, checks_dtype=False, takes_messages=True,
                         token_counter="engine.remote.tokens:counter_for"),
}


def kind_of(device: str) -> WorkerKind | None:
    """The kind of a `device` spec or a worker's device (None: no such kind)."""
    return KINDS.get(device.split(":", 1)[0].strip())
