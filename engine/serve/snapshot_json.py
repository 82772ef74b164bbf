"""The engine snapshot as JSON, for `GET /snapshot` and `tokentop status`: a versioned shape
(docs/snapshot.md). A change that removes or renames a field, or changes its meaning, raises
VERSION; adding a field does not.

It carries what a monitor needs (workers, requests' figures, latency percentiles, alerts), not
what was said: no prompt or generated text leaves the server this way.
"""
from __future__ import annotations

VERSION = 1


def worker_json(w) -> dict:
    usage = w.pages_used / w.pages_total if w.pages_total else w.kv_usage
    return {"index": w.index, "name": w.name, "device": w.device, "model": w.model, "dtype": w.dtype,
            "simulated": w.simulated, "remote_url": w.remote_url, "state": w.state, "message": w.message,
            "running": w.running, "waiting": w.waiting, "max_active": w.max_active,
            "prefill_tps": w.prefill_tps, "decode_tps": w.decode_tps,
            "profile": {"prefill_tps": w.profile_prefill_tps, "decode_tps": w.profile_decode_tps},
            "kv": {"pages_total": w.pages_total, "pages_used": w.pages_used, "page_size": w.page_size,
                   "usage": usage, "bytes": w.kv_bytes},
            "preemptions": w.preemptions, "recomputed_tokens": w.recomputed_tokens, "steps": w.steps,
            "policy": w.policy, "cpu_percent": w.cpu_percent, "rss_bytes": w.rss_bytes,
            "prefix_cache": w.prefix_cache, "prefix_hit_rate": w.hit_rate, "roofline": w.roofline}


def request_json(r) -> dict:
    return {"id": r.id, "worker": r.worker, "state": str(r.state), "leader": r.leader,
            "prompt_tokens": r.prompt_tokens, "prompt_source": r.prompt_source,
            "cached_tokens": r.cached_tokens, "output_tokens": r.output_tokens, "max_tokens": r.max_tokens,
            "queue_time": r.queue_time, "ttft": r.ttft, "itl_mean": r.itl_mean, "e2e": r.e2e, "age": r.age,
            "finish_reason": r.finish_reason, "error": r.error, "burst": r.burst}


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
