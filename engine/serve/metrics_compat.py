"""What routers and gateways read on /metrics beyond the names metrics.py exports.

  vLLM production-stack's router   vllm:gpu_cache_usage_perc, vllm:gpu_prefix_cache_hit_rate
  monitors of older vLLMs          vllm:gpu_prefix_cache_queries_total / _hits_total
  Gateway API Inference Extension  vllm:cache_config_info{block_size, num_gpu_blocks}
  (llm-d's endpoint picker)        (and vllm:num_requests_waiting / _running, kv_cache_usage_perc)
  vLLM's KV residency histograms   vllm:kv_block_lifetime_seconds,
                                   vllm:kv_block_idle_before_evict_seconds,
                                   vllm:kv_block_reuse_gap_seconds

The legacy names carry the values of the current ones (prefix cache counts in tokens, as vLLM's
V1 counts them). The residency histograms are the workers' own bucket counts
(engine/kv/residency.py). All read from one engine snapshot per scrape.
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engine.kv.residency import RESIDENCY_BUCKETS

WORKER_LABELS = ("model_name", "worker", "engine")   # engine: the worker's index, as vLLM's engine core
# vllm:cache_config_info's labels: vLLM's CacheConfig fields this engine has a value for
CACHE_CONFIG_LABELS = ("block_size", "num_gpu_blocks", "num_cpu_blocks", "enable_prefix_caching", "cache_dtype")
RESIDENCY = (("lifetime", "vllm:kv_block_lifetime_seconds",
              "KV page lifetime, from allocation to its free or its eviction from the prefix cache."),
             ("idle_before_evict", "vllm:kv_block_idle_before_evict_seconds",
              "Time a cached KV page sat unused before eviction."),
             ("reuse_gap", "vllm:kv_block_reuse_gap_seconds",
              "Time between consecutive uses of a KV page (allocation or prefix-cache hit)."))


class RouterCompatCollector:
    def __init__(self, metrics):
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        snap = self.m.engine.snapshot()
        workers = [(w, [self.m.model, w.name, str(w.index)]) for w in snap.workers]
        return [*self._legacy(workers), self._cache_config(workers), *self._residency(workers)]

    @staticmethod
    def _legacy(workers) -> list:
        lab = list(WORKER_LABELS)
        usage = GaugeMetricFamily("vllm:gpu_cache_usage_perc", "KV cache usage (1 = full); "
                                  "vLLM's legacy name of kv_cache_usage_perc.", labels=lab)
        rate = GaugeMetricFamily("vllm:gpu_prefix_cache_hit_rate", "Prompt tokens found in the prefix "
                                 "cache over those looked up, recent (~30 s), else since start.", labels=lab)
        queries = CounterMetricFamily("vllm:gpu_prefix_cache_queries", "Prompt tokens looked up in the "
                                      "prefix cache; vLLM's legacy name of prefix_cache_queries.", labels=lab)
        hits = CounterMetricFamily("vllm:gpu_prefix_cache_hits", "Prompt tokens found in the prefix cache; "
                                   "vLLM's legacy name of prefix_cache_hits.", labels=lab)
        for w, values in workers:
            if w.pages_total:
                usage.add_metric(values, w.pages_used / w.pages_total)
            if w.prefix:
                q, h = w.prefix["prefix_cache_queries"], w.prefix["prefix_cache_hits"]
                queries.add_metric(values, q)
                hits.add_metric(values, h)
                rate.add_metric(values, w.hit_rate if w.hit_rate is not None else (h / q if q else 0.0))
        return [usage, rate, queries, hits]

    @staticmethod
    def _cache_config(workers) -> GaugeMetricFamily:
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig "
                                 "(value 1): each worker's KV page size and count.",
                                 labels=list(WORKER_LABELS + CACHE_CONFIG_LABELS))
        for w, values in workers:
            if w.pages_total:        # a local worker: a remote's pool is its own server's to say
                info.add_metric(values + [str(w.page_size), str(w.pages_total), "0", str(w.prefix_cache),
                                          w.kv_dtype], 1.0)
        return info

    @staticmethod
    def _residency(workers) -> list:
        fams = []
        for key, name, doc in RESIDENCY:
            fam = HistogramMetricFamily(name, doc, labels=list(WORKER_LABELS))
            for w, values in workers:
                if w.kv_residency:
                    counts, total = w.kv_residency[key]
                    fam.add_metric(values, buckets=cumulative(counts), sum_value=total)
            fams.append(fam)
        return fams


def cumulative(counts) -> list[tuple[str, float]]:
    """Per-bucket counts (the last past every bound) -> Prometheus's cumulative (le, count)."""
    out, running = [], 0
    for bound, n in zip(RESIDENCY_BUCKETS + (float("inf"),), counts):
        running += n
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
    return out
