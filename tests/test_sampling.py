"""Sampling checked by statistics: chi-square goodness of fit against exact distributions.

Every draw is seeded, so each test is deterministic; a correct sampler passes with p > 1e-3,
and the same samples against a wrong distribution give p < 1e-6 (shown below).
"""
from __future__ import annotations

import math

import pytest
import torch

from engine.config import SamplingParams
from engine.errors import InvalidRequest, TokentopError
from engine.speculative.acceptance import mentored_mix, residual, speculative_accept, total_variation
from engine.worker.sampling import RequestSampler, SamplingError, apply_penalties_, draw_from, probs_for, sample

N_DRAWS = 30_000
P_OK = 1e-3      # a correct sampler's p-value stays above this (seeds are fixed)
P_WRONG = 1e-6   # a wrong distribution's p-value falls below this


# --- chi-square machinery ---------------------------------------------------------------

def _upper_gamma_regularized(a: float, x: float) -> float:
    """Q(a, x) = Γ(a, x) / Γ(a): series below a + 1, Lentz continued fraction above."""
    if x <= 0:
        return 1.0
    log_prefactor = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= x / n
            total += term
        return 1.0 - total * math.exp(log_prefactor)
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1 / (d if abs(d) > tiny else tiny)
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_prefactor) * h


def chi2_sf(stat: float, dof: int) -> float:
    return _upper_gamma_regularized(dof / 2, stat / 2)


def chi_square_p(counts: list[int], probs: list[float]) -> float:
    """Goodness-of-fit p-value over tokens with p > 0; a token with p == 0 must never occur."""
    n = sum(counts)
    impossible = [i for i, (c, p) in enumerate(zip(counts, probs)) if p == 0 and c > 0]
    assert not impossible, f"excluded tokens were drawn: {impossible}"
    support = [(c, p) for c, p in zip(counts, probs) if p > 0]
    stat = sum((c - n * p) ** 2 / (n * p) for c, p in support)
    return chi2_sf(stat, len(support) - 1)


def test_chi2_sf_matches_known_quantiles():
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, abs=1e-6)
    assert chi2_sf(18.307038, 10) == pytest.approx(0.05, abs=1e-6)
    assert chi2_sf(2.0, 2) == pytest.approx(math.exp(-1), rel=1e-12)
    assert chi2_sf(124.342, 100) == pytest.approx(0.05, abs=1e-4)


# --- references, written independently of engine/worker/sampling.py ----------------------------

def reference_probs(logits: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> list[float]:
    top = max(logits)
    w = [math.exp((x - top) / temperature) for x in logits]
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    candidates = order[:top_k] if top_k else order
    mass = sum(w[i] for i in candidates)
    kept, acc = [], 0.0
    for i in candidates:
        if acc >= top_p * mass:   # smallest set whose mass reaches top_p
            break
        kept.append(i)
        acc += w[i]
    kept = [i for i in kept if w[i] >= min_p * w[order[0]]]
    z = sum(w[i] for i in kept)
    return [w[i] / z if i in kept else 0.0 for i in range(len(logits))]


LOGITS_12 = [0.3, 2.0, -1.0, 1.2, 0.9, -0.4, 1.5, 0.0, -2.0, 0.5, -1.5, -3.0]


def draw_counts(logits: list[float] | torch.Tensor, params: SamplingParams, n: int = N_DRAWS) -> list[int]:
    """n draws of one request on fixed logits, batched (rows of one sampler share its stream)."""
    row = torch.as_tensor(logits, dtype=torch.float32)
    sampler = RequestSampler(params)
    chunk = max(1, 4_000_000 // row.numel())
    tokens = []
    for start in range(0, n, chunk):
        rows = min(chunk, n - start)
        result = sample(row.expand(rows, -1), [sampler] * rows)
        assert not result.errors
        tokens.append(result.tokens)
    return torch.bincount(torch.cat(tokens), minlength=row.numel()).tolist()


# Thresholds sit close to a token (a few % away), so an off-by-a-little filter is caught.
FILTER_CASES = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=4),
    dict(temperature=0.9, top_p=0.7),                       # 4th token crosses 0.7 at 0.69 -> 0.79
    dict(temperature=0.8, min_p=0.052),                     # 8th token sits at 0.0498 of the top
    dict(temperature=0.8, top_k=10, min_p=0.052),           # the same, on the top-k path
    dict(temperature=1.5, top_k=6, top_p=0.75, min_p=0.1),  # top-p on the renormalized top-6
]


