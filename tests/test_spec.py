"""Speculative decoding: proposers, acceptance (exact in distribution), rollback, engine."""
import os
from dataclasses import replace
import random
import time

import numpy as np
import pytest
import torch

from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.errors import InvalidRequest
from engine.facade.engine import Engine
from engine.kv.pages import BlockManager, PagePool
from engine.speculative.acceptance import mentored_mix, total_variation
from engine.worker.sampling import RequestSampler, probs_for
from engine.worker.sequence import Sequence
from engine.speculative.ngram import propose_ngram
from engine.speculative.policy import AcceptanceK, CostK, CostModel, LengthK, StepContext
from engine.speculative.verify import verify
from tests.waiting import pages_back

# TOKENTOP_TEST_DEVICE=cuda runs the engine tests and the acceptance arithmetic on a GPU
DEVICE = os.environ.get("TOKENTOP_TEST_DEVICE", "cpu")

# chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails
# one of these seeded tests with probability 1e-3 at most, a biased one almost surely
CHI2_999 = {3: 16.266, 4: 18.467, 5: 20.515}


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    keep = probs > 0
    n = counts.sum()
    exp = probs[keep] * n
    assert counts[~keep].sum() == 0, "a token with zero probability was emitted"
    return float(((counts[keep] - exp) ** 2 / exp).sum()), int(keep.sum() - 1)


# --- proposers -------------------------------------------------------------------------

def test_ngram_continues_the_latest_match_with_room():
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 3, 1, 4) == [4, 5, 1]
    assert propose_ngram([5, 6, 7, 8, 9, 5, 6, 7, 8, 10, 5, 6], 3, 1, 3) == [7, 8, 10]
    assert propose_ngram([1, 2, 3], 2, 1, 4) == []            # nothing repeats
    assert propose_ngram([1, 2, 3, 9, 2, 3], 2, 3, 4) == []   # only a 2-gram matches, min is 3
    assert propose_ngram([1, 2, 3, 9, 2, 3], 2, 2, 4) == [9, 2]
    assert propose_ngram([4, 4, 4, 4, 4, 4], 3, 1, 2) == [4, 4, 4]
    assert propose_ngram([1, 2, 1, 2], 0, 1, 4) == []


# --- acceptance ------------------------------------------------------------------------

def _logits(probs) -> torch.Tensor:
    return torch.tensor(np.log(np.asarray(probs, dtype=np.float64))).float()


P = [np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04]),
     np.array([0.05, 0.10, 0.50, 0.05, 0.20, 0.10]),
     np.array([0.20, 0.20, 0.20, 0.20, 0.10, 0.10])]
Q_FAR = [np.array([0.01, 0.01, 0.02, 0.06, 0.40, 0.50]),   # mass where p has little
         np.array([0.70, 0.10, 0.02, 0.08, 0.05, 0.05]),
         np.array([0.05, 0.05, 0.05, 0.05, 0.40, 0.40])]


def _generate(n_rounds: int, k: int, q_dists, *, tv: float = 0.0, bonus: bool = True, seed: int = 0,
              point_mass: bool = False) -> list[list[int]]:
    """Rounds of speculative decoding of a 'model' whose distribution at output position t
    is P[t] whatever came before: returns the emitted tokens of each generation."""
    rng = np.random.default_rng(seed)
    sampler = RequestSampler(SamplingParams(temperature=1.0, max_tokens=8, seed=seed))
    outs = []
    for _ in range(n_rounds):
        out: list[int] = []
        while len(out) < len(P):
            t = len(out)
            kk = min(k, len(P) - t)
            rows = [P[min(t + j, len(P) - 1)] for j in range(kk + 1)]
            qs = [q_dists[min(t + j, len(P) - 1)] for j in range(kk)]
            drafts = [int(rng.choice(6, p=q)) for q in qs]
            draft_probs = None if point_mass else torch.tensor(np.stack(qs)).float().to(DEVICE)
            v = verify(torch.stack([_logits(r) for r in rows]).to(DEVICE), drafts, sampler,
                       draft_probs=draft_probs, tv_budget=tv, bonus=bonus)
            assert 1 <= len(v.tokens) <= kk + 1
            assert v.tokens[:v.accepted] == drafts[:v.accepted]
            out += v.tokens
        outs.append(out[:len(P)])
    return outs


