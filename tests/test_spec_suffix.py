"""Suffix decoding: the tree's counts, matching, scoring and eviction; proposals across requests
that prompt lookup cannot make; greedy output unchanged on the tiny and the real model."""
import random

import pytest

from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.facade.engine import Engine
from engine.speculative.ngram import propose_ngram
from engine.speculative.suffix import SuffixCache, SuffixTree, speculate_sequence
from tests.waiting import pages_back


def counts(tree: SuffixTree, pattern) -> int:
    node = tree.match(pattern)
    return 0 if node is None else node.count


# --- the tree --------------------------------------------------------------------------

def test_insert_counts_every_substring_up_to_the_depth():
    tree = SuffixTree(depth=3)
    tree.extend("a", [1, 2, 1, 2])
    assert counts(tree, [1]) == 2 and counts(tree, [2]) == 2
    assert counts(tree, [1, 2]) == 2 and counts(tree, [2, 1]) == 1
    assert counts(tree, [1, 2, 1]) == 1 and counts(tree, [2, 1, 2]) == 1
    assert tree.match([1, 2, 1, 2]) is None          # longer than the depth: not kept
    tree.extend("a", [1])                              # growing at the end = inserting the whole
    whole = SuffixTree(depth=3)
    whole.extend("b", [1, 2, 1, 2, 1])
    for pattern in ([1], [2], [1, 2], [2, 1], [1, 2, 1], [2, 1, 2]):
        assert counts(tree, pattern) == counts(whole, pattern)


def test_match_follows_the_most_frequent_continuation_and_scores_it():
    tree = SuffixTree(depth=8)
    # after "5 6": 7 three times, 9 once
    tree.extend("a", [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 9, 0, 5, 6])
    got = tree.speculate([0, 5, 6], max_tokens=4, min_prob=0.0)
    assert got.tokens == [7, 8]            # a 2-token match proposes at most 2 tokens
    assert got.match_len == 2
    # "5 6" occurs 5 times (the context's own end included), 3 go on to 7 and then to 8
    assert got.score == pytest.approx(3 / 5 + 3 / 5)


def test_min_prob_stops_the_path_and_factor_caps_its_length():
    tree = SuffixTree(depth=8)
    tree.extend("a", [1, 2, 3, 1, 2, 4, 1, 2])
    assert tree.speculate([9, 1, 2], 8, min_prob=0.5).tokens == []       # 3 and 4: 1/3 each
    assert tree.speculate([9, 1, 2], 8, min_prob=0.3).tokens[:1] in ([3], [4])
    tree.extend("b", [7, 7, 8, 9, 10, 11])
    assert tree.speculate([0, 7, 7], 8, factor=1.0, min_prob=0.0).tokens == [8, 9]
    assert tree.speculate([0, 7, 7], 8, factor=3.0, min_prob=0.0).tokens == [8, 9, 10, 11]


def test_remove_takes_a_sequence_back_out_and_frees_its_nodes():
    tree = SuffixTree(depth=4)
    tree.extend("keep", [1, 2, 3])
    tree.extend("gone", [1, 2, 9, 9, 9])
    tree.remove("gone")
    alone = SuffixTree(depth=4)
    alone.extend("keep", [1, 2, 3])
    assert _shape(tree.root) == _shape(alone.root)
    assert tree.num_tokens == 3 and "gone" not in tree


@pytest.mark.parametrize("seed", range(40))
def test_a_request_s_own_index_proposes_what_a_tree_of_its_tokens_would(seed):
    rng = random.Random(seed)
    depth = rng.choice([4, 8, 24])
    vocab = rng.choice([2, 3, 5, 20])
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
    tree = SuffixTree(depth)
    tree.extend("r", tokens)
    for max_tokens, factor, min_prob in ((8, 1.0, 0.1), (3, 2.0, 0.0), (16, 4.0, 0.3)):
        want = tree.speculate(tokens[-depth:], max_tokens, factor, min_prob)
        got = speculate_sequence(tokens, max_tokens, depth, factor, min_prob)
        assert (got.tokens, got.match_len) == (want.tokens, want.match_len)
        assert got.score == pytest.approx(want.score)


def _shape(node):
    return {t: (c.count, _shape(c)) for t, c in node.children.items()}