@pytest.mark.parametrize("case", FILTER_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_filtered_distribution_fits_chi_square(case):
    counts = draw_counts(LOGITS_12, SamplingParams(seed=11, **case))
    expected = reference_probs(LOGITS_12, **case)
    assert chi_square_p(counts, expected) > P_OK
    # The filtered sampler's exact distribution is also what probs_for reports.
    probs = probs_for(torch.tensor(LOGITS_12), RequestSampler(SamplingParams(**case)))
    assert probs.tolist() == pytest.approx(expected, abs=1e-6)


def test_chi_square_rejects_a_wrong_distribution():
    case = dict(temperature=1.3, top_k=4)
    counts = draw_counts(LOGITS_12, SamplingParams(seed=11, **case))
    assert chi_square_p(counts, reference_probs(LOGITS_12, temperature=1.6, top_k=4)) < P_WRONG
    with pytest.raises(AssertionError, match="excluded tokens"):
        chi_square_p(counts, reference_probs(LOGITS_12, temperature=1.3, top_k=3))


def test_top_p_over_a_large_vocab_is_exact():
    # 2000 tokens, a handful carry the mass: the top-p set lies well inside a topk fetch.
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2000, generator=g) - 9.0
    logits[torch.randperm(2000, generator=g)[:8]] = torch.tensor([3.0, 2.5, 2.2, 2.0, 1.5, 1.0, 0.5, 0.2])
    case = dict(temperature=1.0, top_p=0.9)
    expected = reference_probs(logits.tolist(), **case)
    assert sum(p > 0 for p in expected) == 6
    probs = probs_for(logits, RequestSampler(SamplingParams(**case)))
    assert probs.tolist() == pytest.approx(expected, abs=1e-6)
    counts = draw_counts(logits, SamplingParams(seed=5, **case), n=10_000)
    assert chi_square_p(counts, expected) > P_OK


def test_top_k_ties_keep_the_lowest_ids():
    logits = [1.0, 0.0, 1.0, 1.0, 1.0]
    counts = draw_counts(logits, SamplingParams(temperature=1.0, top_k=2, seed=2), n=20_000)
    assert chi_square_p(counts, [0.5, 0.0, 0.5, 0.0, 0.0]) > P_OK


def test_top_p_reaching_past_the_first_fetch_is_exact():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5000, generator=g) * 0.5
    for case in (dict(temperature=1.0, top_p=0.9), dict(temperature=2.0, top_k=3000, top_p=0.5)):
        expected = reference_probs(logits.tolist(), **case)
        assert sum(p > 0 for p in expected) > 1024
        probs = probs_for(logits, RequestSampler(SamplingParams(**case)))
        assert probs.tolist() == pytest.approx(expected, abs=1e-7)


def test_tied_candidates_are_ranked_by_id_whatever_the_batch():
    # Six tokens tie for the top; a batch-mate with a large top_k changes how many
    # candidates are fetched, which must not change which token a given draw maps to.
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3000, generator=g) - 4.0
    logits[torch.tensor([2900, 15, 1200, 7, 2222, 640])] = 2.0
    params = SamplingParams(temperature=1.0, top_k=8, seed=21)
    alone_sampler, batched_sampler = RequestSampler(params), RequestSampler(params)
    mate = RequestSampler(SamplingParams(temperature=1.0, top_k=2000, seed=22))
    for _ in range(40):
        alone = sample(logits[None], [alone_sampler]).tokens[0].item()
        batched = sample(torch.stack([logits, logits]), [mate, batched_sampler]).tokens[1].item()
        assert alone == batched


# --- greedy --------------------------------------------------------------------------------