@pytest.mark.parametrize("q_name,point_mass,bonus", [("near", False, True), ("far", False, True),
                                                    ("far", False, False), ("far", True, True)])
def test_lossless_emits_the_target_distribution(q_name, point_mass, bonus):
    qs = [0.7 * p + 0.3 / 6 for p in P] if q_name == "near" else Q_FAR
    outs = np.array(_generate(3000, 2, qs, bonus=bonus, point_mass=point_mass, seed=7))
    for t in range(len(P)):
        counts = np.bincount(outs[:, t], minlength=6)
        stat, df = chi_square(counts, P[t])
        assert stat < CHI2_999[df], f"position {t}: chi2 {stat:.1f} counts {counts} vs p {P[t]}"


def test_a_biased_acceptance_is_caught():
    """The test above can fail: accepting every draft emits q, which it rejects."""
    rng = np.random.default_rng(1)
    counts = np.bincount(rng.choice(6, size=3000, p=Q_FAR[0]), minlength=6)
    stat, df = chi_square(counts, P[0])
    assert stat > CHI2_999[df]


@pytest.mark.parametrize("budget", [0.25, 0.5, 1.0])
def test_mentored_emits_pi_within_the_tv_budget(budget):
    p, q = torch.tensor(P[0]), torch.tensor(Q_FAR[0])
    pi, theta = mentored_mix(p, q, budget)
    assert float(total_variation(pi, p)) <= budget + 1e-9
    outs = np.array(_generate(3000, 1, Q_FAR, tv=budget, seed=3))
    counts = np.bincount(outs[:, 0], minlength=6)
    stat, df = chi_square(counts, pi.numpy())
    assert stat < CHI2_999[df], f"chi2 {stat:.1f}: counts {counts} vs pi {pi.numpy()}"
    if budget == 1.0:   # π = q: the draft is always accepted
        assert float(theta) == 1.0


def test_greedy_accepts_the_argmax_run_then_corrects_or_adds_the_bonus():
    rows = torch.stack([_logits(P[0]), _logits(P[1]), _logits(P[2])])   # argmax 0, 2, 0
    s = RequestSampler(SamplingParams(max_tokens=8))
    v = verify(rows, [0, 2], s)
    assert (v.tokens, v.accepted, v.bonus) == ([0, 2, 0], 2, True)
    v = verify(rows, [0, 3], s)
    assert (v.tokens, v.accepted, v.bonus) == ([0, 2], 1, False)
    v = verify(rows, [0, 2], s, bonus=False)
    assert (v.tokens, v.accepted) == ([0, 2], 2)
    v = verify(rows, [5, 2], s)
    assert (v.tokens, v.accepted) == ([0], 0)


def test_greedy_with_penalties_judges_each_draft_after_the_accepted_ones():
    """Row j's argmax is taken with the penalties of the drafts accepted before it."""
    s = RequestSampler(SamplingParams(max_tokens=8, repetition_penalty=10.0))
    # token 0 leads every row, but once 0 is in the output the penalty hands the lead to 1
    row = _logits([0.5, 0.3, 0.1, 0.05, 0.03, 0.02])
    rows = torch.stack([row, row, row])
    v = verify(rows, [0, 0], s)
    assert v.tokens == [0, 1] and v.accepted == 1
    assert s.generated_counts == {}   # the worker observes emitted tokens itself


def test_probs_match_what_sample_draws_from_for_draft_and_target():
    params = SamplingParams(temperature=0.7, top_k=3, max_tokens=4)
    s = RequestSampler(params)
    p = probs_for(_logits(P[0]), s)
    assert int((p > 0).sum()) == 3 and abs(float(p.sum()) - 1) < 1e-6


