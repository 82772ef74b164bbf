"""A request as the worker sees it: token ids, KV block table, progress and timings."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from engine.config import SamplingParams

if TYPE_CHECKING:   # for annotations only: sampling imports torch
    from engine.worker.sampling import RequestSampler


class Detokenizer(Protocol):
    """Token ids in, text out, a UTF-8 character never split (engine/models/tokenizer.py's)."""
    def push(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class SeqState(str, Enum):
    WAITING = "waiting"      # queued, or preempted and waiting to recompute
    PREFILL = "prefill"      # admitted, prompt (or recompute) not fully in the KV cache yet
    DECODE = "decode"        # generating one token per step
    FINISHED = "finished"


@dataclass
class Sequence:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)   # page ids, in position order
    num_computed: int = 0        # tokens whose K/V are in the cache
    num_cached: int = 0          # prompt tokens restored from the prefix cache (not computed)
    state: SeqState = SeqState.WAITING
    preemptions: int = 0
    # prefix cache (engine/kv/prefix_cache.py): the hash chain of this sequence's full pages
    # (tokens only grow, so keys stay valid), how many leading pages are already published
    cache_extra: bytes = b""
    page_keys: list[bytes] = field(default_factory=list)
    num_published: int = 0
    publish_limit: int | None = None   # a hash collision stops this chain's publication
    # single flight (engine/kv/single_flight.py): the request whose pages this one waits for
    leader: str | None = None
    follow_since: float | None = None
    follow_time: float = 0.0
    # timings (time.monotonic, comparable across processes on Linux)
    first_scheduled: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    itl_sum: float = 0.0
    itl_max: float = 0.0
    finish_reason: str | None = None   # stop | length | abort | error
    error: str | None = None
    # filled by the worker's runner (a simulated one has no sampler)
    sampler: RequestSampler | None = None
    detok: Detokenizer | None = None
    text: str = ""
    held_text: str = ""     # decoded text held back while it could still start a stop string
    # speculative decoding (engine/speculative/): this step's proposal, the draft model's own KV
    spec: object | None = None                 # engine.speculative.state.SeqSpec, None = no speculation
    spec_want: int = 0           # draft tokens the scheduler may add after this step's decode
    draft_ids: list[int] = field(default_factory=list)   # proposed tokens verified this step
    draft_table: list[int] = field(default_factory=list)  # the draft model's pages
    draft_computed: int = 0      # tokens whose draft-model K/V are in the cache
    # BlockManager.slots' cache: {draft?: (the page table it was built from, slot of every
    # position its pages hold)}, rebuilt when the table changes (a new page every page_size tokens)
    slot_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens known but not yet in the KV cache (prompt chunk, recompute, or the last sample)."""
        return self.num_tokens - self.num_computed

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def pending_ids(self, count: int) -> list[int]:
        """The next `count` tokens to compute: known ones, then this step's draft tokens."""
        start = self.num_computed
        ids = self.prompt_ids[start:start + count]
        if len(ids) < count:
            off = max(0, start - len(self.prompt_ids))
            ids += self.output_ids[off:off + count - len(ids)]
        if len(ids) < count:
            ids += self.draft_ids[:count - len(ids)]
        return ids

    @property
    def remaining_decode(self) -> int:
        return max(0, self.params.max_tokens - len(self.output_ids))

    def record_token(self, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            gap = now - (self.last_token_at or now)
            self.itl_sum += gap
            self.itl_max = max(self.itl_max, gap)
        self.last_token_at = now
