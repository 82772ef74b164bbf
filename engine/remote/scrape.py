"""A remote server's own load, from its Prometheus /metrics: running, waiting, KV usage.

Every second while the worker is ready. The names are vLLM's, llama.cpp server's and
SGLang's; a server with several workers (tokentop) reports one series per worker: running and
waiting are summed, KV usage averaged.
"""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

SCRAPE_INTERVAL = 1.0

SCRAPE_NAMES = {
    "running": ("vllm:num_requests_running", "llamacpp:requests_processing", "sglang:num_running_reqs"),
    "waiting": ("vllm:num_requests_waiting", "llamacpp:requests_deferred", "sglang:num_queue_reqs"),
    "kv": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "llamacpp:kv_cache_usage_ratio",
           "sglang:token_usage"),
}


def load_from(text: str) -> dict[str, float | None]:
    """{"running", "waiting", "kv"} from a /metrics page; None where it names none of them."""
    values: dict[str, float] = {}
    series: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
            series[s.name] = series.get(s.name, 0) + 1
    out: dict[str, float | None] = {}
    for key, names in SCRAPE_NAMES.items():
        name = next((n for n in names if n in values), None)
        out[key] = None if name is None else values[name]
        if key == "kv" and name is not None:
            out[key] /= series[name]          # a mean over the server's own workers
    return out


async def scrape(client: httpx.AsyncClient) -> dict[str, float | None]:
    """The server's load now; all None when /metrics cannot be read."""
    try:
        r = await client.get("/metrics", timeout=3)
        if r.status_code == 200:
            return load_from(r.text)
    except (httpx.HTTPError, ValueError):
        pass
    return {key: None for key in SCRAPE_NAMES}