# --- draft length ----------------------------------------------------------------------

def test_acceptance_and_length_policies_follow_the_seeds_rules():
    a = AcceptanceK()
    assert a.k == 4
    a.update(4, 4)
    assert a.k == 5
    a.update(5, 1)
    assert a.k == 4
    for _ in range(10):
        a.update(4, 0)
    assert a.k == 1
    ln = LengthK()
    ln.update(4, 4)
    assert ln.k == 5
    for _ in range(30):
        ln.update(4, 0)
    assert ln.k == 1


def test_cost_policy_turns_itself_off_when_drafts_fail_or_rows_are_expensive():
    cost = CostModel()
    for rows in (1, 3, 5, 1, 3, 5):
        cost.add_target(rows, 0.020 + 0.004 * rows)   # rows cheaper than a decode
    good = CostK()
    for _ in range(20):
        good.update(4, 4)
    assert good.next_k(StepContext(cost, 1, 0.0, 0, 0, False, 8)) >= 4
    bad = CostK()
    for _ in range(20):
        bad.update(4, 0)
    assert bad.next_k(StepContext(cost, 1, 0.0, 0, 0, False, 8)) == 0
    busy = CostModel()
    for rows in (8, 16, 24, 8, 16, 24):
        busy.add_target(rows, 0.004 * rows)            # every row costs as much as a decode
    half = CostK()
    for _ in range(20):
        half.update(4, 2)
    assert half.next_k(StepContext(busy, 16, 15.0, 0, 0, False, 8)) == 0


def test_cost_policy_probes_less_often_while_probes_do_not_bring_drafting_back():
    """Where drafting would pay were drafts accepted but this request's fail, each probe is a
    cost: probes back off (8, 16, 32, ... steps apart), and come soon again once drafting pays."""
    cheap = CostModel()
    for rows in range(1, 10):
        cheap.add_target(rows, 0.020 + 0.006 * rows)   # a verify row pays from ~25% acceptance
    policy = CostK()
    drafted = []
    for step in range(256):
        k = policy.next_k(StepContext(cheap, 1, 0.0, 0, 0, False, 8))
        if k:
            drafted.append(step)
            policy.update(k, 0)        # every draft rejected
    # two rounds at the prior, then probes 8, 16, 32, 64 and 128 steps apart
    assert drafted == [0, 1, 9, 25, 57, 121, 249]
    for _ in range(20):
        policy.update(4, 4)            # its drafts are accepted again
    assert policy.next_k(StepContext(cheap, 1, 0.0, 0, 0, False, 8)) > 0
    for _ in range(20):
        policy.update(4, 0)
    ks = [policy.next_k(StepContext(cheap, 1, 0.0, 0, 0, False, 8)) for _ in range(8)]
    assert ks == [0] * 7 + [2]         # it stopped paying: the next probe after 8 steps again


def test_cost_policy_never_probes_where_no_acceptance_would_pay():
    """Every verify row costs a whole decode step: drafting loses at any acceptance, so no
    probe is sent, however long the request decodes."""
    dear = CostModel()
    for rows in range(1, 10):
        dear.add_target(rows, 0.020 * rows)
    policy = CostK()
    assert [policy.next_k(StepContext(dear, 1, 0.0, 0, 0, False, 8)) for _ in range(256)] == [0] * 256


# --- rollback --------------------------------------------------------------------------

def test_truncate_releases_whole_pages_of_both_tables():
    pool = PagePool(10, 4)
    blocks = BlockManager(pool)
    seq = Sequence("a", [1] * 5, SamplingParams())
    blocks.grow(seq, 13)                       # 4 pages
    assert blocks.grow_draft(seq, 9)           # 3 pages
    seq.draft_computed = 9
    assert pool.num_used == 7
    blocks.truncate(seq, 6)
    blocks.truncate_draft(seq, 6)
    assert len(seq.block_table) == 2 and len(seq.draft_table) == 2 and seq.draft_computed == 6
    assert pool.num_used == 4
    blocks.free(seq)
    assert pool.num_used == 0 and seq.draft_computed == 0


