"""The `metrics` object of a response (`--enable-per-request-metrics`), from the request's record.

Timing fields (milliseconds, from the worker's clock, as measured for the request record):
  queue_time_ms           arrival -> first scheduled
  time_to_first_token_ms  arrival -> first token
  generation_time_ms      first scheduled -> finished (prefill and decode, no queueing)
  mean_itl_ms             mean interval between output tokens
  e2e_latency_ms          arrival -> finished
  tokens_per_second       output tokens / generation time
A figure the worker did not measure (a request that never ran, a remote that does not say) is
null. A speculating request adds `speculative_decoding` in vLLM's shape (its per-request spec
decode metrics, summary level): mean_acceptance_length (1 + accepted / verify rounds),
draft_acceptance_rate, acceptance_histogram (verify rounds by accepted draft tokens),
num_spec_steps, num_accepted_draft_tokens, num_draft_tokens, num_spec_tokens (the longest draft).
"""
from __future__ import annotations

from engine.messages import RequestMetrics


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def response_metrics(m: RequestMetrics | None) -> dict:
    """The `metrics` object for a finished request's record (all null when it has none)."""
    if m is None:
        return {name: None for name in ("queue_time_ms", "time_to_first_token_ms", "generation_time_ms",
                                        "mean_itl_ms", "e2e_latency_ms", "tokens_per_second")}
    generation = None if m.queue_time is None else max(0.0, m.e2e - m.queue_time)
    out = {
        "queue_time_ms": _ms(m.queue_time),
        "time_to_first_token_ms": _ms(m.ttft),
        "generation_time_ms": _ms(generation),
        "mean_itl_ms": _ms(m.itl_mean),
        "e2e_latency_ms": _ms(m.e2e),
        "tokens_per_second": (round(m.output_tokens / generation, 3)
                              if generation and m.output_tokens else None),
    }
    spec = speculative_decoding(m.spec)
    if spec is not None:
        out["speculative_decoding"] = spec
    return out


def speculative_decoding(spec: dict | None) -> dict | None:
    """vLLM's per-request speculative decoding summary from the worker's SpecStats counters;
    None when the request did not speculate (or ran where no counters are kept)."""
    if not spec or spec.get("mode") in (None, "off") or "acceptance_histogram" not in spec:
        return None
    steps, accepted, drafted = spec["drafts"], spec["accepted_tokens"], spec["draft_tokens"]
    histogram = list(spec["acceptance_histogram"])
    return {
        "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": histogram,
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": max(len(histogram) - 1, 0),
    }
