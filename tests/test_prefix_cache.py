"""Prefix cache, publication and single flight on the real scheduler, without a model."""
import hashlib

import pytest

from engine.config import SamplingParams
from engine.kv.pages import CACHED, FREE, SHARED, USED, BlockManager, PagePool
from engine.kv.prefix_cache import ROOT, PrefixCache, chain_keys, extra_key, page_key
from engine.kv.reuse import PrefixReuse
from engine.kv.single_flight import FlightCoordinator
from engine.worker.scheduler import Scheduler
from engine.worker.sequence import Sequence, SeqState
from tests.test_scheduler import finish_sampled

PS = 4


def make(num_pages=32, budget=64, max_active=8, mode="after-prefill", chunk=0, key_fn=None, **kw):
    pool = PagePool(num_pages, PS)
    sched = Scheduler(BlockManager(pool), max_active=max_active, max_batched_tokens=budget,
                      max_context=4096, prefill_chunk=chunk, **kw)
    reuse = PrefixReuse(pool, "test-model", mode, align=chunk, key_fn=key_fn)
    sched.enable_reuse(reuse)
    return pool, sched, reuse


def mkseq(name, tokens, max_tokens=3, t=0.0, salt=None):
    return Sequence(name, list(tokens), SamplingParams(max_tokens=max_tokens, cache_salt=salt), arrival=t)


def step(sched, reuse, fail=()):
    """What a worker does per step: schedule, account, publish, 'sample' 7, finish at max."""
    plan = sched.schedule()
    sched.advance(plan)
    reuse.publish(plan, set(fail))
    return plan, finish_sampled(sched, plan)


def drain(sched, reuse, limit=500):
    done = []
    for _ in range(limit):
        if sched.idle:
            return done
        done += step(sched, reuse)[1]
    raise AssertionError("scheduler did not drain")


# --- keys --------------------------------------------------------------------------------
def test_keys_are_a_sha256_chain_over_full_pages():
    extra = extra_key("m", None)
    toks = list(range(10))
    keys = chain_keys(toks, PS, extra)
    assert len(keys) == 2                                    # the partial third page has no key
    assert keys[0] == page_key(ROOT, toks[:4], extra)
    assert keys[1] == page_key(keys[0], toks[4:8], extra)
    assert keys[1] != page_key(ROOT, toks[4:8], extra)       # the parent is part of the key
    assert len(keys[0]) == hashlib.sha256().digest_size
    assert chain_keys(toks, PS, extra) == keys               # no per-process randomness
    assert chain_keys(toks, PS, extra_key("m", "tenant-a"))[0] != keys[0]
    assert chain_keys(toks, PS, extra_key("other-model", None))[0] != keys[0]


# --- cache -------------------------------------------------------------------------------
def test_finished_prefix_is_cached_then_restored_shared():
    pool, sched, reuse = make()
    a = mkseq("a", range(1, 11), max_tokens=1)            # 10 tokens computed: 2 full pages
    sched.add(a)
    drain(sched, reuse)
    assert pool.num_cached == 2 and pool.num_used == 0     # keyed pages survive their owner
    assert pool.states().count(CACHED) == 2
    b = mkseq("b", list(range(1, 11)) + [99, 98])
    sched.add(b)
    plan, _ = step(sched, reuse)
    assert b.num_cached == 8 and plan.items[0].num_tokens == 4   # only the tail computed
    assert pool.num_cached == 0
    c = mkseq("c", list(range(1, 9)) + [55])
    sched.add(c)
    step(sched, reuse)
    assert c.num_cached == 8 and c.block_table[:2] == b.block_table[:2]
    assert pool.states()[b.block_table[0]] == SHARED
    assert reuse.cache.hits == 16 and reuse.cache.queries == 12 + 9 + 10


