"""Prometheus metrics for one Engine, built with prometheus_client (never by hand).

Where a metric means what vLLM's does, it has vLLM's name, so vllm-top, Grafana dashboards
and llmtop read tokentop unchanged; every series of a worker is labelled by it twice: `worker`
(its name, e.g. `cpu`, `sim:gpu0`, `remote:a`) and `engine` (its index, where vLLM puts its
engine core's). What vLLM has no name for is under `tokentop:`. What routers and gateways read
beyond that (legacy names, cache_config_info, KV residency) is in metrics_compat.py.

Counters and histograms are fed by the engine's observer hook (every finished request, every
routing decision: requests from the dashboard and bursts count too, not only HTTP ones);
gauges are read from one engine snapshot per scrape.

The engine reports each request's mean and max inter-token latency, not every interval, so
`vllm:inter_token_latency_seconds` observes the mean once per interval: its count and sum are
exact, its buckets are an approximation.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.serve.metrics_compat import WORKER_LABELS, RouterCompatCollector

# vLLM's buckets, so dashboards built for vLLM bin the same way
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
WORKER_STATES = ("starting", "loading", "ready", "degraded", "down", "dead", "stopped")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# per-worker gauges read from a WorkerView field of the same meaning: (name, help, field)
WORKER_GAUGES = (
    ("vllm:num_requests_running", "Requests running on the worker.", "running"),
    ("vllm:num_requests_waiting", "Requests waiting on the worker.", "waiting"),
    ("tokentop:prefill_tokens_per_second", "Measured prefill rate, recent.", "prefill_tps"),
    ("tokentop:decode_tokens_per_second", "Measured decode rate, recent.", "decode_tps"),
)


class EngineMetrics:
    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model = model_name
        self.registry = CollectorRegistry()
        r, lab = self.registry, list(WORKER_LABELS)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", lab, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens of finished requests.",
                                         lab, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions (recompute) of finished requests.",
                                   lab, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               lab + ["finished_reason"], registry=r)
        self.failures = Counter("tokentop:request_failures", "Requests that ended in an error.", lab, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", lab,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between generated tokens "
                             "(per-request mean observed once per interval).", lab, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", lab,
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.", lab,
                               buckets=REQUEST_BUCKETS, registry=r)
        self.routed = Counter("tokentop:routing_decisions", "Requests routed, by router policy and chosen worker.",
                              ["model_name", "policy", "worker"], registry=r)
        self.http_rejected = Counter("tokentop:http_rejected_requests", "HTTP requests refused before queueing.",
                                     ["model_name", "status"], registry=r)
        self.registry.register(_GaugeCollector(self))
        self.registry.register(RouterCompatCollector(self))
        self._names: dict[int, str] = {}
        engine.add_observer(self.observe)

    def worker_labels(self, index: int | None) -> tuple[str, str, str]:
        """model_name, worker, engine of a worker's series."""
        return self.model, self.worker_name(index), "" if index is None else str(index)

    def worker_name(self, index: int | None) -> str:
        if index is None:
            return "none"
        name = self._names.get(index)
        if name is None:
            cfg = self.engine.config.workers[index]
            name = self._names[index] = cfg.name or cfg.device
        return name

    def observe(self, kind: str, payload) -> None:
        if kind == "route":
            self.routed.labels(self.model, payload.policy, self.worker_name(payload.chosen)).inc()
            return
        if kind != "finished":
            return
        worker, f = payload
        labels = self.worker_labels(worker)
        m = f.metrics
        if m is not None:
            self.prompt_tokens.labels(*labels).inc(m.prompt_tokens)
            self.generation_tokens.labels(*labels).inc(m.output_tokens)
            self.preemptions.labels(*labels).inc(m.preemptions)
            if m.ttft is not None:
                self.ttft.labels(*labels).observe(m.ttft)
            if m.itl_mean is not None:
                h = self.itl.labels(*labels)
                for _ in range(max(0, m.output_tokens - 1)):
                    h.observe(m.itl_mean)
            if m.queue_time is not None:
                self.queue.labels(*labels).observe(m.queue_time)
            self.e2e.labels(*labels).observe(m.e2e)
        if f.reason == "error":
            self.failures.labels(*labels).inc()
        else:
            self.success.labels(*labels, f.reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _GaugeCollector:
    """Gauges from one snapshot per scrape: nothing to keep in sync."""

    def __init__(self, metrics: EngineMetrics):
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        snap = self.m.engine.snapshot()
        lab = list(WORKER_LABELS)
        gauges = {field: GaugeMetricFamily(name, doc, labels=lab) for name, doc, field in WORKER_GAUGES}
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", labels=lab)
        pages = GaugeMetricFamily("tokentop:kv_pages", "KV pages by use.", labels=lab + ["use"])
        state = GaugeMetricFamily("tokentop:worker_state", "1 for the worker's current state.",
                                  labels=lab + ["state"])
        info = GaugeMetricFamily("tokentop:worker_info", "Worker identity (value 1).",
                                 labels=lab + ["device", "simulated", "remote"])
        for w in snap.workers:
            values = [self.m.model, w.name, str(w.index)]
            for field, family in gauges.items():
                family.add_metric(values, getattr(w, field))
            if w.pages_total:
                kv.add_metric(values, w.pages_used / w.pages_total)
                pages.add_metric(values + ["used"], w.pages_used)
                pages.add_metric(values + ["free"], w.pages_total - w.pages_used)
            for s in WORKER_STATES:
                state.add_metric(values + [s], 1.0 if w.state == s else 0.0)
            info.add_metric(values + [w.device, str(w.simulated).lower(),
                                      str(w.device.startswith("remote:")).lower()], 1.0)
        prefix_q = CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                       labels=lab)
        prefix_h = CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                       labels=lab)
        for w in snap.workers:
            if w.prefix:
                prefix_q.add_metric([self.m.model, w.name, str(w.index)], w.prefix["prefix_cache_queries"])
                prefix_h.add_metric([self.m.model, w.name, str(w.index)], w.prefix["prefix_cache_hits"])
        alerts = CounterMetricFamily("tokentop:alerts", "Alert episodes (engine/facade/alerts.py) by kind "
                                     "(stall, kv-pressure, imbalance, worker-dead, remote-down) and worker.",
                                     labels=["model_name", "kind", "worker"])
        for (kind, worker), count in sorted(snap.alert_counts.items()):
            alerts.add_metric([self.m.model, kind, worker], count)
        spec = self._spec_families(snap, lab)
        outstanding = GaugeMetricFamily("tokentop:requests_outstanding",
                                        "Requests submitted and not finished, all workers.",
                                        labels=["model_name"])
        outstanding.add_metric([self.m.model], sum(r.state.live for r in snap.requests))
        return [*gauges.values(), kv, pages, state, info, outstanding, prefix_q, prefix_h, alerts, *spec]

    def _spec_families(self, snap, lab: list[str]) -> list:
        """Speculative decoding totals under vLLM's spec_decode_* names (engine/speculative/stats.py)."""
        names = (("drafts", "vllm:spec_decode_num_drafts", "Verify rounds with at least one draft token."),
                 ("draft_tokens", "vllm:spec_decode_num_draft_tokens", "Draft tokens verified."),
                 ("accepted_tokens", "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted."))
        fams = {key: CounterMetricFamily(name, doc, labels=lab) for key, name, doc in names}
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each position of a proposal.",
                                      labels=lab + ["position"])
        for w in snap.workers:
            if not w.spec:
                continue
            values = [self.m.model, w.name, str(w.index)]
            for key, fam in fams.items():
                fam.add_metric(values, w.spec[key])
            for i, count in enumerate(w.spec.get("accepted_per_position", [])):
                per_pos.add_metric(values + [str(i)], count)
        return [*fams.values(), per_pos]