# --- in the engine ---------------------------------------------------------------------

def start(model, **worker):
    cfg = WorkerConfig(**{"model": str(model), "threads": 1, "calibrate": False, "device": DEVICE, **worker})
    return Engine(EngineConfig(workers=(cfg,), worker_mode="thread")).start(timeout=300)


REPETITIVE = ["tokens tokens tokens tokens", "abc abc abc abc abc def abc abc", "zebra " * 20,
              "one two three four one two three four one two", "hello there"]


@pytest.mark.parametrize("spec_k,bonus", [("4", True), ("4", False), ("adaptive:cost", True),
                                          ("adaptive:acceptance", True)])
def test_greedy_ngram_speculation_is_token_identical_in_deterministic_mode(tiny_model_path, spec_k, bonus):
    model = tiny_model_path("qwen2")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with start(model, deterministic=True, max_batched_tokens=64) as engine:
        plain = [engine.generate(p, params=params).token_ids for p in REPETITIVE]
    with start(model, deterministic=True, max_batched_tokens=64, speculate="ngram", spec_k=spec_k,
               spec_bonus=bonus) as engine:
        handles = [engine.submit(p, params=params) for p in REPETITIVE]
        results = [h.result(60) for h in handles]
        assert [r.token_ids for r in results] == plain
        assert sum(r.metrics.spec["accepted_tokens"] for r in results) > 0
        assert pages_back(engine)


def test_stops_inside_a_proposal_end_the_request_exactly_as_without_speculation(tiny_model_path):
    model = tiny_model_path("qwen2")
    with start(model, deterministic=True) as engine:
        free = engine.generate("zebra " * 20, params=SamplingParams(max_tokens=30, ignore_eos=True))
    toks, text = free.token_ids, free.text
    cases = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (1, 2, 7, 13)]
    cases += [SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(toks[9],))]
    if len(text) > 12:
        cases.append(SamplingParams(max_tokens=30, ignore_eos=True, stop=(text[8:11],)))
    for spec in ("off", "ngram"):
        with start(model, deterministic=True, speculate=spec, spec_k="6") as engine:
            got = [engine.generate("zebra " * 20, params=c) for c in cases]
            assert pages_back(engine)
        if spec == "off":
            want = [(g.token_ids, g.text, g.finish_reason) for g in got]
        else:
            assert [(g.token_ids, g.text, g.finish_reason) for g in got] == want
    assert want[0][0] == toks[:1] and want[2][0] == toks[:7]


def test_sampled_requests_speculate_and_return_every_page(tiny_model_path):
    model = tiny_model_path("qwen2")
    with start(model, speculate="ngram", spec_k="4", spec_tv_budget=0.3) as engine:
        handles = [engine.submit(p, params=SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9,
                                                         seed=i, ignore_eos=True, logprobs=2))
                   for i, p in enumerate(REPETITIVE)]
        results = [h.result(60) for h in handles]
        assert all(len(r.token_ids) == 30 for r in results)
        assert pages_back(engine)


def test_a_draft_request_without_a_draft_model_is_refused_clearly(tiny_model_path):
    model = tiny_model_path("qwen2")
    with start(model) as engine:
        with pytest.raises(InvalidRequest, match="`draft_model`"):   # refused before it is queued
            engine.submit("x", params=SamplingParams(max_tokens=2, speculate="draft"))
        assert engine.outstanding() == 0
        assert engine.generate("x", params=SamplingParams(max_tokens=2, speculate="ngram")).token_ids