def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [2.0, -1.0, 2.0, 2.0], [-3.0, -2.0, -1.0, -1.0]])
    greedy = [RequestSampler(SamplingParams()) for _ in range(3)]
    assert sample(logits, greedy).tokens.tolist() == [1, 0, 2]
    big = torch.randn(3, 151_936, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(big, greedy).tokens, big.argmax(-1))
    assert probs_for(logits[0], greedy[0]).tolist() == [0.0, 1.0, 0.0, 0.0]


# --- penalties -----------------------------------------------------------------------------

def test_penalties_follow_the_formulas():
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=0.25, frequency_penalty=0.5)
    sampler = RequestSampler(params, prompt_ids=[1, 2, 1])
    for token in (2, 3, 3, 4):
        sampler.observe(token)
    logits = torch.tensor([1.0, 2.0, -2.0, 3.0, -1.0, 0.7])
    expected = [
        1.0,                            # never seen
        2.0 / 1.5,                      # prompt only: repetition, no presence/frequency
        -2.0 * 1.5 - 0.5 * 1 - 0.25,    # prompt and generated once
        3.0 / 1.5 - 0.5 * 2 - 0.25,     # generated twice
        -1.0 * 1.5 - 0.5 * 1 - 0.25,    # generated once, negative logit
        0.7,
    ]
    assert apply_penalties_(logits.clone(), sampler).tolist() == pytest.approx(expected, abs=1e-6)


def test_sample_applies_penalties_without_touching_the_callers_logits():
    sampler = RequestSampler(SamplingParams(repetition_penalty=3.0, logprobs=3), prompt_ids=[0])
    logits = torch.tensor([[2.0, 1.0, 0.5]])
    before = logits.clone()
    result = sample(logits, [sampler])
    assert result.tokens.tolist() == [1]        # 2.0 / 3 < 1.0: the prompt token lost the argmax
    assert torch.equal(logits, before)
    reference = torch.log_softmax(torch.tensor([2.0 / 3.0, 1.0, 0.5]), -1)
    assert result.logprobs[0].item() == pytest.approx(reference[1].item(), abs=1e-6)
    sampler.observe(1)   # now 0 and 1 are both seen: 2/3, 1/3, 0.5
    assert sample(logits, [sampler]).tokens.tolist() == [0]


# --- seeds and batch independence ------------------------------------------------------------

def run(samplers: list[RequestSampler], steps: list[torch.Tensor]) -> list[tuple[list[int], list[float]]]:
    out = []
    for logits in steps:
        result = sample(logits, samplers)
        assert not result.errors
        for s, t in zip(samplers, result.tokens.tolist()):
            s.observe(t)
        out.append((result.tokens.tolist(), result.logprobs.tolist()))
    return out


def random_steps(n_steps: int, vocab: int, rows: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Rounded to quarter steps: many exact ties, so tie handling must be canonical too.
    return [(torch.randn(rows, vocab, generator=g) * 2).mul(4).round().div(4) for _ in range(n_steps)]


def test_same_seed_same_tokens_and_different_seed_different_tokens():
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=123)
    steps = random_steps(30, 1000, 1, seed=0)
    first = run([RequestSampler(params)], steps)
    again = run([RequestSampler(params)], steps)
    other = run([RequestSampler(SamplingParams(temperature=1.0, top_p=0.95, seed=124))], steps)
    assert first == again
    assert [t for t, _ in first] != [t for t, _ in other]


def test_unseeded_request_records_a_seed_that_replays_it():
    params = SamplingParams(temperature=0.8, top_k=20)
    steps = random_steps(20, 500, 1, seed=1)
    sampler = RequestSampler(params)
    original = run([sampler], steps)
    replay = SamplingParams(temperature=0.8, top_k=20, seed=sampler.seed)
    assert run([RequestSampler(replay)], steps) == original


BATCH_MIX = [
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, repetition_penalty=1.3, frequency_penalty=0.2),
    SamplingParams(temperature=1.2, top_k=50, seed=8),
    SamplingParams(logprobs=5),                                       # greedy
    SamplingParams(temperature=0.8, min_p=0.05, seed=9, presence_penalty=0.5),
    SamplingParams(temperature=1.5, top_p=0.99, seed=10),             # top-p past the topk fetch
    SamplingParams(temperature=1.0, top_k=2000, top_p=0.95, seed=11, logprobs=3),  # bigger fetch
    SamplingParams(temperature=0.7, seed=12),
]


