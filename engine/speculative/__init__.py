"""Speculative decoding inside continuous batching.

A proposer guesses the next k tokens of a decoding request (ngram.py: prompt lookup;
suffix.py: suffix trees over the request and recent outputs; draft.py: a small draft model
on the same worker). The target verifies them in the very
step that decodes everyone else: the request's row of the flat batch becomes 1 + k rows
(its pending token and the drafts), each attended exactly like a decode. verify.py turns
the k + 1 target distributions into emitted tokens (greedy / lossless / mentored
acceptance, bonus token); controller.py rolls rejected positions' KV back and keeps the
metrics; policy.py chooses k per request and step.
"""
