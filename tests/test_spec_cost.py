"""adaptive:cost on synthetic cost tables: with the acceptance it has seen, it picks the draft
length that maximizes the true expected tokens per second, and no drafting where drafting loses."""
from dataclasses import replace

import pytest

from engine.speculative.policy import CostK, CostModel, PositionAcceptance, StepContext

T1 = 0.020   # seconds of a one-row target step


def table(ratio_at_8: float) -> CostModel:
    """Target steps costing T1 at one row and ratio_at_8 × T1 at eight, linear in between."""
    cost = CostModel()
    for rows in range(1, 17):
        cost.add_target(rows, T1 * (1 + (ratio_at_8 - 1) * (rows - 1) / 7))
    return cost


def true_rate(k: int, accepted_lengths: list[int], cost: CostModel, draft_step: float) -> float:
    """Tokens per second of rounds of k drafts when a round's drafts match for accepted_lengths."""
    tokens = sum(1 + min(a, k) for a in accepted_lengths) / len(accepted_lengths)
    return tokens / (cost.target(1 + k) + k * draft_step)


def trained(accepted_lengths: list[int], rounds: int = 60) -> tuple[CostK, PositionAcceptance]:
    """A request and its worker that have seen rounds of 8 drafts accepted as the pattern says."""
    policy, worker = CostK(), PositionAcceptance()
    for i in range(rounds):
        accepted = accepted_lengths[i % len(accepted_lengths)]
        policy.update(8, accepted)
        worker.update(8, accepted)
    return policy, worker


def best_k(accepted_lengths, cost, draft_step) -> int:
    rates = {k: true_rate(k, accepted_lengths, cost, draft_step) for k in range(9)}
    return max(rates, key=rates.get)


CASES = [
    # cheap rows, drafts all right or all wrong half the time: long drafts pay
    ("all or nothing, cheap rows", [8, 0], 1.4, 0.0),
    # every round accepts exactly three: a fourth draft only costs
    ("three every time", [3], 1.4, 0.0),
    # three of four rounds accept 2, one accepts 8: the short run wins on dear rows
    ("mostly two, dear rows", [2, 2, 2, 8], 2.2, 0.0),
    # the CPU: an 8-row step 2.2× a 1-row step, a draft step half a target step
    ("draft model on dear rows", [8, 0], 2.2, 0.5 * T1),
    # n-gram drafts that always fail
    ("failing drafts", [0], 1.4, 0.0),
]


@pytest.mark.parametrize("name,accepted,ratio,draft_step", CASES, ids=[c[0] for c in CASES])
def test_cost_policy_picks_the_k_that_wins(name, accepted, ratio, draft_step):
    cost = table(ratio)
    if draft_step:
        for rows in (1, 2):
            cost.add_draft(rows, draft_step)
    policy, worker = trained(accepted)
    ctx = StepContext(cost, 1, 0.0, 0, 1, bool(draft_step), 8, prior=worker)
    want = best_k(accepted, cost, draft_step)
    if true_rate(want, accepted, cost, draft_step) < CostK.MARGIN * true_rate(0, accepted, cost, draft_step):
        want = 0   # a gain inside the margin is not worth the risk
    assert policy.next_k(ctx) == want


def test_the_winning_k_of_each_case_is_what_the_case_says():
    """The cases cover a long k, an interior k, and k = 0 by cost and by acceptance."""
    wants = {name: best_k(a, (c := table(r)), d) for name, a, r, d in CASES}
    assert wants["all or nothing, cheap rows"] == 8
    assert wants["three every time"] == 3
    assert 0 < wants["mostly two, dear rows"] < 8
    assert wants["draft model on dear rows"] == 0 and wants["failing drafts"] == 0


