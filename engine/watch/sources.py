"""One look at one server: what it is and its numbers now, from the endpoints it has.

Kinds, told apart by the metric names on /metrics (each project's own, read from its source):
  tokentop   tokentop:worker_info beside vLLM's names (engine/serve/metrics.py); tok/s from its
             tokentop:decode_tokens_per_second (its vllm:generation_tokens rises per finished request).
             Then its GET /snapshot (docs/snapshot.md): each worker's state, percentiles from the
             engine's own records and its alerts. Where /snapshot is missing (an older server),
             refused (an --api-key server, no key given) or of another version, /metrics alone.
  vllm       vllm:num_requests_running / _waiting, vllm:kv_cache_usage_perc (older:
             gpu_cache_usage_perc), vllm:generation_tokens_total, histograms
             vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds (older:
             time_per_output_token_seconds)
  sglang     sglang:num_running_reqs / num_queue_reqs, sglang:token_usage,
             sglang:generation_tokens_total, sglang:gen_throughput, histograms
             sglang:time_to_first_token_seconds, sglang:inter_token_latency_seconds
             (python/sglang/srt/metrics/collector.py)
  llamacpp   llamacpp:requests_processing / requests_deferred, llamacpp:kv_cache_usage_ratio,
             llamacpp:tokens_predicted_total, llamacpp:predicted_tokens_seconds (server.cpp),
             its GET /v1/models (the model: /metrics has no label naming it), and its GET
             /slots (is_processing per slot, next_token.n_decoded). Its counter
             rises only when a request ends, so tokens generated = the counter plus the tokens
             the busy slots decoded so far: a rate while requests run, and no stall alert for
             one long request.
  vllm-router  its GET /workers (url, is_healthy, load per worker) on the serving port (whose
             /metrics passes a worker's through), and vllm_router_* names on its Prometheus port
             (which can be watched as a URL too)
Every number is None when the server does not say it.

A look has one deadline (TIMEOUT, `watch --timeout`) for all its requests, bodies included,
and every answer is capped (engine/watch/fetch.py); /metrics at MAX_SERIES series. A server
that breaks a limit is down for that look, with the reason.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.outside import OutsideDataError, visible
from engine.watch.fetch import MAX_SNAPSHOT_BODY, Deadline, get, one_line

TIMEOUT = 3.0                 # s: one look at one server, every request and body included
MAX_SERIES = 20_000           # samples on one /metrics page (vLLM serving one model has ~1,000)
_SAMPLE_LINE = re.compile(r"^[ \t]*[^#\s]", re.MULTILINE)

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing",
           "vllm_router_running_requests")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred")
KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
      "llamacpp:kv_cache_usage_ratio")
GENERATED = ("vllm:generation_tokens_total", "sglang:generation_tokens_total", "llamacpp:tokens_predicted_total")
TPS_GAUGE = ("tokentop:decode_tokens_per_second", "sglang:gen_throughput", "llamacpp:predicted_tokens_seconds")
TTFT = ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds")
ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
       "sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds")
ROUTER_REQUESTS = "vllm_router_requests_total"
SNAPSHOT_VERSION = 1          # the /snapshot shape read here (engine/serve/snapshot_json.py)
SNAPSHOT_WINDOWS = ("60s", "session")   # a metric's percentiles from the first with a request in it
SNAPSHOT_METRICS = ("ttft", "itl", "e2e")
MAX_LISTED = 1024             # workers or alerts of one server, more than any real one has


@dataclass
class Sample:
    url: str
    at: float                                  # time.monotonic()
    up: bool
    kind: str = "?"
    error: str = ""
    model: str | None = None
    running: float | None = None
    waiting: float | None = None
    kv: float | None = None                    # 0..1, mean over the server's own series
    generated: float | None = None             # tokens generated since the server started
    tps_gauge: float | None = None             # the server's own tok/s figure, where it has one
    ttft: list[tuple[float, float]] = field(default_factory=list)   # cumulative (le, count)
    itl: list[tuple[float, float]] = field(default_factory=list)
    requests: float | None = None              # a router: requests it has routed
    workers: list[dict] = field(default_factory=list)   # a router's: {"url", "healthy", "load"}
    slots: tuple[int, int] | None = None       # llama.cpp: (busy, total)
    # a tokentop server's /snapshot, where it was read (source "snapshot"):
    source: str = "metrics"
    note: str = ""                             # why /snapshot was not read, when it was asked
    engine_workers: list[dict] = field(default_factory=list)   # its workers, as engine_worker() has them
    percentiles: dict[str, dict] = field(default_factory=dict)  # metric -> p50/p95/p99, count, window
    engine_alerts: list[str] = field(default_factory=list)


def kind_of(names: set[str]) -> str:
    if "tokentop:worker_info" in names:
        return "tokentop"
    for prefix, kind in (("vllm_router_", "vllm-router"), ("sglang:", "sglang"), ("llamacpp:", "llamacpp"),
                         ("vllm:", "vllm")):
        if any(n.startswith(prefix) for n in names):
            return kind
    return "?"


def from_metrics(url: str, text: str, at: float | None = None) -> Sample:
    """A sample from a Prometheus text page alone; OutsideDataError past MAX_SERIES samples
    (counted before parsing: the parser holds a whole family in memory)."""
    if len(_SAMPLE_LINE.findall(text)) > MAX_SERIES:
        raise OutsideDataError(f"{visible(url)}/metrics has more than {MAX_SERIES:,} series; not read")
    values: dict[str, float] = {}
    series: dict[str, int] = {}
    buckets: dict[str, dict[float, float]] = {}
    model = None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
            series[s.name] = series.get(s.name, 0) + 1
            model = model or s.labels.get("model_name")
            if s.name.endswith("_bucket") and "le" in s.labels:
                le = float(s.labels["le"])
                hist = buckets.setdefault(s.name[: -len("_bucket")], {})
                hist[le] = hist.get(le, 0.0) + s.value      # summed over workers and labels
    names = {n[:-6] if n.endswith("_total") else n for n in values} | set(values)
    out = Sample(url=url, at=time.monotonic() if at is None else at, up=True, kind=kind_of(names), model=model)
    out.running = _first(values, RUNNING)
    out.waiting = _first(values, WAITING)
    kv_name = next((n for n in KV if n in values), None)
    if kv_name is not None:
        out.kv = values[kv_name] / series[kv_name]
    # tokentop counts a request's tokens when it finishes: its per-worker decode rate is the live figure
    out.generated = None if out.kind == "tokentop" else _first(values, GENERATED)
    out.tps_gauge = _first(values, TPS_GAUGE)
    out.ttft = _histogram(buckets, TTFT)
    out.itl = _histogram(buckets, ITL)
    out.requests = _first(values, (ROUTER_REQUESTS,))
    return out


def _first(values: dict[str, float], names: tuple[str, ...]) -> float | None:
    return next((values[n] for n in names if n in values), None)


def _histogram(buckets: dict[str, dict[float, float]], names: tuple[str, ...]) -> list[tuple[float, float]]:
    for n in names:
        if n in buckets:
            return sorted(buckets[n].items())
    return []


def engine_worker(w: dict) -> dict:
    """What the watch shows of one worker of a tokentop /snapshot."""
    return {"name": w["name"], "state": w["state"], "message": w["message"], "running": w["running"],
            "waiting": w["waiting"], "max_active": w["max_active"], "decode_tps": w["decode_tps"],
            "kv": w["kv"]["usage"]}


def apply_snapshot(sample: Sample, snap: dict) -> None:
    """Take a tokentop /snapshot's figures into `sample`: its load and KV from the workers it
    lists, percentiles from the engine's records (nearest rank), its alerts. A snapshot of
    another shape raises KeyError, TypeError or ValueError and changes nothing."""
    if not isinstance(snap, dict) or snap.get("version") != SNAPSHOT_VERSION:
        raise ValueError(f"version {snap.get('version') if isinstance(snap, dict) else None!r}")
    if len(snap["workers"]) > MAX_LISTED or len(snap["alerts"]) > MAX_LISTED:
        raise ValueError(f"more than {MAX_LISTED} workers or alerts")
    workers = [engine_worker(w) for w in snap["workers"]]
    percentiles = {}
    for metric in SNAPSHOT_METRICS:
        for window in SNAPSHOT_WINDOWS:
            summary = snap["latency"][window]["overall"].get(metric)
            if summary and summary["count"]:
                percentiles[metric] = {"p50": summary["p50"], "p95": summary["p95"], "p99": summary["p99"],
                                       "count": summary["count"], "window": window}
                break
    alerts = [f"{a['kind']}: {a['message']}" for a in snap["alerts"]]
    kv = [w["kv"] for w in workers if w["kv"] is not None]
    running, waiting = float(sum(w["running"] for w in workers)), float(sum(w["waiting"] for w in workers))
    tps = float(sum(w["decode_tps"] or 0.0 for w in workers))
    sample.running, sample.waiting, sample.kv, sample.tps_gauge = running, waiting, \
        (sum(kv) / len(kv) if kv else None), tps
    sample.engine_workers, sample.percentiles, sample.engine_alerts = workers, percentiles, alerts
    sample.source = "snapshot"


def _read_snapshot(client: httpx.Client, url: str, sample: Sample, api_key: str | None,
                   deadline: Deadline) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = get(client, url + "/snapshot", deadline, headers=headers, max_bytes=MAX_SNAPSHOT_BODY)
    if r.status == 404:                  # a tokentop from before /snapshot: /metrics says it all
        return
    if r.status == 401:
        sample.note = ("/snapshot wants the server's API key (`api_key`)" if not api_key
                       else "/snapshot refused the API key given") + ": figures from /metrics"
        return
    if r.status != 200:
        sample.note = f"/snapshot answers {r.status}: figures from /metrics"
        return
    snap = r.json()                      # too big or too deep: the server is down, with the reason
    try:
        apply_snapshot(sample, snap)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        sample.note = f"/snapshot not read ({type(exc).__name__}: {one_line(str(exc))}): figures from /metrics"


def look(client: httpx.Client, url: str, api_key: str | None = None, timeout: float = TIMEOUT) -> Sample:
    """Scrape `url` once, within `timeout` seconds in all: /metrics, and /health, /workers,
    /slots or /snapshot as its kind has them. api_key: sent to a tokentop server's /snapshot.
    No answer in time, or one past a limit, is a down sample with the reason."""
    now = time.monotonic()
    try:
        return _look(client, url, api_key, Deadline(timeout), now)
    except (OutsideDataError, ValueError) as exc:       # FetchError is an OutsideDataError
        return Sample(url, now, up=False, error=one_line(str(exc) or type(exc).__name__))


def _look(client: httpx.Client, url: str, api_key: str | None, deadline: Deadline, now: float) -> Sample:
    workers = _router_workers(client, url, deadline)
    if workers is not None:   # a router: its /metrics here would be a worker's, passed through
        sample = Sample(url, now, up=True, kind="vllm-router", workers=workers)
    else:
        r = get(client, url + "/metrics", deadline)
        if r.status != 200:
            return Sample(url, now, up=False, error=f"/metrics answers {r.status}")
        sample = from_metrics(url, r.text(), now)
        if sample.kind == "tokentop":
            _read_snapshot(client, url, sample, api_key, deadline)
    health = get(client, url + "/health", deadline)
    if health.status == 404:             # no /health (a router's Prometheus port): /metrics answered
        pass
    elif health.status != 200 and sample.kind != "vllm-router":
        sample.up, sample.error = False, f"/health answers {health.status}"
    elif health.status != 200:           # a router says 503 while any of its workers is down
        sample.error = health.excerpt()
    if sample.kind == "llamacpp":
        sample.model = sample.model or _served_model(client, url, deadline)
        slots = _slots(client, url, deadline)
        if slots is not None:
            sample.slots, decoding = slots
            if sample.generated is not None:
                sample.generated += decoding
    return sample


def _router_workers(client: httpx.Client, url: str, deadline: Deadline) -> list[dict] | None:
    r = get(client, url + "/workers", deadline)
    if r.status != 200 or not r.body.lstrip().startswith(b"{"):
        return None                      # e.g. a Prometheus port answers every path with metrics
    body = r.json()
    if not isinstance(body, dict) or not isinstance(body.get("workers"), list):
        return None
    if len(body["workers"]) > MAX_LISTED:
        raise OutsideDataError(f"{visible(url)}/workers lists more than {MAX_LISTED} workers; not read")
    return [{"url": w.get("url"), "healthy": bool(w.get("is_healthy")), "load": w.get("load")}
            for w in body["workers"] if isinstance(w, dict)]


def _slots(client: httpx.Client, url: str, deadline: Deadline) -> tuple[tuple[int, int], int] | None:
    """llama.cpp's /slots: ((busy, total), tokens its busy slots decoded so far)."""
    r = get(client, url + "/slots", deadline)
    if r.status != 200:
        return None
    slots = r.json()
    if not isinstance(slots, list):
        return None
    busy = [s for s in slots if isinstance(s, dict) and s.get("is_processing")]
    return (len(busy), len(slots)), sum(_decoded(s) for s in busy)


def _served_model(client: httpx.Client, url: str, deadline: Deadline) -> str | None:
    """The model an OpenAI-compatible server names first on /v1/models; a file path (llama.cpp's
    default alias) by its file name."""
    r = get(client, url + "/v1/models", deadline)
    if r.status != 200:
        return None
    try:
        name = r.json()["data"][0]["id"]
    except (OutsideDataError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(name, str):
        return None
    return name.rsplit("/", 1)[-1] if name.startswith("/") else name


def _decoded(slot: dict) -> int:
    nxt = slot.get("next_token")
    if isinstance(nxt, list):            # one entry per sequence; a lone dict is read too
        nxt = nxt[0] if nxt else None
    n = nxt.get("n_decoded") if isinstance(nxt, dict) else None
    return n if isinstance(n, int) and n > 0 else 0
