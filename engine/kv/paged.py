"""What the KV side reads and writes on a sequence: a Protocol, so that kv/ needs nothing from the
worker. engine/worker/sequence.py's `Sequence` is the one implementation."""
from __future__ import annotations

from typing import Protocol


class PagedSequence(Protocol):
    id: str
    prompt_ids: list[int]
    params: object                  # SamplingParams: kv reads only its cache_salt
    block_table: list[int]          # page ids, in position order
    num_computed: int               # tokens whose K/V are in the cache
    num_cached: int                 # prompt tokens restored from the prefix cache
    # the prefix cache's hash chain and how much of it is published
    cache_extra: bytes
    page_keys: list[bytes]
    num_published: int
    publish_limit: int | None
    # single flight: the request whose pages this one waits for
    leader: str | None
    follow_since: float | None
    follow_time: float
    # the draft model's own pages, and the per-step slot lists the runner caches
    draft_table: list[int]
    draft_computed: int
    slot_cache: dict

    @property
    def num_tokens(self) -> int: ...

    def token_at(self, i: int) -> int: ...
