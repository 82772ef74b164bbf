"""The engine running a real forward pass: a tiny random GGUF (fast) and the bundled model."""
import random
import time

import pytest

import engine.worker.runner as runner
import engine.worker.sampling as sampling
from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.facade.engine import Engine
from engine.messages import Finished
from tests.waiting import pages_back


def start(model, mode="thread", **worker):
    cfg = WorkerConfig(**{"model": str(model), "threads": 1, "calibrate": False, **worker})
    return Engine(EngineConfig(workers=(cfg,), worker_mode=mode)).start(timeout=300)


PROMPTS = ["hello there", "a much longer prompt about caches, pages and schedulers " * 3,
           "x", "the quick brown fox", "tokens tokens tokens", "zebra " * 20]


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_deterministic_mode_batch_invariant(tiny_model_path, arch):
    """A request's greedy output is identical alone and batched with any others."""
    model = tiny_model_path(arch)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with start(model, deterministic=True, max_batched_tokens=48) as engine:
        alone = [engine.generate(p, params=params).token_ids for p in PROMPTS]
        for order in (PROMPTS, PROMPTS[::-1]):
            handles = [engine.submit(p, params=params) for p in order]
            batched = [h.result(60).token_ids for h in handles]
            expected = alone if order is PROMPTS else alone[::-1]
            assert batched == expected


def test_seeded_sampling_is_reproducible_in_any_batch(tiny_model_path):
    model = tiny_model_path("qwen2")
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    with start(model, deterministic=True) as engine:
        alone = engine.generate("seeded", params=p).token_ids
        others = [engine.submit(q, params=SamplingParams(max_tokens=16, temperature=1.0, seed=i))
                  for i, q in enumerate(PROMPTS)]
        batched = engine.submit("seeded", params=p).result(60).token_ids
        for h in others:
            h.result(60)
        assert batched == alone
        assert engine.generate("seeded", params=SamplingParams(
            max_tokens=16, temperature=0.9, top_p=0.9, seed=4321, ignore_eos=True)).token_ids != alone


def test_stop_strings_and_stop_tokens(tiny_model_path):
    model = tiny_model_path("qwen2")
    with start(model) as engine:
        full = engine.generate("stop me", params=SamplingParams(max_tokens=30, ignore_eos=True))
        assert len(full.text) > 6
        stop = full.text[3:6]
        cut = engine.generate("stop me", params=SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,)))
        assert cut.finish_reason == "stop" and stop not in cut.text
        assert full.text.startswith(cut.text) and full.text.find(stop) == len(cut.text)
        tok = full.token_ids[4]
        by_id = engine.generate("stop me", params=SamplingParams(max_tokens=30, ignore_eos=True,
                                                                 stop_token_ids=(tok,)))
        assert by_id.finish_reason == "stop" and by_id.token_ids == full.token_ids[:full.token_ids.index(tok)]


def test_logprobs_are_reported(tiny_model_path):
    with start(tiny_model_path("qwen2")) as engine:
        deltas = list(engine.submit("logprobs", params=SamplingParams(max_tokens=4, logprobs=3)))
        assert all(len(d.top_logprobs) == 3 and d.logprob <= 0 for d in deltas)
        assert all(d.top_logprobs[0][1] >= d.logprob for d in deltas)


def test_fault_in_one_requests_sampling_fails_only_it(tiny_model_path, monkeypatch):
    real_sample = sampling.sample

    def poisoned(logits, samplers, picked=None):
        for row, s in enumerate(samplers):
            if s.params.seed == 666:
                logits[row] = float("nan")
        return real_sample(logits, samplers, picked)

    monkeypatch.setattr(runner, "sample", poisoned)   # the name the runner calls
    with start(tiny_model_path("qwen2")) as engine:
        good = [engine.submit(p, params=SamplingParams(max_tokens=12, ignore_eos=True)) for p in PROMPTS[:3]]
        bad = engine.submit("poison", params=SamplingParams(max_tokens=12, seed=666, temperature=1.0))
        failed = bad.result(60)
        assert failed.finish_reason == "error" and "nan" in failed.error.lower()
        assert all(h.result(60).finish_reason == "length" for h in good)
        assert pages_back(engine)


POISON_SEED = 666


def _poisoned(items_or_samplers) -> bool:
    return any(getattr(x, "seq", x).params.seed == POISON_SEED for x in items_or_samplers)


def _fault_in_sampling(monkeypatch):
    """sample() raises after every row has drawn its random number, when the poisoned request
    is in the batch: a retry must rewind the other requests' streams."""
    real_sample = sampling.sample

    def faulty(logits, samplers, *picked):   # picked: the captured step's greedy pick (CUDA)
        result = real_sample(logits, samplers, *picked)
        if _poisoned(samplers):
            raise RuntimeError("injected sampling fault")
        return result

    monkeypatch.setattr(runner, "sample", faulty)


def _fault_in_forward(monkeypatch):
    real_build = runner.ModelRunner.build_batch

    def faulty(self, plan, blocks):
        if _poisoned(plan.items):
            raise RuntimeError("injected forward fault")
        return real_build(self, plan, blocks)

    monkeypatch.setattr(runner.ModelRunner, "build_batch", faulty)