def test_real_model_greedy_ngram_equals_target_only(real_model_path):
    """The 0.5B on a code edit, deterministic mode: speculation changes nothing but speed."""
    prompt = ("Rename the variable `total` to `acc` in this function and return the code only.\n\n"
              "def add_all(values):\n    total = 0\n    for v in values:\n        total += v\n"
              "    return total\n")
    params = SamplingParams(max_tokens=48)
    with start(real_model_path, deterministic=True, spec_k="4", threads=2) as engine:
        plain = engine.generate(prompt, params=params).token_ids
        spec = engine.generate(prompt, params=SamplingParams(max_tokens=48, speculate="ngram"))
    assert spec.token_ids == plain
    assert spec.metrics.spec["accepted_tokens"] > 0


# --- draft model -----------------------------------------------------------------------

def test_vocabulary_check_names_both_models():
    from types import SimpleNamespace

    from engine.errors import ConfigError
    from engine.speculative.draft import check_vocab

    a = SimpleNamespace(_tokens=["a", "b", "c"], eog_ids=frozenset({2}))
    b = SimpleNamespace(_tokens=["a", "x", "c"], eog_ids=frozenset({2}))
    check_vocab(a, SimpleNamespace(_tokens=["a", "b", "c"], eog_ids=frozenset({2})), "big", "small")
    with pytest.raises(ConfigError, match=r"'small' cannot draft for 'big'.*first difference at id 1"):
        check_vocab(a, b, "big", "small")


def test_draft_model_greedy_is_token_identical_and_self_drafting_accepts_everything(tiny_model_path):
    target = tiny_model_path("qwen2")
    other = tiny_model_path("qwen2", n_layers=1, seed=5)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    with start(target, deterministic=True) as engine:
        plain = [engine.generate(p, params=params).token_ids for p in REPETITIVE]
    for draft, spec_k in ((target, "4"), (other, "3"), (other, "adaptive:length")):
        with start(target, deterministic=True, draft_model=str(draft), speculate="draft", spec_k=spec_k,
                   max_batched_tokens=64) as engine:
            results = [h.result(60) for h in [engine.submit(p, params=params) for p in REPETITIVE]]
            assert [r.token_ids for r in results] == plain
            if draft is target:   # the target drafting for itself: drafts are its argmax
                rates = [r.metrics.spec["acceptance_rate"] for r in results]
                assert min(rates) > 0.8, rates   # only kernel-order near-ties can differ
            assert pages_back(engine)


def test_sampled_draft_model_requests_finish_and_return_pages(tiny_model_path):
    target = tiny_model_path("qwen2")
    draft = tiny_model_path("qwen2", n_layers=1, seed=5)
    with start(target, draft_model=str(draft), speculate="draft", spec_k="3", spec_tv_budget=0.5) as engine:
        handles = [engine.submit(p, params=SamplingParams(max_tokens=25, temperature=0.9, top_k=20,
                                                         repetition_penalty=1.2, seed=i, ignore_eos=True))
                   for i, p in enumerate(REPETITIVE)]
        results = [h.result(60) for h in handles]
        assert all(len(r.token_ids) == 25 for r in results)
        assert sum(r.metrics.spec["drafts"] for r in results) > 0
        assert pages_back(engine)


def test_real_pair_greedy_draft_equals_target_only():
    """Qwen2.5-Coder-0.5B drafting for the 1.5B, deterministic greedy: identical tokens."""
    from tests.conftest import resolve_real_model

    target = resolve_real_model("qwen2.5-coder-1.5b")
    resolve_real_model("qwen2.5-coder-0.5b")
    prompt = "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n"
    # two threads, as the machine's cores: the deterministic path gives the same bits on any count
    with start(target, deterministic=True, draft_model="qwen2.5-coder-0.5b", spec_k="4", threads=2) as engine:
        plain = engine.generate(prompt, params=SamplingParams(max_tokens=32)).token_ids
        spec = engine.generate(prompt, params=SamplingParams(max_tokens=32, speculate="draft"))
    assert spec.token_ids == plain
    assert spec.metrics.spec["accepted_tokens"] > 0