def test_hit_is_capped_at_prompt_length_minus_one():
    pool, sched, reuse = make()
    sched.add(mkseq("a", range(1, 9)))
    drain(sched, reuse)
    b = mkseq("b", range(1, 9))                             # identical, 2 full pages
    sched.add(b)
    plan, _ = step(sched, reuse)
    assert b.num_cached == 4                               # not 8: the last token needs logits
    assert plan.items[0].num_tokens == 4 and plan.items[0].samples


def test_salts_never_share():
    pool, sched, reuse = make()
    sched.add(mkseq("a", range(1, 11), salt="alice"))
    drain(sched, reuse)
    for name, salt, want in (("b", "bob", 0), ("c", None, 0), ("d", "alice", 8)):
        s = mkseq(name, range(1, 11), salt=salt)
        sched.add(s)
        step(sched, reuse)
        assert s.num_cached == want, name
        drain(sched, reuse)


def test_a_hash_collision_is_a_miss_not_wrong_output():
    collide = lambda parent, tokens, extra: b"same key for everything"  # noqa: E731
    pool, sched, reuse = make(key_fn=collide)
    sched.add(mkseq("a", range(1, 11)))
    drain(sched, reuse)
    b = mkseq("b", range(50, 60))
    sched.add(b)
    step(sched, reuse)
    assert b.num_cached == 0                               # stored tokens differ: no hit
    assert reuse.cache.collisions >= 1
    drain(sched, reuse)
    c = mkseq("c", list(range(1, 11)) + [3])
    sched.add(c)
    step(sched, reuse)
    assert c.num_cached == 4     # a's first page verified; a's 2nd page shares the key: a stops there


def test_free_pages_first_then_lru_eviction_tail_before_head():
    pool, sched, reuse = make(num_pages=5)
    a = mkseq("a", range(1, 13), max_tokens=1)               # 3 full pages, published
    sched.add(a)
    drain(sched, reuse)
    assert pool.num_cached == 3 and pool.num_free == 5
    b = mkseq("b", range(100, 108), max_tokens=1)            # needs 2 pages: the 2 truly free ones
    sched.add(b)
    step(sched, reuse)
    assert reuse.cache.evictions == 0 and pool.num_cached == 5
    # cached now: a (released tail first: tail, mid, head), then b; one new page must
    # evict a's tail first, and a's head stays findable
    c = mkseq("c", range(200, 203), max_tokens=1)
    sched.add(c)
    step(sched, reuse)
    assert reuse.cache.evictions == 1
    d = mkseq("d", list(range(1, 13)) + [5])
    sched.add(d)
    step(sched, reuse)
    assert d.num_cached == 8                               # head and middle of a survived


def test_preempted_sequence_hits_its_own_published_pages():
    pool, sched, reuse = make(num_pages=40, budget=64)
    seq_ = mkseq("s", range(100, 117), max_tokens=20)
    sched.add(seq_)
    for _ in range(8):                                      # prefill + some decode
        step(sched, reuse)
    published = seq_.num_published
    assert published >= 5
    sched._preempt(seq_)                                    # what a pool running dry does
    assert pool.num_used == 0 and pool.num_cached == published   # its pages stay cached
    step(sched, reuse)
    assert seq_.num_cached == published * PS               # the recompute restored them
    drain(sched, reuse)
    assert pool.num_used == 0


def test_deterministic_mode_restores_whole_chunks_only():
    pool, sched, reuse = make(num_pages=64, budget=64, chunk=8)
    sched.add(mkseq("a", range(1, 30)))
    drain(sched, reuse)
    b = mkseq("b", range(1, 30))
    sched.add(b)
    step(sched, reuse)
    assert b.num_cached == 24                              # 28 available, aligned down to 8s