def test_a_rows_samples_do_not_depend_on_its_batch():
    vocab, n_steps = 4000, 12
    steps = random_steps(n_steps, vocab, len(BATCH_MIX), seed=2)
    batched = run([RequestSampler(p, prompt_ids=[5, 6, 7]) for p in BATCH_MIX], steps)
    for row, params in enumerate(BATCH_MIX):
        alone = run([RequestSampler(params, prompt_ids=[5, 6, 7])], [s[row:row + 1] for s in steps])
        assert [(t[row], lp[row]) for t, lp in batched] == [(t[0], lp[0]) for t, lp in alone], row


def test_batch_independence_holds_at_full_vocab_with_threads():
    # At 152k tokens a lone row's reductions may be split across threads, a batched one not.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        params = [SamplingParams(temperature=1.0, top_p=0.95, seed=31, logprobs=2),
                  SamplingParams(temperature=0.8, seed=32), SamplingParams(logprobs=1)]
        steps = [t * 0.5 for t in random_steps(3, 151_936, len(params), seed=3)]
        batched = run([RequestSampler(p) for p in params], steps)
        for row, p in enumerate(params):
            alone = run([RequestSampler(p)], [s[row:row + 1] for s in steps])
            assert [(t[row], lp[row]) for t, lp in batched] == [(t[0], lp[0]) for t, lp in alone], row
    finally:
        torch.set_num_threads(threads)


def test_each_sampled_token_costs_exactly_one_draw():
    params = SamplingParams(temperature=1.0, top_k=5, seed=99)
    sampler = RequestSampler(params)
    run([sampler], random_steps(7, 100, 1, seed=4))
    reference = torch.Generator().manual_seed(99)
    torch.rand(7, generator=reference, dtype=torch.float64)
    assert sampler.uniform() == torch.rand((), generator=reference, dtype=torch.float64).item()


# --- logprobs --------------------------------------------------------------------------------

def test_logprobs_are_sorted_normalized_and_match_the_chosen_token():
    params = [SamplingParams(temperature=0.6, seed=1, logprobs=12),
              SamplingParams(logprobs=4),
              SamplingParams(temperature=1.0, top_k=3, seed=2)]
    samplers = [RequestSampler(p) for p in params]
    logits = torch.tensor([LOGITS_12] * 3)
    result = sample(logits, samplers)
    full = result.top_logprobs[0]
    assert len(full) == 12 and [lp for _, lp in full] == sorted((lp for _, lp in full), reverse=True)
    assert sum(math.exp(lp) for _, lp in full) == pytest.approx(1.0, abs=1e-5)
    reference = torch.log_softmax(torch.tensor(LOGITS_12) / 0.6, -1)   # after temperature
    assert dict(full) == pytest.approx({i: v for i, v in enumerate(reference.tolist())}, abs=1e-5)
    assert result.logprobs[0].item() == pytest.approx(dict(full)[result.tokens[0].item()], abs=1e-6)
    greedy_ref = torch.log_softmax(torch.tensor(LOGITS_12), -1)        # greedy: temperature 1
    assert result.top_logprobs[1] == pytest.approx(
        list(zip(greedy_ref.argsort(descending=True)[:4].tolist(), greedy_ref.sort(descending=True).values[:4].tolist())),
        abs=1e-6)
    assert result.top_logprobs[2] == []
    assert result.logprobs[2].item() == pytest.approx(greedy_ref[result.tokens[2]].item(), abs=1e-6)


# --- failures stay in their row --------------------------------------------------------------

