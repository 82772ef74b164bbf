"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; Snowflake's ArcticInference, vLLM's
`suffix` method): proposals from suffix trees, no model.

Two indexes, as there: one per request over its prompt and output, and one per worker over
the outputs of recent requests. The shared one sees what prompt lookup cannot: a task asked
again, an agent loop's next turn, the same kind of code written for another prompt.

Both count every substring of up to `depth` tokens. A proposal matches the context's last
1 .. depth - 1 tokens, then follows the most frequent continuation while the path's probability
(the product of child count / parent count) stays at or above `min_prob`; its length is at
most match length × `factor`, so longer matches may speculate further. Of every match length
in both indexes the proposal with the highest score (the sum of its tokens' probabilities) wins.

The shared index is a suffix tree (SuffixTree) that outputs extend token by token. A request's
own index is its token array itself (speculate_sequence): the occurrences of the context's
last tokens are found with numpy, so a long prompt costs nothing to index, where inserting it
into a tree would cost depth dict operations per token, in Python, before its first step.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

DEPTH = 24               # longest substring counted (vLLM's suffix_decoding_max_tree_depth)
MIN_PROB = 0.1           # a path stops below this probability (suffix_decoding_min_token_prob)
SPEC_FACTOR = 1.0        # tokens proposed per token matched (suffix_decoding_max_spec_factor)
CACHE_REQUESTS = 1000    # finished requests' outputs kept in the shared tree
CACHE_TOKENS = 200_000   # tokens the shared tree holds at most (the oldest outputs go first)


class _Node:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, _Node] = {}


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class SuffixTree:
    """Occurrence counts of every substring of up to `depth` tokens of the sequences it holds.
    A sequence grows at its end only; removing it takes its counts back out."""

    def __init__(self, depth: int = DEPTH):
        if depth < 2:
            raise ValueError(f"suffix tree depth must be at least 2, got {depth}")
        self.depth = depth
        self.root = _Node()
        self._seqs: dict[object, list[int]] = {}
        self._active: dict[object, deque[_Node]] = {}   # the nodes of the sequence's last suffixes
        self.num_tokens = 0

    def __contains__(self, key) -> bool:
        return key in self._seqs

    def extend(self, key, tokens: Sequence[int]) -> None:
        """Append tokens to sequence `key` (a new one if unknown): O(depth) per token."""
        seq = self._seqs.setdefault(key, [])
        active = self._active.setdefault(key, deque())
        for token in tokens:
            token = int(token)
            active.append(self.root)
            for i, node in enumerate(active):
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                active[i] = child
            if len(active) >= self.depth:   # the longest suffix cannot grow further
                active.popleft()
            seq.append(token)
        self.num_tokens += len(tokens)

    def remove(self, key) -> None:
        """Take sequence `key`'s substrings out; nodes no other sequence uses are freed."""
        seq = self._seqs.pop(key, None)
        self._active.pop(key, None)
        if seq is None:
            return
        self.num_tokens -= len(seq)
        for start in range(len(seq)):
            node = self.root
            for token in seq[start:start + self.depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:   # its subtree counted only this occurrence
                    del node.children[token]
                    break
                node = child

    def match(self, pattern: Sequence[int]) -> _Node | None:
        node = self.root
        for token in pattern:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def speculate(self, context: Sequence[int], max_tokens: int, factor: float = SPEC_FACTOR,
                  min_prob: float = MIN_PROB) -> Proposal:
        """The best-scoring continuation of the context's end (see the module docstring)."""
        best = Proposal()
        longest = min(len(context) - 1, self.depth - 1)
        for match_len in range(1, longest + 1):
            node = self.match(context[len(context) - match_len:])
            if node is None:
                break   # a longer suffix cannot occur where this one does not
            limit = min(max_tokens, int(match_len * factor + 1e-6))
            tokens, score = _follow(node, limit, min_prob)
            if tokens and score >= best.score:   # ties go to the longer match
                best = Proposal(tokens, score, match_len)
        return best


def _follow(node: _Node, limit: int, min_prob: float) -> tuple[list[int], float]:
    """Walk the most frequent children while the path's probability stays >= min_prob."""
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    while len(tokens) < limit and node.children:
        token, child = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))
        p = prob * child.count / node.count
        if p < min_prob:
            break
        tokens.append(token)
        score += p
        prob, node = p, child
    return tokens, score


