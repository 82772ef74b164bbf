"""The engine snapshot as JSON, for `GET /snapshot` and `tokentop status`: a versioned shape
(docs/snapshot.md). A change that removes or renames a field, or changes its meaning, raises
VERSION; adding a field does not.

It carries what a monitor needs (workers, requests' figures, latency percentiles, alerts), not
what was said: no prompt or generated text leaves the server this way.
"""
from __future__ import annotations

VERSION = 1


# WorkerView and RequestView fields carried under their own names: a new dashboard metric on a
# view reaches /snapshot by adding its name here
WORKER_FIELDS = ("index", "name", "device", "model", "dtype", "simulated", "remote_url", "state", "message",
                 "running", "waiting", "max_active", "prefill_tps", "decode_tps", "preemptions",
                 "recomputed_tokens", "steps", "policy", "cpu_percent", "rss_bytes", "prefix_cache", "roofline")
REQUEST_FIELDS = ("id", "worker", "leader", "prompt_tokens", "prompt_source", "cached_tokens", "output_tokens",
                  "max_tokens", "queue_time", "ttft", "itl_mean", "e2e", "age", "finish_reason", "error", "burst")


def by_name(view, names: tuple[str, ...]) -> dict:
    return {name: getattr(view, name) for name in names}


def worker_json(w) -> dict:
    usage = w.pages_used / w.pages_total if w.pages_total else w.kv_usage
    return {**by_name(w, WORKER_FIELDS),
            "profile": {"prefill_tps": w.profile_prefill_tps, "decode_tps": w.profile_decode_tps},
            "kv": {"pages_total": w.pages_total, "pages_used": w.pages_used, "page_size": w.page_size,
                   "usage": usage, "bytes": w.kv_bytes},
            "prefix_hit_rate": w.hit_rate}


def request_json(r) -> dict:
    return {**by_name(r, REQUEST_FIELDS), "state": str(r.state)}


def snapshot_json(snap) -> dict:
    return {
        "version": VERSION,
        "time": snap.time,
        "uptime": snap.uptime,
        "router_policy": snap.router_policy,
        "tracing": snap.tracing,
        "workers": [worker_json(w) for w in snap.workers],
        "requests": [request_json(r) for r in snap.requests],
        "latency": {name: view.to_json() for name, view in snap.latency.items()},
        "alerts": [a.to_json() for a in snap.alerts],
        "alert_counts": [{"kind": kind, "worker": worker, "count": count}
                         for (kind, worker), count in sorted(snap.alert_counts.items())],
    }
