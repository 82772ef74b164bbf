"""vLLM-format KV cache events (engine/serve/kv_events.py), received with a real ZMQ SUB socket.

A simulated worker runs the real scheduler and prefix cache, so its pages are published and
evicted as a real worker's are; the subscriber decodes each message as vllm-router does:
three frames (topic, 8-byte sequence number, msgpack [ts, events, dp_rank]).
"""
from __future__ import annotations

import random
import time

import msgpack
import pytest
import zmq

from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.facade.devices import parse_devices
from engine.facade.engine import Engine
from engine.serve.kv_events import KvEventPublisher, block_hash
from tests.test_prefix_engine import slot_bytes

PAGE = 16


class Subscriber:
    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.seqs: list[int] = []

    def events(self, timeout: float = 5.0, until=None) -> list[dict]:
        """Events received until `until(events)` holds (or, without it, until quiet)."""
        out: list[dict] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.sock.poll(200 if until else 300):
                if until is None and out:
                    return out
                continue
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b"" and len(seq) == 8
            self.seqs.append(int.from_bytes(seq, "big"))
            ts, events, rank = msgpack.unpackb(payload)
            assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
            out += events
            if until is not None and until(out):
                return out
        if until is not None:
            raise AssertionError(f"wanted events did not arrive; got {out}")
        return out

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def chain_tokens(events: list[dict]) -> dict[int, list[int]]:
    """Block hash -> every token from the chain's head to the end of that block."""
    upto: dict[int, list[int]] = {}
    for e in events:
        if e["type"] != "BlockStored":
            continue
        assert set(e) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                          "lora_id", "medium", "lora_name"}
        assert e["block_size"] == PAGE and len(e["token_ids"]) == PAGE * len(e["block_hashes"])
        prefix = [] if e["parent_block_hash"] is None else upto[e["parent_block_hash"]]
        for i, h in enumerate(e["block_hashes"]):
            assert isinstance(h, int) and 0 <= h < 2**64
            prefix = prefix + e["token_ids"][i * PAGE:(i + 1) * PAGE]
            upto[h] = prefix
    return upto


@pytest.fixture
def engine(tiny_model_path):
    model = tiny_model_path("qwen2")
    base = WorkerConfig(model=str(model), max_active=2, calibrate=False, page_size=PAGE,
                        kv_cache_memory=12 * PAGE * slot_bytes(model))     # 12 pages: eviction is easy
    eng = Engine(EngineConfig(workers=parse_devices(["sim:a:prefill=20000,decode=5000"], base),
                              worker_mode="thread"))
    yield eng
    eng.shutdown()


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 200) for _ in range(n)]


def test_stored_chains_name_the_prompts_then_eviction_removes(engine):
    pub = KvEventPublisher(engine, "tcp://127.0.0.1:*")
    sub = Subscriber(pub.bound)
    try:
        first = sub.events(until=lambda ev: ev)                 # on joining: the whole (empty) picture
        assert first == [{"type": "AllBlocksCleared"}]
        engine.start(timeout=60)
        doc = ids(64, 1)
        engine.submit(prompt_ids=doc + [5], params=SamplingParams(max_tokens=1)).result(10)
        stored = sub.events(until=lambda ev: sum(len(e.get("block_hashes", ())) for e in ev) >= 4)
        chains = chain_tokens(stored)
        assert sorted(len(t) for t in chains.values())[:4] == [16, 32, 48, 64]
        assert all(t == (doc + [5])[:len(t)] for t in chains.values())
        # a second prompt sharing three pages: only its new page is stored, chained to the third
        other = doc[:48] + ids(16, 2)
        engine.submit(prompt_ids=other + [6], params=SamplingParams(max_tokens=1)).result(10)
        more = sub.events(until=lambda ev: any(e["type"] == "BlockStored" for e in ev))
        new = [e for e in more if e["type"] == "BlockStored"][0]
        third = next(h for h, t in chains.items() if len(t) == 48)
        assert new["parent_block_hash"] == third and new["token_ids"] == other[48:64]
        chains.update(chain_tokens(stored + more))
        # a long unrelated prompt needs the pool: cached pages are evicted, and said so
        engine.submit(prompt_ids=ids(150, 3), params=SamplingParams(max_tokens=1)).result(10)
        later = sub.events(until=lambda ev: any(e["type"] == "BlockRemoved" for e in ev))
        removed = [h for e in later if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        assert removed and set(removed) <= set(chains) | set(chain_tokens(stored + more + later))
        assert sub.seqs == sorted(sub.seqs) and len(set(sub.seqs)) == len(sub.seqs)
    finally:
        sub.close()
        pub.close()


def test_a_late_subscriber_gets_cleared_then_every_block_held(engine):
    pub = KvEventPublisher(engine, "tcp://127.0.0.1:*")
    early = Subscriber(pub.bound)
    try:
        early.events(until=lambda ev: ev)
        engine.start(timeout=60)
        doc = ids(48, 4)
        engine.submit(prompt_ids=doc + [1], params=SamplingParams(max_tokens=1)).result(10)
        seen = chain_tokens(early.events(until=lambda ev: sum(len(e.get("block_hashes", ())) for e in ev) >= 3))
        late = Subscriber(pub.bound)
        try:
            got = late.events(until=lambda ev: sum(len(e.get("block_hashes", ())) for e in ev) >= len(seen))
            assert got[0] == {"type": "AllBlocksCleared"}
            assert chain_tokens(got[1:]) == seen
        finally:
            late.close()
    finally:
        early.close()
        pub.close()


class FakeEngine:
    def __init__(self):
        self.observers = []

    def add_observer(self, fn):
        self.observers.append(fn)


def test_a_block_two_workers_hold_is_stored_once_and_removed_with_the_last():
    pub = KvEventPublisher(FakeEngine(), "inproc://kv-test")
    try:
        k1, k2 = b"\x00" * 7 + b"\x01", b"\xff" * 8
        toks = tuple(range(PAGE))
        ev = pub._apply(0, [(k1, None, toks), (k2, k1, toks)])
        assert ev == [{"type": "BlockStored", "block_hashes": [1, 2**64 - 1], "parent_block_hash": None,
                       "token_ids": list(toks) * 2, "block_size": PAGE, "lora_id": None, "medium": "GPU",
                       "lora_name": None}]                        # one chain: one event
        assert pub._apply(1, [(k1, None, toks)]) == []            # worker 1 holds it too: nothing new
        assert pub._apply(0, [(k1, None, None)]) == []            # worker 1 still holds it
        assert pub._drop_worker(1) == [{"type": "BlockRemoved", "block_hashes": [block_hash(k1)],
                                        "medium": "GPU"}]
        assert pub._apply(0, [(k2, None, None)]) == [{"type": "BlockRemoved", "block_hashes": [2**64 - 1],
                                                      "medium": "GPU"}]
    finally:
        pub.close()


def test_a_bad_endpoint_is_one_line():
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="KV cache events endpoint nonsense"):
        KvEventPublisher(FakeEngine(), "nonsense")