def test_deterministic_mode_restores_whole_chunks_of_a_chain_ending_mid_chunk():
    pool, sched, reuse = make(num_pages=64, budget=64, chunk=8)
    sched.add(mkseq("a", range(1, 31)))                    # 30 tokens: 7 pages published
    drain(sched, reuse)
    b = mkseq("b", list(range(1, 31)) + list(range(100, 110)))   # cap 32, chain ends at 28
    sched.add(b)
    step(sched, reuse)
    assert b.num_cached == 24                              # not 28: the chunks stay at 8s


# --- publication --------------------------------------------------------------------------
def test_incremental_publication_during_prefill_and_decode():
    pool, sched, reuse = make(budget=4)                    # one page of prefill per step
    a = mkseq("a", range(1, 13), max_tokens=9)
    sched.add(a)
    step(sched, reuse)
    assert reuse.cache.published == 1                      # the first chunk's page, at once
    step(sched, reuse)
    assert reuse.cache.published == 2
    while a.state != SeqState.DECODE:
        step(sched, reuse)
    n = reuse.cache.published
    for _ in range(5):
        step(sched, reuse)
    assert reuse.cache.published > n                       # output pages as decode fills them
    b = mkseq("b", a.prompt_ids + a.output_ids[:4] + [1])
    sched.add(b)
    step(sched, reuse)
    assert b.num_cached == 16                              # reused while a is still running


def test_a_failed_step_publishes_nothing():
    pool, sched, reuse = make()
    a = mkseq("a", range(1, 13))
    sched.add(a)
    plan = sched.schedule()
    sched.advance(plan)
    reuse.publish(plan, {"a"})
    assert reuse.cache.published == 0