def test_an_incompatible_draft_is_refused_at_start_naming_both(tiny_model_path):
    target = tiny_model_path("qwen2")
    draft = tiny_model_path("qwen2", metadata={"tokenizer.ggml.eos_token_id": 5})
    with pytest.raises(Exception, match="cannot draft for"):
        start(target, draft_model=str(draft), speculate="draft")


# --- trace -----------------------------------------------------------------------------

def test_trace_has_spec_rounds_with_draft_steps_verify_and_verdicts(tiny_model_path, tmp_path):
    import json

    from tests.trace_checks import check_nesting

    model = tiny_model_path("qwen2")
    cfg = WorkerConfig(model=str(model), threads=1, calibrate=False, draft_model=str(model), device=DEVICE,
                       speculate="draft", spec_k="3")
    with Engine(EngineConfig(workers=(cfg,), worker_mode="thread", trace_dir=str(tmp_path))).start() as engine:
        r = engine.generate("zebra " * 10, params=SamplingParams(max_tokens=12, ignore_eos=True))
        path = engine.export_trace()
    events = json.load(open(path))["traceEvents"]
    assert not check_nesting(events)
    spans = [e for e in events if e["ph"] == "X"]
    rounds = [e for e in spans if e["name"] == "spec"]
    assert rounds
    rounds += [e for e in spans if e["name"] == "spec calibration"]   # at start-up
    inside = lambda e, outer: outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"]  # noqa: E731
    for name in ("draft step", "verify"):
        found = [e for e in spans if e["name"] == name]
        assert found and all(any(inside(e, o) for o in rounds) for e in found), name
    verdicts = [e for e in events if e["ph"] == "i" and e["name"] == "spec verdict"]
    assert verdicts and all(v["args"]["request"] == r.id for v in verdicts)
    assert sum(v["args"]["accepted"] for v in verdicts) == r.metrics.spec["accepted_tokens"]


# --- randomized stress -----------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_stress_with_speculation_aborts_preemption_and_stops(tiny_model_path, seed):
    """Both proposers, tight KV (preemption), aborts and stop strings: every handle finishes
    exactly once and every page comes back."""
    from engine.messages import Finished

    rng = random.Random(seed)
    model = tiny_model_path("qwen2", context_length=1024)
    draft = tiny_model_path("qwen2", n_layers=1, seed=3, context_length=1024)
    page_bytes = 2 * 2 * 2 * 16 * 4 * 16 + 2 * 1 * 2 * 16 * 4 * 16   # target + draft, 16-token pages
    with start(model, draft_model=str(draft), speculate="ngram", spec_k="adaptive:length",
               kv_cache_memory=24 * page_bytes, max_active=8, max_batched_tokens=96) as engine:
        # long requests first: together they outgrow the pool (preemption)
        handles = [engine.submit(REPETITIVE[i % 3], params=SamplingParams(
            max_tokens=200, ignore_eos=True, speculate=("ngram", "draft")[i % 2])) for i in range(6)]
        for i in range(24):
            p = SamplingParams(
                max_tokens=rng.choice([1, rng.randint(60, 220), rng.randint(60, 220)]), ignore_eos=rng.random() < 0.7,
                temperature=rng.choice([0.0, 0.0, 0.8]), seed=i, speculate=rng.choice(["ngram", "draft", "off"]),
                spec_k=rng.choice(["", "2", "5"]), stop=(rng.choice(["ab", "e", "zz"]),) if rng.random() < 0.3 else ())
            prompt = rng.choice(REPETITIVE) * rng.randint(1, 2)
            handles.append(engine.submit(prompt, params=p))
            if rng.random() < 0.25:
                victim = rng.choice(handles)
                engine.abort(victim.id)
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.05)
        finished = {}
        for h in handles:
            r = h.result(120)
            assert r.finish_reason in ("stop", "length", "abort"), (r.finish_reason, r.error)
            events = list(h)
            ends = [e for e in events if isinstance(e, Finished)]
            assert len(ends) <= 1
            finished[h.id] = r
            if r.finish_reason == "length":
                assert len(r.token_ids) == h._record.params.max_tokens
            for s in h._record.params.stop:
                assert s not in r.text
        assert len(finished) == len(handles)
        assert pages_back(engine, timeout=10)
        snap = engine.snapshot().workers[0]
        assert snap.spec["drafts"] > 0
        assert snap.preemptions > 0, "the pool was meant to be tight enough to preempt"