def test_acceptance_by_position_is_conditional_on_reaching_it():
    """A round that failed at its first draft says nothing about the second."""
    seen = PositionAcceptance()
    for accepted in (8, 0) * 20:
        seen.update(8, accepted)
    assert seen.rate(0, 0.5) == pytest.approx(0.5, abs=0.05)
    assert seen.rate(1, 0.5) == pytest.approx(1.0)


def test_measured_gain_is_speculating_tok_s_over_the_undrafted_estimate():
    from engine.speculative.stats import MeasuredGain
    gain = MeasuredGain()
    assert gain.as_dict() == {"spec_tok_s": None, "plain_tok_s_est": None, "gain": None}
    for _ in range(50):
        gain.add(0.030, 3, 0.020, 1)    # a verify step: 30 ms for 3 tokens; undrafted 20 ms for 1
    got = gain.as_dict()
    assert got["spec_tok_s"] == pytest.approx(100.0) and got["plain_tok_s_est"] == pytest.approx(50.0)
    assert got["gain"] == pytest.approx(2.0)
    for _ in range(400):                # then drafts stop paying: the figure follows
        gain.add(0.030, 1, 0.020, 1)
    assert gain.as_dict()["gain"] == pytest.approx(2 / 3, rel=0.02)


def test_the_measured_gain_counts_the_draft_models_time():
    """A round's tokens cost its draft steps as well as its verify: 3 tokens from 20 ms of
    verify after 30 ms of drafting is 60 tok/s (a 1.2× gain over 20 ms a token), not 150.
    The target's cost table still learns the verify step alone."""
    from types import SimpleNamespace

    from engine.speculative.controller import SpecController
    from engine.speculative.stats import MeasuredGain
    from engine.worker.sequence import SeqState

    controller = SpecController.__new__(SpecController)
    controller.cost, controller.gain = CostModel(), MeasuredGain()
    controller.cost.add_target(1, 0.020)
    seq = SimpleNamespace(state=SeqState.DECODE, spec=object())
    plan = SimpleNamespace(items=[SimpleNamespace(seq=seq)], num_tokens=4)
    controller.record_step(plan, 0.020, 3, 0.030)
    got = controller.gain.as_dict()
    assert got["spec_tok_s"] == pytest.approx(60.0) and got["gain"] == pytest.approx(1.2)
    assert controller.cost.target.table[4] == pytest.approx(0.020)


def test_a_position_no_record_has_reached_is_as_good_as_the_one_before():
    """After rounds that proposed two drafts and had both accepted, a third draft is priced at
    the second's rate, not at the 0.5 prior: else k would never grow past the first rounds' 2."""
    policy, worker = CostK(), PositionAcceptance()
    for _ in range(10):
        policy.update(2, 2)
        worker.update(2, 2)
    policy._prior = worker
    a = policy.alphas(6)
    assert a[2] == pytest.approx(a[1]) and a[5] == pytest.approx(a[1]) and a[1] > 0.95
    cost = table(1.4)
    cost.add_draft(1, 0.2 * T1)
    assert policy.next_k(StepContext(cost, 1, 0.0, 0, 1, True, 8, prior=worker, remaining=200)) > 2


def draft_pair() -> CostModel:
    """The 1.5B and 0.5B here: a draft step half a target step, rows 1.2× at 2 and 1.6× at 8,
    a catch-up token 1.5 ms."""
    cost = table(1.6)
    cost.add_draft(1, 0.5 * T1)
    cost.add_draft_prefill(64, 64 * 0.0015)
    return cost