# --- single flight ------------------------------------------------------------------------
def burst(sched, prompts, max_tokens=2):
    seqs = [mkseq(f"r{i}", p, max_tokens=max_tokens, t=float(i)) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    return seqs


@pytest.mark.parametrize("mode", ["after-prefill", "at-completion"])
def test_identical_burst_computes_the_prompt_once(mode):
    pool, sched, reuse = make(num_pages=64, budget=8, mode=mode)
    prompt = list(range(1, 34))                            # 8 full pages + 1
    seqs = burst(sched, [prompt] * 4)
    step(sched, reuse)
    assert [s.leader for s in seqs] == [None, "r0", "r0", "r0"]
    drain(sched, reuse)
    assert [s.num_cached for s in seqs] == [0, 32, 32, 32]
    assert reuse.flights.waits == 3 and not reuse.flights.check()


def test_off_mode_computes_concurrently():
    pool, sched, reuse = make(num_pages=64, budget=200, mode="off")
    seqs = burst(sched, [list(range(1, 34))] * 4)
    drain(sched, reuse)
    assert all(s.num_cached == 0 for s in seqs)


def test_partial_prefix_followers_wait_only_for_shared_pages():
    pool, sched, reuse = make(num_pages=128, budget=16, mode="after-prefill")
    doc = list(range(1, 41))                               # 10 shared pages
    prompts = [doc + [1000 + 10 * i + j for j in range(9)] for i in range(4)]
    seqs = burst(sched, prompts, max_tokens=30)
    admitted_at, leader_done = {}, None
    for n in range(200):
        if sched.idle:
            break
        plan, done = step(sched, reuse)
        for s in seqs[1:]:
            if s.num_computed and s.id not in admitted_at:
                admitted_at[s.id] = n
                assert reuse.cache.published >= 10          # the whole document was there
        if seqs[0] in done:
            leader_done = n
    assert [s.num_cached for s in seqs] == [0, 40, 40, 40]  # each computed only its question
    assert max(admitted_at.values()) < leader_done          # released long before the leader ended


def test_after_prefill_releases_before_the_leader_finishes():
    pool, sched, reuse = make(num_pages=64, budget=64, mode="after-prefill")
    seqs = burst(sched, [list(range(1, 34))] * 2, max_tokens=20)
    step(sched, reuse)                                     # leader prefills, publishes
    step(sched, reuse)
    assert seqs[1].num_cached == 32 and seqs[0].state == SeqState.DECODE


def test_followers_join_the_step_that_completes_their_pages():
    """after-prefill: a follower is scheduled in the very step in which its leader computes
    the last pages it waits for (the forward writes K/V before attention reads it), sharing
    those pages, instead of waiting one more step for their publication."""
    pool, sched, reuse = make(num_pages=64, budget=20, mode="after-prefill")
    seqs = burst(sched, [list(range(1, 34))] * 4, max_tokens=3)   # 8 full pages + 1 token
    plan, _ = step(sched, reuse)                          # leader: 20 tokens, 5 pages published
    assert [i.seq.id for i in plan.items] == ["r0"] and reuse.cache.published == 5
    plan, _ = step(sched, reuse)                          # leader's last 13 tokens: pages 5..7
    assert [(i.seq.id, i.num_tokens, i.samples) for i in plan.items] == [
        ("r0", 13, True), ("r1", 1, True), ("r2", 1, True), ("r3", 1, True)]
    lead = seqs[0]
    for f in seqs[1:]:
        assert f.num_cached == 32 and f.block_table[:8] == lead.block_table[:8]
        assert f.state == SeqState.DECODE and f.leader is None and f.num_published == 8
    assert all(pool.refcount[p] == 4 for p in lead.block_table[:8])
    assert reuse.cache.published == 8 and reuse.joins == 3 and reuse.flights.waits == 3
    drain(sched, reuse)
    assert pool.num_used == 0 and pool.num_cached == 8 and not reuse.flights.check()


def test_followers_join_a_leader_admitted_in_the_same_step():
    """A prompt that fits the budget: the leader is admitted and computes all of it in one
    step, and its followers join that very step (their first tokens come with the leader's)."""
    pool, sched, reuse = make(num_pages=64, budget=64, mode="after-prefill")
    seqs = burst(sched, [list(range(1, 34))] * 3, max_tokens=3)
    plan, _ = step(sched, reuse)
    assert [(i.seq.id, i.num_tokens, i.samples) for i in plan.items] == [
        ("r0", 33, True), ("r1", 1, True), ("r2", 1, True)]
    assert [s.num_cached for s in seqs] == [0, 32, 32] and reuse.joins == 2
    drain(sched, reuse)
    assert pool.num_used == 0 and not reuse.flights.check()


def test_partial_prefix_followers_join_the_leaders_last_document_chunk():
    pool, sched, reuse = make(num_pages=128, budget=40, mode="after-prefill")
    doc = list(range(1, 41))                               # 10 shared pages
    prompts = [doc + [1000 + 10 * i + j for j in range(5)] for i in range(4)]
    seqs = burst(sched, prompts, max_tokens=3)
    step(sched, reuse)                                     # leader: doc tokens 0..39
    plan, _ = step(sched, reuse)                           # leader's question, nothing to join
    assert [i.seq.id for i in plan.items] == ["r0", "r1", "r2", "r3"]   # doc published: restored
    pool, sched, reuse = make(num_pages=128, budget=30, mode="after-prefill")
    seqs = burst(sched, prompts, max_tokens=3)
    step(sched, reuse)                                     # leader: 30 doc tokens (7 pages)
    plan, _ = step(sched, reuse)                           # leader: doc pages 7..9 + its question
    assert [(i.seq.id, i.num_tokens) for i in plan.items] == [("r0", 15), ("r1", 5), ("r2", 5), ("r3", 5)]
    assert [s.num_cached for s in seqs] == [0, 40, 40, 40] and reuse.joins == 3
    assert all(s.state == SeqState.DECODE for s in seqs)


@pytest.mark.parametrize("mode", ["at-completion", "off"])
def test_no_join_outside_after_prefill(mode):
    pool, sched, reuse = make(num_pages=64, budget=20, mode=mode)
    seqs = burst(sched, [list(range(1, 34))] * 3, max_tokens=3)
    step(sched, reuse)
    plan, _ = step(sched, reuse)
    if mode == "at-completion":
        assert [i.seq.id for i in plan.items] == ["r0"]   # followers wait for the leader's end
    assert reuse.joins == 0
    drain(sched, reuse)
    assert pool.num_used == 0


def test_join_in_deterministic_mode_takes_whole_chunks_only():
    pool, sched, reuse = make(num_pages=64, budget=64, chunk=8)   # chunks of 8 tokens = 2 pages
    lead = mkseq("lead", range(1, 35), max_tokens=3)        # 34 tokens
    follower = mkseq("f", range(1, 28), max_tokens=3, t=1.0)     # 27 tokens: hit cap 24
    sched.add(lead)
    sched.add(follower)
    seen = [[(i.seq.id, i.num_tokens) for i in step(sched, reuse)[0].items] for _ in range(3)]
    # step 3 completes tokens 16..23 (pages 4, 5): the follower joins it with 24 tokens
    assert seen == [[("lead", 8)], [("lead", 8)], [("lead", 8), ("f", 3)]]
    assert follower.num_cached == 24 and follower.block_table[:6] == lead.block_table[:6]
    drain(sched, reuse)
    # a leader of 30 tokens completes page 6 (tokens 24..27) in its last chunk (24..29): a
    # follower extending it may not join that page alone (24 + 4 tokens is no whole chunk)
    pool, sched, reuse = make(num_pages=64, budget=64, chunk=8)
    lead = mkseq("lead", range(1, 31), max_tokens=3)
    follower = mkseq("f", list(range(1, 31)) + list(range(100, 110)), max_tokens=3, t=1.0)
    sched.add(lead)
    sched.add(follower)
    seen = [[(i.seq.id, i.num_tokens) for i in step(sched, reuse)[0].items] for _ in range(5)]
    assert seen[3] == [("lead", 6)] and seen[4][-1] == ("f", 8)
    assert follower.num_cached == 24 and reuse.joins == 0
    drain(sched, reuse)
    assert pool.num_used == 0


def test_at_completion_waits_for_the_leaders_end():
    pool, sched, reuse = make(num_pages=64, budget=64, mode="at-completion")
    seqs = burst(sched, [list(range(1, 34))] * 2, max_tokens=5)
    for _ in range(4):
        step(sched, reuse)
        assert seqs[1].leader == "r0" and seqs[1].num_computed == 0
    drain(sched, reuse)
    assert seqs[1].num_cached == 32


def test_at_completion_late_arrival_restores_published_pages_without_waiting():
    pool, sched, reuse = make(num_pages=64, budget=64, mode="at-completion")
    lead = mkseq("lead", range(1, 34), max_tokens=10)
    sched.add(lead)
    step(sched, reuse)                                     # prefill done, pages published
    step(sched, reuse)
    late = mkseq("late", list(range(1, 34)) + [99], max_tokens=2, t=5.0)
    sched.add(late)
    step(sched, reuse)
    assert late.leader is None and late.num_cached == 32   # nothing it needs is in flight
    assert reuse.flights.waits == 0


@pytest.mark.parametrize("how", ["abort", "preempt"])
def test_followers_never_hang_when_the_leader_goes(how):
    pool, sched, reuse = make(num_pages=64, budget=8, mode="after-prefill")
    seqs = burst(sched, [list(range(1, 34))] * 3, max_tokens=2)
    step(sched, reuse)                                     # leader mid-prefill
    assert seqs[1].leader == "r0"
    if how == "abort":
        sched.remove(seqs[0])
        seqs[0].state = SeqState.FINISHED
    else:
        sched._preempt(seqs[0])
    step(sched, reuse)
    leaders = {s.leader for s in seqs[1:]} - {None}
    assert len(leaders) <= 1                               # one new leader, the other follows it
    drain(sched, reuse)
    assert all(s.state == SeqState.FINISHED for s in seqs if s is not seqs[0] or how == "preempt")
    assert seqs[2].num_cached >= 8                         # it restored what the leader published
    assert not reuse.flights.check() and reuse.flights.num_waiting == 0
    assert pool.num_used == 0


def test_termination_notices_are_validated():
    f = FlightCoordinator("after-prefill")
    f.arrive("a")
    f.arrive("b")
    f.lead("a", [b"k1"])
    assert f.leader_of("b", [b"k1"]) == "a"
    f.wait("b", "a")
    f.published("a", [b"k1"])                               # flight gone...
    assert f.leader_of("b", [b"k1"]) is None
    f.release("b")
    assert "b" in f.released
    f.terminate("b")                                       # ...the late notice still validates
    f.terminate("a")
    with pytest.raises(KeyError):
        f.terminate("b")                                   # twice
    with pytest.raises(KeyError):
        f.terminate("nobody")


def test_pool_states_used_shared_cached_free():
    pool = PagePool(4, PS)
    a, b = pool.allocate(), pool.allocate()
    pool.retain(b)
    pool.keep(a)
    assert [pool.states()[i] for i in (a, b, 2)] == [USED, SHARED, FREE]
    pool.release(a)
    assert pool.states()[a] == CACHED and pool.num_cached == 1 and pool.num_free == 3
    pool.retain(a)                                          # a cached page comes back into use
    assert pool.states()[a] == USED and pool.num_cached == 0


@pytest.mark.parametrize("mode", ["after-prefill", "at-completion", "off"])
def test_randomized_invariants_every_step(mode):
    """Refcount of every page == block tables holding it; free + cached + used == total;
    no follower waits on a gone leader; at the end every page is free or cached."""
    import random
    rng = random.Random(7)
    # a small decode headroom lets admissions overcommit, so preemption happens often
    pool, sched, reuse = make(num_pages=40, budget=24, max_active=6, mode=mode, decode_headroom=2)
    docs = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 60))] for _ in range(5)]
    live, n, everyone = [], 0, []
    for it in range(3000):
        if n < 300 and rng.random() < 0.3:
            s = mkseq(f"q{n}", rng.choice(docs) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))],
                      max_tokens=rng.randrange(1, 20), t=float(n))
            sched.add(s)
            live.append(s)
            everyone.append(s)
            n += 1
        if live and rng.random() < 0.05:                   # aborts, leaders mid-prefill included
            victim = rng.choice(live)
            sched.remove(victim)
            victim.state = SeqState.FINISHED
        if not sched.idle:
            plan, done = step(sched, reuse, fail=[s.id for s in sched.running[:1]] if rng.random() < 0.02 else ())
        live = [s for s in live if s.state != SeqState.FINISHED]
        holders = [0] * pool.num_pages
        for s in sched.running + list(sched.waiting):
            for p in s.block_table:
                holders[p] += 1
        assert holders == pool.refcount
        assert pool.num_used + pool.num_free == pool.num_pages
        assert not reuse.flights.check()
        if n >= 300 and sched.idle:
            break
    assert sched.idle and n == 300
    assert pool.num_used == 0 and pool.num_cached + (pool.num_free - pool.num_cached) == pool.num_pages
    assert reuse.flights.num_waiting == 0 and reuse.cache.evictions > 0 and reuse.cache.hits > 0
    assert sum(s.preemptions for s in everyone) > 0
    if mode != "off":
        assert reuse.flights.waits > 0
    assert (reuse.joins > 0) == (mode == "after-prefill")   # joins are stressed too


def test_deterministic_mode_publishes_prompt_pages_only():
    pool, sched, reuse = make(num_pages=64, budget=64, chunk=8)
    a = mkseq("a", range(1, 18), max_tokens=20)
    sched.add(a)
    drain(sched, reuse)
    assert reuse.cache.published == 4                       # 17 prompt tokens: 4 full pages, no output pages
