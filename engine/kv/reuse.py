"""The scheduler's and the worker's one entry point to prefix reuse.

Ties the prefix cache (which pages hold which prefix) to single flight (who waits for whom)
at the four moments that matter: admission (restore a cached prefix, or wait for a
leader), after every successful step (publish newly completed pages, release followers),
preemption (pages stay cached, the flight is dropped) and termination.
"""
from __future__ import annotations

import time

from engine.kv.pages import PagePool
from engine.kv.prefix_cache import PrefixCache
from engine.kv.single_flight import FlightCoordinator
from engine.kv.paged import PagedSequence


class PrefixReuse:
    def __init__(self, pool: PagePool, model_identity: str, single_flight: str = "after-prefill",
                 align: int = 0, tracer=None, key_fn=None):
        kw = {"key_fn": key_fn} if key_fn is not None else {}
        self.pool = pool
        self.page_size = pool.page_size
        self.cache = PrefixCache(pool, model_identity, on_event=self._instant, **kw)
        self.flights = FlightCoordinator(single_flight)
        # deterministic mode restores whole prefill chunks only, so a prompt is chunked at
        # the same positions with the cache on or off (same kernels, same K/V), and
        # publishes prompt pages only (decode computes K/V row by row, not in chunks)
        self.align = max(align, self.page_size)
        self.prompt_only = align > 0
        self.tracer = tracer
        self.joins = 0      # followers that joined the step completing their leader's pages

    def _instant(self, name: str, args: dict) -> None:
        if self.tracer is not None and self.tracer.enabled:
            self.tracer.instant(name, **args)

    # --- scheduler hooks ----------------------------------------------------------------
    def arrive(self, seq: PagedSequence) -> None:
        self.flights.arrive(seq.id)

    def admit(self, seq: PagedSequence, computing: dict | None = None) -> bool:
        """Before admission: restore the cached prefix; False = wait for a leader.

        computing: leader id -> (leader, its computed tokens after this step) for the
        sequences already scheduled in this step. after-prefill: a follower whose missing
        pages the leader completes in this very step joins that step (see `_join`)."""
        pages: list[int] = []
        joined: list[int] = []
        fresh = seq.num_computed == 0 and not seq.block_table
        if fresh:
            limit = seq.num_tokens - 1               # the last token is computed for its logits
            pages = self.cache.match(seq, limit - limit % self.align)
            # whole chunks only: a published chain may end inside a chunk (a prompt's last,
            # partly filled chunk), and a restore ending there would chunk the rest differently
            pages = pages[:len(pages) * self.page_size // self.align * self.align // self.page_size]
        have = seq.num_computed // self.page_size + len(pages)
        keys = self.cache.keys(seq, (seq.num_tokens - 1) // self.page_size)[have:]
        leader = self.flights.leader_of(seq.id, keys)
        if leader is not None and fresh and computing and leader in computing:
            joined = self._join(seq, have, keys, leader, *computing[leader])
            if joined:
                joined_from, leader = leader, self.flights.leader_of(seq.id, keys[len(joined):])
        if leader is not None:                       # wait, holding no pages
            self._follow(seq, leader)
            return False
        if seq.leader is not None:
            self.flights.release(seq.id)
            seq.follow_time += time.monotonic() - (seq.follow_since or time.monotonic())
            seq.leader = None
        if pages or joined:
            for page in pages + joined:
                self.pool.retain(page)
            seq.block_table = pages + joined
            seq.num_computed = seq.num_cached = len(seq.block_table) * self.page_size
            # joined pages are the leader's to publish after this step (or ours, should the
            # leader's sampling fail): cache.publish skips pages that are already keyed
            seq.num_published = len(pages)
        if joined:
            self.joins += 1
            self._instant("join", {"request": seq.id, "leader": joined_from, "pages": len(joined)})
        return True

    def _join(self, seq: PagedSequence, have: int, keys: list[bytes], leader_id: str,
              leader: PagedSequence, leader_upto: int) -> list[int]:
        """The leader's pages, from seq's page `have` on, that seq needs next and that the
        leader completes in the step being planned (its chunk ends at leader_upto tokens).

        The forward pass writes every new token's K/V of a layer before any attention of
        that layer reads it, so a follower scheduled in the same step as the leader's chunk
        reads those pages exactly as it would once they were published: it computes its own
        tail one step earlier instead of waiting a step for publication. Only
        after-prefill does this (at-completion waits for the leader's end by definition);
        deterministic mode joins whole prefill chunks only, as it restores them."""
        if self.flights.mode != "after-prefill":
            return []
        ps = self.page_size
        limit = seq.num_tokens - 1
        cap = (limit - limit % self.align) // ps
        done = min(leader_upto, leader.num_tokens, len(leader.block_table) * ps) // ps
        lead_keys = self.cache.keys(leader, done)
        pages: list[int] = []
        for j, key in enumerate(keys):
            i = have + j
            if i >= min(done, cap) or lead_keys[i] != key or self.flights.computing(key) != leader_id:
                break
            # equal keys name equal prefixes; compare the tokens anyway (as a hit does)
            if any(seq.token_at(t) != leader.token_at(t) for t in range(i * ps, (i + 1) * ps)):
                break
            pages.append(leader.block_table[i])
        if self.align > ps:                          # whole chunks only (deterministic mode)
            whole = ((have + len(pages)) * ps) // self.align * self.align // ps
            pages = pages[:max(0, whole - have)]
        return pages

    def note_waiting(self, waiting) -> None:
        """Mark queued requests that will wait for a leader (admission was not reached)."""
        if not self.flights.busy:
            return
        ps = self.page_size
        for seq in waiting:
            if seq.leader is not None:
                continue
            keys = self.cache.keys(seq, (seq.num_tokens - 1) // ps)[seq.num_computed // ps:]
            leader = self.flights.leader_of(seq.id, keys)
            if leader is not None:
                self._follow(seq, leader)

    def _follow(self, seq: PagedSequence, leader: str) -> None:
        if self.flights.wait(seq.id, leader):
            seq.follow_since = time.monotonic()
            self._instant("follow", {"request": seq.id, "leader": leader})
        seq.leader = leader

    def undo(self, seq: PagedSequence) -> None:
        """Admission did not happen after all: give restored pages back (still cached)."""
        for page in reversed(seq.block_table):
            self.pool.release(page)
        seq.block_table = []
        seq.num_computed = seq.num_cached = seq.num_published = 0

    def admitted(self, seq: PagedSequence) -> None:
        self.cache.count_lookup(seq.num_tokens, seq.num_cached)
        if seq.num_cached:
            self._instant("hit", {"request": seq.id, "tokens": seq.num_cached})
        have = seq.num_computed // self.page_size
        upto = (len(seq.prompt_ids) if self.prompt_only else seq.num_tokens) // self.page_size
        self.flights.lead(seq.id, self.cache.keys(seq, upto)[have:])   # pages it will publish

    def preempted(self, seq: PagedSequence) -> None:
        self.flights.stop(seq.id)          # its followers pick a new leader or compute alone
        seq.num_published = 0              # its published pages stay cached for the recompute

    def finished(self, seq: PagedSequence) -> None:
        self.flights.terminate(seq.id)
        if seq.leader is not None and seq.follow_since is not None:
            seq.follow_time += time.monotonic() - seq.follow_since
            seq.leader = None

    # --- worker hook ----------------------------------------------------------------------
    def publish(self, plan, failed) -> None:
        """After a successful step: publish each sequence's newly completed pages."""
        for item in plan.items:
            seq = item.seq
            if seq.id in failed:
                continue
            before = seq.num_published
            self.cache.publish(seq, self.prompt_only)
            if seq.num_published > before:
                self.flights.published(seq.id, seq.page_keys[before:seq.num_published])

    # --- reporting ----------------------------------------------------------------------
    def stats(self) -> dict:
        c = self.cache
        return {"prefix_cache_queries": c.queries, "prefix_cache_hits": c.hits,
                "cached_pages": self.pool.num_cached, "evictions": c.evictions,
                "published_pages": c.published, "single_flight_waits": self.flights.waits,
                "single_flight_joins": self.joins,
                "waiting_on_leader": self.flights.num_waiting}