def speculate_sequence(tokens: Sequence[int], max_tokens: int, depth: int = DEPTH,
                       factor: float = SPEC_FACTOR, min_prob: float = MIN_PROB) -> Proposal:
    """SuffixTree.speculate over a tree of this one sequence, whose end is the context."""
    arr = np.asarray(tokens, dtype=np.int64)
    n = len(arr)
    best = Proposal()
    if n < 2:
        return best
    ends = np.flatnonzero(arr == arr[-1])   # where the context's last token occurs
    path, probs, followed = [], [], 0
    for match_len in range(1, min(n - 1, depth - 1) + 1):
        if match_len > 1:   # of the occurrences so far, those preceded by the next context token
            starts = ends - (match_len - 1)
            keep = starts >= 0
            ends = ends[keep][arr[starts[keep]] == arr[n - match_len]]
        if len(ends) < 2:
            break   # only the context itself: no continuation, now or for longer matches
        if len(ends) != followed:
            # a new set of occurrences; while it stays the same, the greedy path does too,
            # and each match length takes as much of it as its limit allows
            path, probs = _follow_positions(arr, ends, min(max_tokens, depth - match_len), min_prob)
            followed = len(ends)
        limit = min(max_tokens, int(match_len * factor + 1e-6), depth - match_len)
        score = sum(probs[:limit])
        if path and limit > 0 and score >= best.score:
            best = Proposal(path[:limit], score, match_len)
    return best


def _follow_positions(arr: np.ndarray, ends: np.ndarray, limit: int,
                      min_prob: float) -> tuple[list[int], list[float]]:
    """_follow on the occurrences (their end positions) instead of a tree node: the tokens and
    each one's path probability."""
    tokens: list[int] = []
    probs: list[float] = []
    prob, count = 1.0, len(ends)
    while len(tokens) < limit:
        nxt = ends + 1
        nxt = nxt[nxt < len(arr)]
        if not nxt.size:
            break
        values, counts = np.unique(arr[nxt], return_counts=True)
        i = int(np.argmax(counts))   # the first of the most frequent: the smallest token on a tie
        p = prob * int(counts[i]) / count
        if p < min_prob:
            break
        tokens.append(int(values[i]))
        probs.append(p)
        prob, count = p, int(counts[i])
        ends = nxt[arr[nxt] == values[i]]
    return tokens, probs


class SuffixCache:
    """A worker's suffix indexes: each running request's own (its tokens), and a tree shared by
    all over their outputs, which keeps finished requests' outputs until a cap on requests or
    tokens evicts the oldest."""

    def __init__(self, depth: int = DEPTH, max_requests: int = CACHE_REQUESTS,
                 max_tokens: int = CACHE_TOKENS):
        self.depth = depth
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.shared = SuffixTree(depth)
        self._keys: dict[str, int] = {}          # running request id -> its output's key in the shared tree
        self._finished: OrderedDict[int, None] = OrderedDict()   # oldest first
        self._next_key = itertools.count()

    @property
    def cached_requests(self) -> int:
        return len(self._finished)

    def start(self, request_id: str) -> None:
        self.stop(request_id)
        self._keys[request_id] = next(self._next_key)

    def add_output(self, request_id: str, tokens: Sequence[int]) -> None:
        if request_id not in self._keys or not tokens:
            return
        self.shared.extend(self._keys[request_id], tokens)
        self._evict()

    def stop(self, request_id: str) -> None:
        """The request ended: its output stays shared (until evicted)."""
        key = self._keys.pop(request_id, None)
        if key is None:
            return
        if key in self.shared:
            self._finished[key] = None
        self._evict()

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int,
                factor: float = SPEC_FACTOR, min_prob: float = MIN_PROB) -> Proposal:
        """The better of the request's own index's and the shared tree's proposals; tokens
        are the request's prompt and output so far."""
        if request_id not in self._keys or max_tokens <= 0:
            return Proposal()
        own = speculate_sequence(tokens, max_tokens, self.depth, factor, min_prob)
        shared = self.shared.speculate(tokens[-self.depth:], max_tokens, factor, min_prob)
        return shared if shared.score > own.score else own

    def _evict(self) -> None:
        while self._finished and (len(self._finished) > self.max_requests
                                  or self.shared.num_tokens > self.max_tokens):
            key, _ = self._finished.popitem(last=False)
            self.shared.remove(key)
