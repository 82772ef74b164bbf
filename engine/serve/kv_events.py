"""KV cache events in vLLM's format over ZMQ (`tokentop serve --kv-events tcp://*:5557`).

A KV-aware router (vllm-router's kv_aware policy, Dynamo, llm-d) learns which prompt prefixes
each worker holds from these events instead of guessing from the requests it sent. The wire
follows vllm/distributed/kv_events.py: each message is three frames (topic, an 8-byte
big-endian sequence number, a msgpack EventBatch), the batch positional [ts, events,
data_parallel_rank], each event a map tagged by its class under "type" (what vllm-router
0.1.17 decodes, src/kv_index/wire.rs):

  {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
   "lora_id", "medium", "lora_name"}
  {"type": "BlockRemoved", "block_hashes", "medium"}
  {"type": "AllBlocksCleared"}

The events are made in the workers' prefix caches (engine/kv/prefix_cache.py) and cross to
the facade with their step events (StepEvents.kv_blocks): one publisher per server, because a
router sees one worker per server URL and this server routes among its own workers. A page
two workers both hold is stored once and removed when the last one drops it; a worker that
dies takes its pages with it. Block hashes are the first 8 bytes of tokentop's page keys as
an unsigned integer (vLLM's integer block hashes are 64-bit too); a router must not expect
them to equal its own hashes of the same tokens (tokentop keys pages with sha256 over its
own fields), only to chain: a block's parent_block_hash is the previous block's hash.

Where the endpoint has `*` or `::` (or is ipc:// or inproc://) the socket binds, else it
connects, as vLLM decides. The socket is an XPUB: a subscriber that joins (and every one on
start) first receives AllBlocksCleared and then every block held now, so one that connects
late, or reconnects, never works from a stale picture. vLLM's replay socket is not offered.
"""
from __future__ import annotations

import queue
import threading
import time

from engine.errors import ConfigError

MEDIUM = "GPU"        # vLLM's name for the engine's own KV pool (not an offload tier), on any device
POLL_S = 0.05
HWM = 100_000


def _load_deps():
    try:
        import msgpack
        import zmq
    except ImportError:
        raise ConfigError("KV cache events need pyzmq and msgpack: pip install 'tokentop[kv-events]'") from None
    return zmq, msgpack


def block_hash(key: bytes) -> int:
    return int.from_bytes(key, "big")


class KvEventPublisher:
    def __init__(self, engine, endpoint: str, topic: str = ""):
        zmq, self._msgpack = _load_deps()
        self.endpoint, self.topic = endpoint, topic.encode()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)     # hear every subscriber, not only the first
        self._sock.setsockopt(zmq.SNDHWM, HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._sock.bind(endpoint)
            else:
                self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise ConfigError(f"KV cache events endpoint {endpoint}: {exc}; write e.g. tcp://*:5557 (listen) or "
                              "tcp://HOST:PORT (connect to a subscriber that listens)") from None
        self._zmq = zmq
        self.bound = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)   # e.g. the port tcp://...:* took
        self.seq = 0
        self._held: dict[int, set[int]] = {}                       # block hash -> workers holding it
        self._blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}   # -> (parent, tokens)
        self._state = threading.Lock()                             # _held, _blocks
        self._outbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._outbox.put([{"type": "AllBlocksCleared"}])
        self._thread = threading.Thread(target=self._run, name="tokentop-kv-events", daemon=True)
        self._thread.start()
        engine.add_observer(self.observe)

    # --- the engine's side (dispatcher thread) ----------------------------------------------
    def observe(self, kind: str, payload) -> None:
        if kind == "kv_blocks":
            worker, blocks = payload
            events = self._apply(worker, blocks)
        elif kind == "kv_lost":
            events = self._drop_worker(payload)
        else:
            return
        if events:
            self._outbox.put(events)

    def _apply(self, worker: int, blocks) -> list[dict]:
        events: list[dict] = []
        with self._state:
            for key, parent, tokens in blocks:
                h = block_hash(key)
                holders = self._held.setdefault(h, set())
                if tokens is not None:
                    if not holders:
                        self._blocks[h] = (block_hash(parent) if parent is not None else None, tokens)
                        events.append(self._stored(h, *self._blocks[h]))
                    holders.add(worker)
                else:
                    holders.discard(worker)
                    if not holders:
                        del self._held[h]
                        self._blocks.pop(h, None)
                        events.append(_removed([h]))
        return _merge(events)

    def _drop_worker(self, worker: int) -> list[dict]:
        gone = []
        with self._state:
            for h, holders in list(self._held.items()):
                holders.discard(worker)
                if not holders:
                    del self._held[h]
                    self._blocks.pop(h, None)
                    gone.append(h)
        return [_removed(gone)] if gone else []

    def _stored(self, h: int, parent: int | None, tokens) -> dict:
        return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
                "token_ids": list(tokens), "block_size": len(tokens), "lora_id": None,
                "medium": MEDIUM, "lora_name": None}

    def _resync(self) -> list[dict]:
        """AllBlocksCleared, then every block held now: a joining subscriber's whole picture."""
        with self._state:
            held = [self._stored(h, *self._blocks[h]) for h in self._blocks]
        return [{"type": "AllBlocksCleared"}, *held]

    # --- the socket's side (its own thread: ZMQ sockets are not thread-safe) --------------------
    def _run(self) -> None:
        zmq = self._zmq
        while not self._stop.is_set():
            try:
                if self._sock.poll(int(POLL_S * 1000), zmq.POLLIN):
                    frame = self._sock.recv()
                    if frame[:1] == b"\x01":          # a subscription: (re)send the whole picture
                        self._send(self._resync())
                while True:
                    self._send(self._outbox.get_nowait())
            except queue.Empty:
                continue
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                time.sleep(POLL_S)

    def _send(self, events: list[dict]) -> None:
        payload = self._msgpack.packb([time.time(), events, 0], use_bin_type=True)
        self._sock.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload))
        self.seq += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._sock.close(linger=0)
        self._ctx.term()


def _removed(hashes: list[int]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM}


def _merge(events: list[dict]) -> list[dict]:
    """Consecutive BlockStored events of one chain as one event (vLLM sends a request's new
    blocks together: parent_block_hash then names the block before the first), consecutive
    BlockRemoved as one."""
    out: list[dict] = []
    for e in events:
        last = out[-1] if out else None
        if last is not None and last["type"] == e["type"] == "BlockRemoved":
            last["block_hashes"] += e["block_hashes"]
        elif (last is not None and last["type"] == e["type"] == "BlockStored"
              and e["parent_block_hash"] == last["block_hashes"][-1]):
            last["block_hashes"] += e["block_hashes"]
            last["token_ids"] += e["token_ids"]
        else:
            out.append(e)
    return out