def _fault_in_output(monkeypatch):
    """The poisoned request's third token cannot be processed (after two were streamed)."""
    from engine.worker.output import OutputProcessor

    real_on_token = OutputProcessor.on_token

    def faulty(self, seq, sample, now, drafted=False):
        if seq.params.seed == POISON_SEED and len(seq.output_ids) == 2:
            raise RuntimeError("injected output fault")
        return real_on_token(self, seq, sample, now, drafted)

    monkeypatch.setattr(OutputProcessor, "on_token", faulty)


@pytest.mark.parametrize("inject", [_fault_in_sampling, _fault_in_forward, _fault_in_output],
                         ids=["sampling", "forward", "output"])
def test_a_request_that_makes_the_step_fail_fails_alone(tiny_model_path, monkeypatch, inject):
    """One request's fault in a shared step (its rows of the forward, its sampling, its
    output) ends that request with the error; the step runs again without it, and every other
    request's tokens are those of a run without it: greedy and seeded, prefill and decode."""
    model = tiny_model_path("qwen2")
    good = [(p, SamplingParams(max_tokens=20, ignore_eos=True, **({"temperature": 1.0, "seed": i} if i % 2 else {})))
            for i, p in enumerate(PROMPTS[:5])]
    bad = ("poison", SamplingParams(max_tokens=20, temperature=1.0, seed=POISON_SEED, ignore_eos=True))
    with start(model, deterministic=True) as engine:
        handles = [engine.submit(p, params=q) for p, q in good]
        reference = [h.result(60).token_ids for h in handles]
        inject(monkeypatch)
        handles = [engine.submit(p, params=q) for p, q in good[:2] + [bad] + good[2:]]
        results = [h.result(60) for h in handles]
        failed = results.pop(2)
        assert failed.finish_reason == "error" and "injected" in failed.error, failed.error
        assert [r.finish_reason for r in results] == ["length"] * 5, [r.error for r in results]
        assert [r.token_ids for r in results] == reference
        assert pages_back(engine)


def test_a_draft_model_fault_fails_only_the_requests_it_drafted_for(tiny_model_path, monkeypatch):
    from engine.speculative.draft import DraftModel

    target = tiny_model_path("qwen2")
    draft = tiny_model_path("qwen2", n_layers=1, seed=5)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    with start(target, deterministic=True, draft_model=str(draft), speculate="off") as engine:
        reference = [engine.submit(p, params=params) for p in PROMPTS[:3]]
        reference = [h.result(60).token_ids for h in reference]

        def broken(self, requests, blocks):
            raise RuntimeError("injected draft fault")

        monkeypatch.setattr(DraftModel, "propose", broken)
        spec = engine.submit("zebra " * 12, params=SamplingParams(max_tokens=20, ignore_eos=True, speculate="draft",
                                                                  spec_k="3"))
        others = [engine.submit(p, params=params) for p in PROMPTS[:3]]
        failed = spec.result(60)
        assert failed.finish_reason == "error" and "injected draft fault" in failed.error
        assert [h.result(60).token_ids for h in others] == reference
        assert pages_back(engine)


def test_randomized_stress_with_aborts_returns_every_page(tiny_model_path):
    """Hundreds of requests of random lengths, random aborts, a pool small enough to preempt."""
    rng = random.Random(7)
    model = tiny_model_path("qwen2")
    with start(model, max_active=6, kv_cache_memory=48 * 16 * 2 * 2 * 2 * 16 * 4, page_size=16,
               max_batched_tokens=64) as engine:
        handles = []
        for i in range(240):
            prompt = " ".join(rng.choice(["cache", "page", "token", "step", "batch"])
                              for _ in range(rng.randint(1, 40)))
            handles.append(engine.submit(prompt, params=SamplingParams(max_tokens=rng.randint(1, 24))))
            if rng.random() < 0.2:
                engine.abort(rng.choice(handles).id)
            if rng.random() < 0.1:
                time.sleep(0.01)
        results = [h.result(300) for h in handles]
        assert len({r.id for r in results}) == 240
        assert all(r.finish_reason in ("length", "stop", "abort") for r in results), \
            [r.error for r in results if r.finish_reason == "error"][:3]
        assert any(r.finish_reason == "abort" for r in results)
        assert pages_back(engine)
        for h in handles:   # no request was answered twice: each handle got exactly one end event
            events = []
            while not h._q.empty():
                events.append(h._q.get_nowait())
            assert sum(isinstance(e, Finished) for e in events) == 1


@pytest.mark.realmodel
def test_eight_concurrent_requests_on_the_default_model(real_model_path):
    """Eight requests stream correct text together; deterministic mode makes them identical
    to the same requests run alone."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at",
               "The largest planet in the solar system is", "import numpy as np\n",
               "Once upon a time", "SELECT * FROM", "The speed of light is"]
    params = SamplingParams(max_tokens=12)
    with start(real_model_path, threads=2, deterministic=True, max_active=8) as engine:
        handles = [engine.submit(p, params=params) for p in prompts]
        streamed = {h.id: "".join(d.text for d in h) for h in handles}
        batched = [h.result() for h in handles]
        assert all(streamed[r.id] == r.text for r in batched)
        assert batched[0].text.startswith(" Paris")
        for p, r in zip(prompts[:3], batched[:3]):
            assert engine.generate(p, params=params).token_ids == r.token_ids