def test_a_request_that_has_not_drafted_explores_one_round_when_its_catch_up_is_cheap():
    """A fresh request with a draft model: the 0.5 prior makes k = 0 win on these costs, so it
    would never learn what its drafts are worth. It drafts one round (EXPLORE_K) when that
    round's draft work, times the requests waiting for it, is a small share of its remaining
    time; then the cost rule decides."""
    cost = draft_pair()
    fresh = StepContext(cost, 1, 0.0, 0, 1, True, 8, remaining=256, catchup_tokens=180, decoding=1)
    assert CostK()._best_k(fresh, 8, 0.0) == 0                # without exploring: never
    good = CostK()
    assert good.next_k(fresh) == CostK.EXPLORE_K
    good.update(4, 4)
    worker = PositionAcceptance()
    worker.update(4, 4)
    current = StepContext(cost, 1, 0.0, 0, 1, True, 8, prior=worker, remaining=250, catchup_tokens=2, decoding=1)
    assert good.next_k(current) > 0                           # its drafts pay: it goes on
    bad = CostK()
    assert bad.next_k(fresh) == CostK.EXPLORE_K
    bad.update(4, 0)
    poor = PositionAcceptance()
    poor.update(4, 0)
    assert [bad.next_k(replace(current, prior=poor, catchup_tokens=c)) for c in (2, 3, 4)] == [0, 0, 0]
    short = StepContext(cost, 1, 0.0, 0, 1, True, 8, remaining=20, catchup_tokens=180, decoding=1)
    assert CostK().next_k(short) == 0                         # 270 ms of catch-up for 20 tokens: no
    batch = StepContext(cost, 8, 7.0, 0, 1, True, 8, remaining=256, catchup_tokens=180, decoding=8)
    assert CostK().next_k(batch) == 0                         # seven others would wait for it: no
    ngram = StepContext(cost, 1, 0.0, 0, 0, False, 8, remaining=256)
    assert CostK().next_k(replace(ngram, cost=table(8.0))) == 0   # no draft model, no exploring


def test_a_request_explores_only_where_well_accepted_drafts_would_pay():
    """Three requests run: a lone draft holds the other two up for its draft steps, which on
    these costs loses even at HOPE acceptance, so no round of its own could make drafting pay.
    It does not explore, though the round's work is a small share of its time; nor while it
    decodes alone and the other two still prefill (they will decode beside it)."""
    cost = draft_pair()
    three = StepContext(cost, 3, 2.0, 0, 1, True, 8, remaining=256, catchup_tokens=20, decoding=3)
    delay = 20 * cost.draft_prefill_token + CostK.EXPLORE_K * cost.draft(1)
    assert delay * 3 <= CostK.EXPLORE_SHARE * 256 * cost.target(3)   # the share rule alone: yes
    assert CostK().next_k(three) == 0
    first = replace(three, base_rows=1 + 120, other_tokens=0.0, decoding=1, running=3)   # 2 prefill
    assert CostK().next_k(first) == 0
    alone = replace(three, base_rows=1, other_tokens=0.0, decoding=1, running=1)
    assert CostK().next_k(alone) == CostK.EXPLORE_K                   # one request: it explores


def test_a_slow_spell_at_the_usual_row_count_does_not_make_more_rows_look_cheaper():
    # three requests decode at 3 rows all the time; 4 and 5 rows were measured once, at
    # start-up. A slow spell lifted the 3-row entry over them, and a creative burst (drafts
    # accepted half the time) drafted because one row more looked cheaper than none.
    cost = CostModel()
    for rows in range(1, 10):
        cost.add_target(rows, 0.045 + 0.006 * (rows - 1))    # calibration
    cost.add_draft(1, 0.025)
    cost.draft_prefill_token = 0.006
    for _ in range(30):
        cost.add_target(3, 0.093)
    assert [cost.target(r) for r in (3, 4, 5)] == sorted(cost.target(r) for r in (3, 4, 5))
    assert cost.target(4) >= cost.target(3.5) >= cost.target(3)
    ctx = StepContext(cost, 3, 2.0, 0, 1, True, 8, catchup_tokens=136, remaining=176, decoding=3, running=3)
    assert CostK().next_k(ctx) == 0
    without = StepContext(cost, 3, 2.0, 0, 1, True, 8, catchup_tokens=2, remaining=176, decoding=3, running=3)
    assert CostK().next_k(without) == 0