def test_draft_pages_are_given_up_before_any_request_is_preempted():
    """A lone sequence whose own draft-model pages fill the pool still gets its next page."""
    from engine.worker.scheduler import Scheduler
    from engine.worker.sequence import SeqState

    pool = PagePool(4, 16)
    blocks = BlockManager(pool)
    sched = Scheduler(blocks, max_active=4, max_batched_tokens=64, max_context=64)
    seq = Sequence("a", [1] * 32, SamplingParams(max_tokens=30))
    seq.output_ids = [2]
    blocks.grow(seq, 32)
    seq.num_computed = 32
    assert blocks.grow_draft(seq, 32)
    seq.draft_computed = 32
    seq.state = SeqState.DECODE
    sched.running.append(seq)
    assert pool.num_free == 0
    plan = sched.schedule()
    assert [i.seq for i in plan.items] == [seq] and not plan.preempted
    assert seq.draft_table == [] and seq.draft_computed == 0 and len(seq.block_table) == 3


def test_cli_flags(tiny_model_path, capsys):
    import json

    from app.cli import main

    model = str(tiny_model_path("qwen2"))
    assert main(["generate", "zebra zebra zebra zebra", "--model", model, "--threads", "1", "--json",
                 "--max-tokens", "12", "--ignore-eos", "--speculate", "ngram", "--spec-k", "3",
                 "--ngram-min", "2", "--ngram-max", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["metrics"]["spec"]["mode"] == "ngram" and len(out["token_ids"]) == 12
    for bad, words in ((["--spec-k", "lots"], "--spec-k"), (["--speculate", "draft"], "--draft-model"),
                       (["--spec-tv-budget", "2"], "--spec-tv-budget"), (["--ngram-min", "5"], "--ngram-min")):
        assert main(["generate", "x", "--model", model, *bad]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


def test_prometheus_metrics_carry_vllm_spec_decode_counters(tiny_model_path):
    from engine.serve.metrics import EngineMetrics

    model = tiny_model_path("qwen2")
    with start(model, speculate="ngram", spec_k="3") as engine:
        metrics = EngineMetrics(engine, "tiny")
        engine.generate("zebra " * 20, params=SamplingParams(max_tokens=30, ignore_eos=True))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (engine.snapshot().workers[0].spec or {}).get("drafts"):
            time.sleep(0.05)
        spec = engine.snapshot().workers[0].spec
        text = metrics.render().decode()
    assert spec["drafts"] > 0
    for name, key in (("drafts", "drafts"), ("draft_tokens", "draft_tokens"), ("accepted_tokens", "accepted_tokens")):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"vllm:spec_decode_num_{name}_total{{"))
        assert float(line.rsplit(" ", 1)[1]) == spec[key]
    per_pos = [ln for ln in text.splitlines() if ln.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{")]
    assert sum(float(ln.rsplit(" ", 1)[1]) for ln in per_pos) == spec["accepted_tokens"]


def test_a_draft_that_must_catch_up_starts_only_where_drafting_pays_in_a_plain_step():
    """A prefill beside a decoding request (its rows make drafts look free) or another request's
    draft steps (free to share) must not start a draft model that must first read the tokens it
    missed, where drafting does not pay in a plain step of the requests decoding now: it would
    stop after one round. A draft that drafted last round (two tokens to read) may join."""
    cost = CostModel()
    for rows, ms in ((1, 50), (2, 55), (3, 60), (4, 62), (5, 64), (6, 66), (113, 1000), (121, 1020)):
        cost.add_target(rows, ms / 1000)
    cost.add_draft(1, 0.040)
    cost.add_draft(3, 0.040)                          # a draft step: two thirds of a target step
    cost.add_draft_prefill(20, 0.100)
    policy = CostK()
    for _ in range(20):
        policy.update(2, 1)                           # the first draft accepted, the second not
    share = StepContext(cost, 3, 2.0, 2, 3, True, 2, remaining=200, decoding=3)   # another drafts 2
    assert policy.next_k(replace(share, catchup_tokens=9)) == 0
    assert policy.next_k(replace(share, catchup_tokens=2)) == 1
    prefill = StepContext(cost, 113, 0.0, 0, 1, True, 8, remaining=200, decoding=1, catchup_tokens=57)
    assert policy.next_k(prefill) == 0
    assert policy.next_k(replace(prefill, catchup_tokens=2)) > 0   # current: the big step hides it
    cheap = CostModel()
    for rows, ms in ((1, 50), (2, 51), (3, 52), (4, 53)):
        cheap.add_target(rows, ms / 1000)
    cheap.add_draft(1, 0.005)
    cheap.add_draft_prefill(20, 0.100)
    plain = StepContext(cheap, 1, 0.0, 0, 1, True, 2, remaining=200, decoding=1, catchup_tokens=57)
    assert policy.next_k(plain) == 1                  # it pays: the catch-up spread over the rounds


def test_draft_timings_include_the_first_step_when_it_is_a_near_decode():
    """A k = 1 round is only the draft's first step (its catch-up on the last round's tokens):
    timed when that catch-up is at most two tokens a request, so the cost model learns what
    such rounds cost; a long catch-up (a draft that fell behind) is a prefill, not timed as a step."""
    from types import SimpleNamespace

    from engine.speculative.draft import DraftModel

    def seq(name, behind):
        sampler = SimpleNamespace(generated_counts={}, _penalty_index=None, observe=lambda tok: None)
        return SimpleNamespace(id=name, num_tokens=100, draft_computed=100 - behind, sampler=sampler)

    draft = DraftModel.__new__(DraftModel)
    draft._forward = lambda live, blocks, first: torch.zeros(len(live), 8)
    draft._draw = lambda logits_row, s: (3, None)
    blocks = SimpleNamespace(grow_draft=lambda s, n: True)
    _, timings = draft.propose([(seq("a", 2), 1), (seq("b", 1), 1)], blocks)
    assert [rows for rows, _ in timings] == [2] and draft.last_catchup[0] == 3
    _, timings = draft.propose([(seq("a", 2), 3), (seq("b", 1), 1)], blocks)
    assert [rows for rows, _ in timings] == [2, 1, 1]
    _, timings = draft.propose([(seq("a", 40), 1), (seq("b", 1), 1)], blocks)
    assert timings == [] and draft.last_catchup[0] == 41


def test_a_model_free_draft_on_an_unfiltered_row_is_judged_as_the_general_rule_judges_it():
    """The point-mass shortcut (p(d) from the row's scores, the replacement drawn from p without
    d) takes the same uniforms and gives the same verdicts as the full rule's probs_for,
    speculative_accept and residual."""
    from engine.speculative.acceptance import residual, speculative_accept
    from engine.speculative.verify import _judge_point_mass, _point_mass
    from engine.worker.sampling import draw_from, row_scores

    gen = torch.Generator().manual_seed(0)
    row = torch.randn(2000, generator=gen) * 2
    for seed in range(300):
        d = int(torch.randint(0, 2000, (), generator=gen)) if seed % 2 else int(row.argmax())
        fast, full = (RequestSampler(SamplingParams(temperature=0.7, seed=seed)) for _ in range(2))
        got = _judge_point_mass(row_scores(row, fast), d, fast)
        p = probs_for(row, full)
        q = _point_mass(p, d)
        if bool(speculative_accept(p, q, d, full.uniform())):
            assert got == (True, None)
        else:
            assert got == (False, int(draw_from(residual(p, q), full.uniform())))