def test_a_bad_row_fails_alone():
    vocab = 1000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(4))
    logits[1, 17] = float("nan")
    logits[2] = float("-inf")
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=3), SamplingParams(temperature=0.5, seed=4),
              SamplingParams(top_k=5, temperature=1.0, seed=5), SamplingParams()]
    result = sample(logits, [RequestSampler(p) for p in params])
    assert set(result.errors) == {1, 2}
    assert all(isinstance(e, TokentopError) and e.row == row for row, e in result.errors.items())
    assert "row 1" in str(result.errors[1]) and "NaN" in str(result.errors[1])
    assert "-inf" in str(result.errors[2])
    assert result.tokens[1].item() == result.tokens[2].item() == -1
    for row in (0, 3):
        alone = sample(logits[row:row + 1], [RequestSampler(params[row])])
        assert result.tokens[row].item() == alone.tokens[0].item()
        assert math.isfinite(result.logprobs[row].item())
    with pytest.raises(SamplingError, match="NaN"):
        probs_for(logits[1], RequestSampler(params[1]))


def test_invalid_params_are_refused():
    with pytest.raises(InvalidRequest, match="top_p"):
        RequestSampler(SamplingParams(top_p=0.0))


# --- speculative building blocks ----------------------------------------------------------------

P_LOGITS = [1.0, 0.2, -0.5, 2.0, 0.0, -1.0, 0.7, 1.4, -2.0, 0.3]
Q_LOGITS = [0.5, 1.5, -0.2, 1.0, 0.8, -1.5, 0.0, 2.2, -1.0, -0.3]


