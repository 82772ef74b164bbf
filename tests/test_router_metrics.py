"""/metrics for every router and gateway: vLLM's legacy names, cache_config_info and the KV
residency histograms, checked against names and labels copied from those projects' source
(tests/fixtures/router_metrics.py), and the histograms against a scripted run of page events."""
from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.kv.pages import PagePool
from engine.kv.residency import RESIDENCY_BUCKETS
from engine.serve.app import served_names
from engine.serve.metrics_compat import RESIDENCY, cumulative
from tests.fixtures import router_metrics as F
from tests.serve_util import in_process_server
from tests.test_serve import FAST, client, wait_idle


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def at(self, t: float) -> "Clock":
        self.now = t
        return self


def scripted_pool() -> tuple[PagePool, dict[str, list[float]]]:
    """Two pages through allocation, caching, prefix hits, a free and an eviction; and what
    each histogram must have observed."""
    clock = Clock()
    pool = PagePool(2, 16, clock=clock)
    a, b = pool.allocate(), pool.allocate()       # both born at 0
    pool.keep(a)                                  # the prefix cache keys page a
    clock.at(1.0), pool.release(a)                # cached, idle from 1.0
    clock.at(3.0), pool.release(b)                # never keyed: freed, lived 3.0
    clock.at(3.5), pool.retain(a)                 # a hit: 3.5 since its allocation
    clock.at(4.0), pool.release(a)
    clock.at(4.5), pool.retain(a)                 # a hit: 1.0 since the last (a bucket's bound)
    clock.at(4.5), pool.release(a)                # idle from 4.5
    clock.at(5.0)
    assert pool.allocate() == b                   # the free page first
    clock.at(10.5)
    assert pool.allocate() == a                   # then the cached one is evicted: lived 10.5, idle 6.0
    return pool, {"lifetime": [3.0, 10.5], "idle_before_evict": [6.0], "reuse_gap": [3.5, 1.0]}


def reference_buckets(values: list[float]) -> list[tuple[str, float]]:
    """prometheus_client's own Histogram fed the same values: its (le, cumulative count)."""
    registry = CollectorRegistry()
    h = Histogram("h", "h", buckets=RESIDENCY_BUCKETS, registry=registry)
    for v in values:
        h.observe(v)
    fam = next(iter(text_string_to_metric_families(generate_latest(registry).decode())))
    return [(s.labels["le"], s.value) for s in fam.samples if s.name == "h_bucket"]


def test_residency_histograms_count_a_scripted_run_of_page_events():
    pool, want = scripted_pool()
    got = pool.residency.as_dict()
    for name, values in want.items():
        counts, total = got[name]
        assert cumulative(counts) == reference_buckets(values), name
        assert total == pytest.approx(sum(values)) and sum(counts) == len(values)


def test_the_buckets_are_vllms():
    assert RESIDENCY_BUCKETS == tuple(float(b) for b in F.VLLM_RESIDENCY_BUCKETS)


# --- a live server ----------------------------------------------------------------------
PROMPT = "The quick brown fox jumps over the lazy dog. " * 12


@pytest.fixture(scope="module")
def scraped(real_model_path):
    """One server after the same prompt twice (a prefix-cache hit) and a wait for idle: its
    /metrics families by name, and its engine's snapshot."""
    with in_process_server(real_model_path, FAST[:1], max_active=8) as (engine, http):   # one: the hit is sure
        with client(http) as c:
            for _ in range(2):
                c.completions.create(model=served_names(engine)[0], prompt=PROMPT, max_tokens=8)
        wait_idle(engine)
        wait_for_stats(engine)
        snap = engine.snapshot()
        text = httpx.get(http.url + "/metrics", timeout=10).text
        yield {f.name: f for f in text_string_to_metric_families(text)}, snap


def wait_for_stats(engine) -> None:
    """Until every worker has reported its residency counts and they stay put for half a second
    (stats come 5 times a second: the last report after the last page event has arrived)."""
    def counts():
        return [w.kv_residency for w in engine.snapshot().workers]
    deadline, last = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        now = counts()
        if all(now) and now == last:
            return
        last = now
        time.sleep(0.5)
    raise AssertionError("the workers' residency counts did not settle")


def family(fams: dict, name: str, kind: str):
    base = name[:-len("_total")] if name.endswith("_total") else name
    assert base in fams, f"{name} is not on /metrics"
    assert fams[base].type == kind, f"{name} is a {fams[base].type}, vLLM's is a {kind}"
    return fams[base]


def test_every_name_vllm_and_the_routers_read_is_there_with_vllms_labels(scraped):
    fams, snap = scraped
    for name, kind in {**F.VLLM, **F.VLLM_LEGACY}.items():
        fam = family(fams, name, kind)
        assert fam.samples, f"{name} has no series"
        for s in fam.samples:
            assert set(F.VLLM_LABELS) <= set(s.labels), (name, s.labels)
    for name in F.PRODUCTION_STACK + F.GATEWAY_INFERENCE:
        assert name in fams and fams[name].samples, name


def test_cache_config_info_says_each_workers_page_size_and_count(scraped):
    fams, snap = scraped
    series = {s.labels["worker"]: s for s in fams["vllm:cache_config_info"].samples}
    assert set(series) == {w.name for w in snap.workers}
    for w in snap.workers:
        labels = series[w.name].labels
        assert set(F.VLLM_CACHE_CONFIG_LABELS) <= set(labels) and series[w.name].value == 1
        # what the gateway's endpoint picker parses as integers
        assert [int(labels[k]) for k in F.GATEWAY_CACHE_INFO_LABELS] == [w.page_size, w.pages_total]
        assert labels["engine"] == str(w.index) and labels["enable_prefix_caching"] == str(w.prefix_cache)


def test_legacy_names_carry_the_current_values(scraped):
    fams, _ = scraped
    by = {name: {s.labels["worker"]: s.value for s in fams[name].samples if not s.name.endswith("_created")}
          for name in ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_prefix_cache_hits",
                       "vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_queries", "vllm:prefix_cache_queries")}
    assert by["vllm:gpu_cache_usage_perc"] == by["vllm:kv_cache_usage_perc"]
    assert by["vllm:gpu_prefix_cache_hits"] == by["vllm:prefix_cache_hits"]
    assert by["vllm:gpu_prefix_cache_queries"] == by["vllm:prefix_cache_queries"]
    assert sum(by["vllm:prefix_cache_hits"].values()) > 0      # the second request hit the first's pages


def test_residency_histograms_are_the_workers_counts(scraped):
    fams, snap = scraped
    for key, name, _ in RESIDENCY:
        fam = family(fams, name, "histogram")
        for w in snap.workers:
            counts, total = w.kv_residency[key]
            mine = [s for s in fam.samples if s.labels["worker"] == w.name]
            buckets = [(s.labels["le"], s.value) for s in mine if s.name == name + "_bucket"]
            assert [float(le) for le, _ in buckets[:-1]] == [float(b) for b in F.VLLM_RESIDENCY_BUCKETS]
            assert buckets == cumulative(counts)
            assert next(s.value for s in mine if s.name == name + "_sum") == pytest.approx(total)
    lived = sum(sum(w.kv_residency["lifetime"][0]) for w in snap.workers)
    reused = sum(sum(w.kv_residency["reuse_gap"][0]) for w in snap.workers)
    assert lived > 0 and reused > 0
