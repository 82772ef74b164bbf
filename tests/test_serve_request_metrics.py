"""--enable-per-request-metrics: each response's `metrics` object, streamed and not, checked
against the engine's own record of the request (the Finished event the dispatcher applies)."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from engine import messages as msg
from engine.serve.app import served_names
from engine.serve.request_metrics import response_metrics, speculative_decoding
from engine.speculative.stats import SpecStats
from tests.serve_util import in_process_server
from tests.test_serve import FAST, client

TIMING = {"queue_time_ms", "time_to_first_token_ms", "generation_time_ms", "mean_itl_ms", "e2e_latency_ms",
          "tokens_per_second"}


class Finishes:
    """The engine's Finished events, as its observers see them."""

    def __init__(self, engine):
        self.events: list[msg.Finished] = []
        self.lock = threading.Lock()
        engine.add_observer(self._seen)

    def _seen(self, kind, payload) -> None:
        if kind == "finished":
            with self.lock:
                self.events.append(payload[1])

    def next(self, before: int, timeout: float = 10.0) -> msg.Finished:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.events) > before:
                    assert len(self.events) == before + 1, "one request at a time"
                    return self.events[before]
            time.sleep(0.01)
        raise AssertionError("no Finished event")


def test_the_figures_are_the_records_in_milliseconds():
    m = msg.RequestMetrics(prompt_tokens=5, cached_tokens=0, output_tokens=11, queue_time=0.25, ttft=0.5,
                           itl_mean=0.02, itl_max=0.05, e2e=1.35)
    out = response_metrics(m)
    assert out == {"queue_time_ms": 250.0, "time_to_first_token_ms": 500.0, "generation_time_ms": 1100.0,
                   "mean_itl_ms": 20.0, "e2e_latency_ms": 1350.0, "tokens_per_second": 10.0}
    assert set(response_metrics(None)) == TIMING and not any(response_metrics(None).values())


def test_the_speculative_part_has_vllms_shape_from_scripted_rounds():
    s = SpecStats()
    for proposed, accepted in ((4, 4), (4, 0), (4, 2), (3, 3), (4, 2)):
        s.record(proposed, accepted, accepted + 1)
    out = speculative_decoding({"mode": "ngram", **s.as_dict()})
    assert out == {"mean_acceptance_length": 1 + 11 / 5, "draft_acceptance_rate": 11 / 19,
                   "acceptance_histogram": [1, 0, 2, 1, 1], "num_spec_steps": 5,
                   "num_accepted_draft_tokens": 11, "num_draft_tokens": 19, "num_spec_tokens": 4}
    assert speculative_decoding(None) is None and speculative_decoding({"mode": "off"}) is None


@pytest.fixture(scope="module")
def metrics_server(real_model_path):
    with in_process_server(real_model_path, FAST, max_active=8, per_request_metrics=True) as s:
        yield s


def test_a_whole_response_carries_its_records_metrics(metrics_server):
    engine, http = metrics_server
    seen = Finishes(engine)
    with client(http) as c:
        for call in (lambda: c.completions.create(model=served_names(engine)[0], prompt="hello there", max_tokens=12),
                     lambda: c.chat.completions.create(model=served_names(engine)[0], max_tokens=7,
                                                       messages=[{"role": "user", "content": "hi"}])):
            before = len(seen.events)
            r = call()
            record = seen.next(before)
            assert r.model_extra["metrics"] == response_metrics(record.metrics)
            assert set(r.model_extra["metrics"]) == TIMING     # no speculation, no speculative part
            assert r.usage.completion_tokens == record.metrics.output_tokens > 1
            assert r.model_extra["metrics"]["time_to_first_token_ms"] > 0


def test_a_stream_carries_them_on_its_final_usage_chunk(metrics_server):
    engine, http = metrics_server
    seen = Finishes(engine)
    with client(http) as c:
        before = len(seen.events)
        chunks = list(c.completions.create(model=served_names(engine)[0], prompt="hello there", max_tokens=9, stream=True,
                                           stream_options={"include_usage": True}))
        record = seen.next(before)
        assert chunks[-1].usage is not None and not chunks[-1].choices
        assert chunks[-1].model_extra["metrics"] == response_metrics(record.metrics)
        assert all("metrics" not in ch.model_extra for ch in chunks[:-1])
        # without a usage chunk, the chunk with the finish reason is the last and carries them
        before = len(seen.events)
        chunks = list(c.chat.completions.create(model=served_names(engine)[0], max_tokens=5, stream=True,
                                                messages=[{"role": "user", "content": "hi"}]))
        record = seen.next(before)
        assert chunks[-1].choices[0].finish_reason and chunks[-1].model_extra["metrics"] == \
            response_metrics(record.metrics)


def test_off_by_default(real_model_path):
    with in_process_server(real_model_path, FAST[:1]) as (_, http):
        body = httpx.post(http.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30).json()
        assert "metrics" not in body and body["usage"]["completion_tokens"] == 3


def test_a_speculating_request_adds_its_acceptance(tiny_model_path):
    with in_process_server(tiny_model_path("qwen2"), ["cpu"], max_context=256, per_request_metrics=True) as (engine, http):
        seen = Finishes(engine)
        with client(http) as c:
            r = c.completions.create(model=served_names(engine)[0], prompt="abc abc abc abc abc def abc abc", max_tokens=40,
                                     temperature=0, extra_body={"speculate": "ngram", "spec_k": 4,
                                                                "ignore_eos": True})
            record = seen.next(0)
        spec = r.model_extra["metrics"]["speculative_decoding"]
        assert spec == speculative_decoding(record.metrics.spec) and record.metrics.spec["mode"] == "ngram"
        hist = spec["acceptance_histogram"]
        assert spec["num_spec_steps"] == sum(hist) > 0 and spec["num_spec_tokens"] <= 4
        assert spec["num_accepted_draft_tokens"] == sum(i * n for i, n in enumerate(hist))
        assert spec["num_accepted_draft_tokens"] <= spec["num_draft_tokens"]


def test_openapi_documents_the_metrics_object():
    from engine.serve.openapi import openapi_schema
    body = openapi_schema(["m"])["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"][
        "application/json"]["schema"]
    props = body["properties"]["metrics"]["properties"]
    assert TIMING < set(props) and "acceptance_histogram" in props["speculative_decoding"]["properties"]