def speculative_draws(target: torch.Tensor, q: torch.Tensor, replacement: torch.Tensor, seed: int,
                      n: int = 50_000) -> tuple[list[int], float]:
    """x ~ q, keep it with prob min(1, target/q), else draw from `replacement`. Returns counts, accept rate."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(3, n, generator=g, dtype=torch.float64)
    vocab = q.shape[-1]
    x = draw_from(q.expand(n, vocab), u[0])
    accepted = speculative_accept(target.expand(n, vocab), q.expand(n, vocab), x, u[1])
    fallback = draw_from(replacement.expand(n, vocab), u[2])
    out = torch.where(accepted, x, fallback)
    return torch.bincount(out, minlength=vocab).tolist(), accepted.double().mean().item()


def softmax_list(logits: list[float]) -> list[float]:
    z = sum(math.exp(x) for x in logits)
    return [math.exp(x) / z for x in logits]


def test_lossless_speculative_sampling_yields_the_target():
    p, q = torch.tensor(softmax_list(P_LOGITS)), torch.tensor(softmax_list(Q_LOGITS))
    counts, rate = speculative_draws(p, q, residual(p, q), seed=1)
    assert chi_square_p(counts, softmax_list(P_LOGITS)) > P_OK
    expected_rate = 1 - total_variation(p, q).item()
    assert abs(rate - expected_rate) < 5 * math.sqrt(expected_rate * (1 - expected_rate) / 50_000)
    # Power check: replacing rejected drafts with a fresh draft draw does not give p.
    wrong, _ = speculative_draws(p, q, q, seed=1)
    assert chi_square_p(wrong, softmax_list(P_LOGITS)) < P_WRONG


@pytest.mark.parametrize("budget", [0.0, 0.1, 0.25, 1.0])
def test_mentored_decoding_yields_the_interpolation(budget):
    p_list, q_list = softmax_list(P_LOGITS), softmax_list(Q_LOGITS)
    d = 0.5 * sum(abs(a - b) for a, b in zip(p_list, q_list))
    theta_ref = min(1.0, budget / d)
    pi_ref = [(1 - theta_ref) * a + theta_ref * b for a, b in zip(p_list, q_list)]
    p, q = torch.tensor(p_list, dtype=torch.float64), torch.tensor(q_list, dtype=torch.float64)
    pi, theta = mentored_mix(p, q, budget)
    assert theta.item() == pytest.approx(theta_ref, abs=1e-12)
    assert pi.tolist() == pytest.approx(pi_ref, abs=1e-12)
    assert total_variation(pi, p).item() <= budget + 1e-12
    if theta_ref < 1:   # the article's max(p - q, 0) is the same distribution as max(π - q, 0)
        assert residual(pi, q).tolist() == pytest.approx(residual(p, q).tolist(), abs=1e-12)
    counts, rate = speculative_draws(pi, q, residual(pi, q), seed=2)
    assert chi_square_p(counts, pi_ref) > P_OK
    if budget == 1.0:
        assert rate == 1.0
    if budget > 0:   # the mixture is measurably not p: the test can tell them apart
        assert chi_square_p(counts, p_list) < P_WRONG


def test_mentored_mix_of_identical_distributions_has_theta_one():
    p = torch.tensor(softmax_list(P_LOGITS))
    pi, theta = mentored_mix(p, p.clone(), 0.0)
    assert theta.item() == 1.0 and torch.equal(pi, p)


def test_probs_for_feeds_speculation_with_the_filtered_distribution():
    target = probs_for(torch.tensor(P_LOGITS), RequestSampler(SamplingParams(temperature=0.8, top_k=5)))
    draft = probs_for(torch.tensor(Q_LOGITS), RequestSampler(SamplingParams(temperature=0.8, top_k=5)))
    expected = reference_probs(P_LOGITS, temperature=0.8, top_k=5)
    counts, _ = speculative_draws(target, draft, residual(target, draft), seed=3)
    assert chi_square_p(counts, expected) > P_OK


def test_weights_below_float32s_normal_range_are_zero_so_no_denormal_is_computed():
    """exp of a score under EXP_FLOOR would be a denormal float32, which x86 computes and sums
    on microcode assists (exp ~6x slower on a row at temperature 0.2): such a token's weight
    is exactly 0, and it is never drawn; the others keep exp(score) bit for bit."""
    from engine.worker.sampling import EXP_FLOOR, _score

    logits = torch.tensor([[0.0, -10.0, -17.3, -17.5, float("-inf")]])
    sc = _score(logits, [RequestSampler(SamplingParams(temperature=0.2, seed=1))])
    assert sc.scaled[0, 2] > EXP_FLOOR > sc.scaled[0, 3]       # -86.5 and -87.5 after T = 0.2
    assert sc.expd[0, 3] == 0 and sc.expd[0, 4] == 0
    assert torch.equal(sc.expd[0, :3], sc.scaled[0, :3].exp()) and sc.expd[0, 2] > 0
    assert torch.isfinite(sc.scaled[0, 3])                    # its logprob is still reported


def test_exp_never_sees_a_score_under_the_floor(monkeypatch):
    """exp's vectorized path runs slow code for any lane whose result is not a normal float,
    -inf's included (5-10x on a row at temperature 0.2): scores are clamped to EXP_FLOOR first."""
    from engine.worker.sampling import EXP_FLOOR, _score

    seen = []
    for name in ("exp", "exp_"):
        original = getattr(torch.Tensor, name)

        def spy(t, *a, _original=original, **kw):
            seen.append(float(t.min()))
            return _original(t, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, spy)
    logits = torch.tensor([[0.0, -10.0, -17.5, -300.0, float("-inf")]])
    sc = _score(logits, [RequestSampler(SamplingParams(temperature=0.2, seed=1))])
    assert seen and min(seen) >= EXP_FLOOR
    assert sc.expd[0, 2:].tolist() == [0.0, 0.0, 0.0] and sc.expd[0, 0] == 1.0


@pytest.mark.parametrize("size", [7, 1024, 1500, 151_936])
def test_the_two_level_inverse_cdf_draws_what_one_running_sum_draws(size):
    """Block sums then a scan inside the block pick the token a float64 running sum over the
    whole row picks; a zero weight is never picked, even for u just under 1."""
    from engine.worker.sampling import _inverse_cdf

    gen = torch.Generator().manual_seed(size)
    weights = torch.rand(4, size, generator=gen) ** 8                      # many tiny weights
    weights[torch.rand(4, size, generator=gen) < 0.5] = 0.0                 # and many zeros
    weights[:, -1] = 0.0                                                    # the last token is out
    cum = weights.cumsum(-1, dtype=torch.float64)
    for _ in range(200):
        u = torch.rand(4, generator=gen, dtype=torch.float64)
        expected = torch.searchsorted(cum, (u * cum[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        assert torch.equal(_inverse_cdf(weights, u), expected)
    top = _inverse_cdf(weights, torch.full((4,), 1 - 2 ** -53, dtype=torch.float64))
    assert bool((weights.gather(-1, top.unsqueeze(-1)) > 0).all())
