"""Scheduler + page pool invariants, without a model: plans are checked, then 'executed'."""
import random

import pytest

from engine.config import SamplingParams
from engine.kv.pages import BlockManager, OutOfPages, PagePool
from engine.worker.scheduler import Scheduler
from engine.worker.sequence import Sequence, SeqState


def make(num_pages=16, page_size=4, max_active=4, budget=32, mode="paged", policy="fcfs", chunk=0,
         **kw):
    pool = PagePool(num_pages, page_size)
    blocks = BlockManager(pool, mode, region_pages=8)
    return pool, Scheduler(blocks, max_active=max_active, max_batched_tokens=budget,
                           max_context=kw.pop("max_context", 1024), policy=policy, prefill_chunk=chunk, **kw)


def seq(i, prompt_len, max_tokens=4, t=None):
    return Sequence(f"s{i}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                    arrival=float(i if t is None else t))


def run_step(sched):
    """Execute a plan the way a worker does: account tokens, 'sample' token 7, finish at max."""
    plan = sched.schedule()
    sched.advance(plan)
    return plan, finish_sampled(sched, plan)


def finish_sampled(sched, plan):
    """'Sample' token 7 for each sequence that samples; finish those at max_tokens."""
    done = []
    for item in plan.items:
        if item.samples:
            item.seq.output_ids.append(7)
            if len(item.seq.output_ids) >= item.seq.params.max_tokens:
                sched.remove(item.seq)
                item.seq.state = SeqState.FINISHED
                done.append(item.seq)
    return done


def test_pool_refcounts():
    pool = PagePool(3, 4)
    a = pool.allocate()
    pool.retain(a)
    pool.release(a)
    assert pool.num_free == 2
    pool.release(a)
    assert pool.num_free == 3
    with pytest.raises(RuntimeError):
        pool.release(a)
    for _ in range(3):
        pool.allocate()
    with pytest.raises(OutOfPages):
        pool.allocate()


def test_block_slots_follow_block_table():
    pool = PagePool(8, 4)
    blocks = BlockManager(pool)
    s = seq(0, 6)
    pool.allocate()  # make the table non-trivial
    blocks.grow(s, 6)
    assert len(s.block_table) == 2
    slots = blocks.slots(s, 0, 6).tolist()
    p0, p1 = s.block_table
    assert slots == [p0 * 4, p0 * 4 + 1, p0 * 4 + 2, p0 * 4 + 3, p1 * 4, p1 * 4 + 1]


def test_block_slots_stay_right_as_the_table_changes():
    """slots() caches each sequence's slot map; growing, freeing and regrowing the table (a
    preemption and readmission), truncating and the draft table must each give fresh slots."""
    pool = PagePool(16, 4)
    blocks = BlockManager(pool)
    s = seq(0, 6)

    def expected(table, start, end):
        return [table[p // 4] * 4 + p % 4 for p in range(start, end)]

    pool.allocate()
    blocks.grow(s, 6)
    assert blocks.slots(s, 0, 6).tolist() == expected(s.block_table, 0, 6)
    assert blocks.slots(s, 2, 5).tolist() == expected(s.block_table, 2, 5)
    blocks.grow(s, 11)                                  # a third page
    assert blocks.slots(s, 0, 11).tolist() == expected(s.block_table, 0, 11)
    old = list(s.block_table)
    blocks.free(s)                                      # preempted: pages back to the pool
    for _ in range(3):
        pool.allocate()                                 # others take the pages it had first
    blocks.grow(s, 11)                                  # readmitted: three other pages
    assert len(s.block_table) == len(old) and s.block_table != old
    assert blocks.slots(s, 0, 11).tolist() == expected(s.block_table, 0, 11)
    blocks.truncate(s, 3)
    assert blocks.slots(s, 0, 3).tolist() == expected(s.block_table, 0, 3)
    with pytest.raises(IndexError):
        blocks.slots(s, 0, 5)                           # beyond the truncated table
    assert blocks.grow_draft(s, 5)
    assert blocks.slots(s, 0, 5, draft=True).tolist() == expected(s.draft_table, 0, 5)
    assert blocks.slots(s, 0, 3).tolist() == expected(s.block_table, 0, 3)


def test_budget_and_chunked_prefill():
    pool, sched = make(budget=8)
    a = seq(0, 20)
    sched.add(a)
    plan, _ = run_step(sched)
    assert [i.num_tokens for i in plan.items] == [8] and not plan.items[0].samples
    plan, _ = run_step(sched)
    plan, _ = run_step(sched)
    assert plan.items[0].num_tokens == 4 and plan.items[0].samples
    assert a.state == SeqState.DECODE and a.num_computed == 20


def test_decode_and_prefill_mix_in_one_step():
    pool, sched = make(budget=16)
    a, b = seq(0, 4, max_tokens=10), seq(1, 30)
    sched.add(a)
    run_step(sched)              # a prefilled, sampled
    sched.add(b)
    plan, _ = run_step(sched)
    kinds = {i.seq.id: i.num_tokens for i in plan.items}
    assert kinds == {"s0": 1, "s1": 15}


def test_max_active_is_respected():
    pool, sched = make(num_pages=64, max_active=2)
    for i in range(5):
        sched.add(seq(i, 3))
    plan, _ = run_step(sched)
    assert len(plan.items) == 2 and len(sched.running) == 2


def test_spf_admits_shortest_prefill_first():
    pool, sched = make(num_pages=64, max_active=1, policy="spf")
    sched.add(seq(0, 20))
    sched.add(seq(1, 3))
    plan, _ = run_step(sched)
    assert plan.items[0].seq.id == "s1"


def test_preemption_by_recompute_when_pages_run_out():
    # no decode headroom: both are admitted although their outputs cannot both fit
    pool, sched = make(num_pages=4, page_size=4, max_active=4, budget=64, decode_headroom=0)
    a, b = seq(0, 7, max_tokens=9), seq(1, 7, max_tokens=9)
    sched.add(a)
    sched.add(b)
    preempted = []
    for _ in range(60):
        plan, _ = run_step(sched)
        preempted += plan.preempted
        if sched.idle:
            break
    assert sched.idle, "both requests must finish: no deadlock"
    assert b in preempted and a not in preempted, "the younger request is preempted, never the oldest"
    assert pool.num_free == pool.num_pages


def test_memory_pressure_does_not_thrash():
    """The thrash scenario: 8 requests x 1000 tokens, 48 MiB of KV for the 0.5B model
    (24 KiB per token: 128 pages of 16). Each request may be preempted a few times, not
    dozens, and the work thrown away stays below the useful work (main's scheduler: one
    request preempted 97 times, 71k tokens recomputed for 8k useful ones)."""
    pool, sched = make(num_pages=128, page_size=16, max_active=8, budget=512, max_context=4096)
    seqs = [seq(i, 30, max_tokens=1000) for i in range(8)]
    for s in seqs:
        sched.add(s)
    for _ in range(20_000):
        if sched.idle:
            break
        plan, _ = run_step(sched)
        admitted = {i.seq.id for i in plan.items if i.seq.num_computed == i.num_tokens}
        assert not admitted & {s.id for s in plan.preempted}
    assert sched.idle and all(len(s.output_ids) == 1000 for s in seqs)
    assert max(s.preemptions for s in seqs) <= 3, [s.preemptions for s in seqs]
    assert sched.preemptions == sum(s.preemptions for s in seqs)
    assert 0 < sched.recomputed_tokens < 8 * 1030
    assert pool.num_free == pool.num_pages


def test_preempted_sequence_waits_for_its_whole_length():
    """A preempted sequence is not re-admitted in the step that preempted it, nor when only a
    first chunk of its recompute fits."""
    pool, sched = make(num_pages=8, page_size=4, max_active=4, budget=64, decode_headroom=0)
    a, b = seq(0, 4, max_tokens=40), seq(1, 4, max_tokens=40)
    sched.add(a)
    sched.add(b)
    for _ in range(200):
        plan, _ = run_step(sched)
        if plan.preempted:
            break
    assert plan.preempted == [b] and b in sched.waiting
    for _ in range(10):
        plan, _ = run_step(sched)
        assert b in sched.waiting and [i.seq for i in plan.items] == [a]


def test_randomized_stress_returns_every_page():
    rng = random.Random(1)
    pool, sched = make(num_pages=24, page_size=4, max_active=5, budget=24)
    live, finished, aborted = {}, set(), set()
    for i in range(300):
        if rng.random() < 0.5:
            s = seq(i, rng.randint(1, 30), max_tokens=rng.randint(1, 12), t=i)
            live[s.id] = s
            sched.add(s)
        if live and rng.random() < 0.1:
            victim = live.pop(rng.choice(sorted(live)))
            sched.remove(victim)
            aborted.add(victim.id)
        _, done = run_step(sched)
        for s in done:
            assert s.id not in finished, "answered twice"
            finished.add(s.id)
            live.pop(s.id)
        assert sum(pool.refcount) == sum(len(s.block_table) for s in sched.running)
        assert min(pool.refcount) >= 0
    for _ in range(2000):
        if sched.idle:
            break
        for s in run_step(sched)[1]:
            finished.add(s.id)
            live.pop(s.id)
    assert sched.idle and not live, "no request lost"
    assert pool.num_free == pool.num_pages
    assert finished.isdisjoint(aborted)


def test_contiguous_mode_uses_one_region_per_sequence():
    pool, sched = make(num_pages=32, page_size=4, mode="contiguous")
    a = seq(0, 5)
    sched.add(a)
    run_step(sched)
    assert a.block_table == list(range(a.block_table[0], a.block_table[0] + 8))
    assert sched.blocks.contiguous_start(a) == a.block_table[0] * 4
    sched.remove(a)
    assert pool.num_free == 32


def test_deterministic_chunking_is_fixed():
    pool, sched = make(num_pages=64, budget=40, chunk=16)
    a = seq(0, 40)
    sched.add(a)
    sizes = []
    while a.state != SeqState.DECODE:
        plan, _ = run_step(sched)
        sizes += [i.num_tokens for i in plan.items]
    assert sizes == [16, 16, 8]


def test_page_states_follow_refcounts():
    from engine.kv.pages import FREE, SHARED, USED
    pool = PagePool(4, 4)
    a = pool.allocate()
    b = pool.allocate()
    pool.retain(b)
    assert pool.states()[a] == USED and pool.states()[b] == SHARED and pool.states()[2] == FREE
    pool.release(b)
    pool.release(b)
    assert pool.states()[b] == FREE