def test_the_shared_tree_keeps_recent_outputs_and_evicts_the_oldest():
    cache = SuffixCache(depth=6, max_requests=2, max_tokens=10_000)
    for i in range(4):
        rid = f"r{i}"
        cache.start(rid)
        cache.add_output(rid, [10 * i + 1, 10 * i + 2, 10 * i + 3])
        cache.stop(rid)
    assert cache.cached_requests == 2
    assert cache.shared.match([1, 2]) is None and cache.shared.match([11, 12]) is None
    assert counts(cache.shared, [31, 32]) == 1
    tokens = SuffixCache(depth=6, max_requests=100, max_tokens=8)
    for i in range(5):
        tokens.start(f"t{i}")
        tokens.add_output(f"t{i}", [i] * 3)
        tokens.stop(f"t{i}")
        assert tokens.shared.num_tokens <= 8
    assert tokens.cached_requests == 2


def test_a_repeated_task_gets_proposals_prompt_lookup_cannot_see():
    """The second pass of a burst: its prompt has never shown the answer, the last output has."""
    cache = SuffixCache(depth=24)
    prompt = [1, 2, 3, 4]
    answer = list(range(50, 66))
    cache.start("first")
    cache.add_output("first", answer)
    cache.stop("first")
    cache.start("second")
    context = prompt + answer[:6]
    cache.add_output("second", answer[:6])
    got = cache.propose("second", context, 6).tokens
    assert got == answer[6:12]
    assert propose_ngram(context, 6, 1, 4) == []


# --- in the engine ---------------------------------------------------------------------

def start(model, **worker):
    cfg = WorkerConfig(**{"model": str(model), "threads": 1, "calibrate": False, **worker})
    return Engine(EngineConfig(workers=(cfg,), worker_mode="thread")).start(timeout=300)


PROMPTS = ["tokens tokens tokens tokens", "one two three four one two three four one two", "hello there",
           "write a loop", "write a loop"]


@pytest.mark.parametrize("spec_k", ["4", "adaptive:cost"])
def test_greedy_suffix_speculation_is_token_identical(tiny_model_path, spec_k):
    model = tiny_model_path("qwen2")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with start(model, deterministic=True, max_batched_tokens=64) as engine:
        plain = [engine.generate(p, params=params).token_ids for p in PROMPTS]
    with start(model, deterministic=True, max_batched_tokens=64, speculate="suffix", spec_k=spec_k) as engine:
        first = [engine.generate(p, params=params) for p in PROMPTS]   # one by one: each sees the last
        again = [h.result(60) for h in [engine.submit(p, params=params) for p in PROMPTS]]
        assert [r.token_ids for r in first] == plain and [r.token_ids for r in again] == plain
        assert sum(r.metrics.spec["accepted_tokens"] for r in again) > 0
        assert pages_back(engine)


def test_real_model_greedy_suffix_equals_target_only_and_the_second_pass_accepts(real_model_path):
    prompt = "Write a Python function that returns the squares of a list of numbers. Code only."
    params = SamplingParams(max_tokens=40)
    with start(real_model_path, deterministic=True, spec_k="4") as engine:
        plain = engine.generate(prompt, params=params).token_ids
        first = engine.generate(prompt, params=SamplingParams(max_tokens=40, speculate="suffix"))
        second = engine.generate(prompt, params=SamplingParams(max_tokens=40, speculate="suffix"))
    assert first.token_ids == plain and second.token_ids == plain
    assert second.metrics.spec["accepted_tokens"] > first.metrics.spec["accepted_tokens"]


def test_the_repeated_burst_benchmark_runs_both_passes_and_keeps_the_tokens(tiny_model_path):
    from engine.bench.spec import repeated_burst
    with start(tiny_model_path("qwen2", context_length=2048), deterministic=True, max_batched_tokens=2048,
               kv_cache_memory=64 * 2**20) as engine:
        got = repeated_burst(engine, 12)
    assert len(got["off_tok_s"]) == 2 and len(got["suffix_tok_s"]) == 2
    assert all(got["same_tokens_as_first_off_pass"].values())   # --deterministic: batch-invariant
    assert got["suffix_acceptance"][1] is not None and got["suffix_acceptance"][1] > 0
    assert got["second_pass_suffix_vs_off"] > 0
