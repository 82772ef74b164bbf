"""A/B compare: one burst under setting A, then under setting B, side by side (`tokentop compare`).

Each side gets a fresh engine (so fresh prefix caches), the same requests in the same order at
the same offsets from the burst's start, and the same seeds (a request without one gets the
same seed on both sides). Settings are the engine flags that change how a burst is served:

    policy=fcfs|spf                  scheduler policy           router-policy=POLICY
    prefix-cache=on|off              single-flight=off|after-prefill|at-completion
    speculate=off|ngram|suffix|draft spec-k=N|adaptive:...      spec-tv-budget=D
    max-active=N                     worker=N (every request to worker N: a forced baseline)

The report has TTFT, ITL and end-to-end latency (p50 / p95 / p99), aggregate output tok/s and
the completion time of the whole burst, each request's figures on both sides, speculation's
acceptance and accepted length (per request and per side: why a speculating side won or lost),
and, where both sides ran greedy requests on real (not simulated) workers, whether the outputs
were identical.

With `rounds` > 1 the two sides alternate, A B, B A, A B, ... (each run a fresh engine): a
machine whose speed drifts over minutes then weighs on both sides alike. Each side's summary
is then the median over its runs, B/A the median of the rounds' own ratios (each round's two
runs are neighbours in time), listed round by round; outputs are compared in every round.

Requests are given as objects with `id`, `prompt`, `messages` and `params` (app/bursts.py's
BurstItem), so the engine does not read burst files itself.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

from engine.config import (PREFIX_CACHE, ROUTER_POLICIES, SCHED_POLICIES, SETTING_NAMES, SINGLE_FLIGHT, SPEC_MODES,
                           EngineConfig, SamplingParams, check_router_policy)
from engine.errors import ConfigError, TokentopError
from engine.pacing import paced
from engine.stats import median, percentile

REQUEST_TIMEOUT_S = 1800.0
KERNEL_WAIT_S = 900.0     # a worker's first use builds its kernels in the background (a minute or two)
SEED_BASE = 1000          # the seed of the i-th request that names none: SEED_BASE + i, on both sides


class BurstRequest(Protocol):
    id: str
    prompt: str | None
    messages: list[dict] | None
    params: SamplingParams


def _choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def check(value: str) -> str:
        if value not in options:
            raise ValueError(f"one of {', '.join(options)}")
        return value
    return check


def _whole(value: str, least: int, what: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = least - 1
    if n < least:
        raise ValueError(what)
    return n


def _count(value: str) -> int:
    return _whole(value, 1, "a whole number of at least 1")


def _index(value: str) -> int:
    return _whole(value, 0, "a worker index (0 for the first `device`)")


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError("a number, e.g. 0.5") from None


# field -> (what it changes: a "worker" field or an "engine" field, parser); each is set by its
# command-line name (engine/config.py SETTING_NAMES), `worker` forces every request to one worker
COMPARED_FIELDS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "policy": ("worker", _choice(SCHED_POLICIES)),
    "router_policy": ("engine", _choice(ROUTER_POLICIES)),
    "prefix_cache": ("worker", _choice(PREFIX_CACHE)),
    "single_flight": ("worker", _choice(SINGLE_FLIGHT)),
    "speculate": ("worker", _choice(SPEC_MODES)),
    "spec_k": ("worker", str),
    "spec_tv_budget": ("worker", _number),
    "max_active": ("worker", _count),
}
# key -> (what it changes: "worker" field / "engine" field / "force", field name, parser)
SETTINGS: dict[str, tuple[str, str, Callable[[str], Any]]] = {
    **{SETTING_NAMES[name]: (kind, name, parse) for name, (kind, parse) in COMPARED_FIELDS.items()},
    "worker": ("force", "worker", _index),
}


def parse_settings(pairs: list[str], flag: str) -> dict[str, Any]:
    """["policy=spf", "max-active=4"] -> {"policy": "spf", "max-active": 4}; a bad one is one line."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ConfigError(f"{flag} {pair!r}: write KEY=VALUE, e.g. {flag} single-flight=off")
        if key not in SETTINGS:
            raise ConfigError(f"{flag} {pair!r}: no setting {key!r}; settings: {', '.join(SETTINGS)}")
        try:
            out[key] = SETTINGS[key][2](value)
        except ValueError as exc:
            raise ConfigError(f"{flag} {pair!r}: {key} takes {exc}") from None
    return out


def configure(config: EngineConfig, settings: dict[str, Any]) -> tuple[EngineConfig, int | None]:
    """The engine config for one side, and the worker every request is forced to (None: routed)."""
    workers, engine_fields, force = config.workers, {}, None
    for key, value in settings.items():
        kind, name, _ = SETTINGS[key]
        if kind == "worker":
            workers = tuple(replace(w, **{name: value}) for w in workers)
        elif kind == "engine":
            engine_fields[name] = value
        else:
            force = value
    if force is not None and force >= len(workers):
        raise ConfigError(f"worker={force}: there are {len(workers)} workers (0..{len(workers) - 1}, "
                          "in `device` order)")
    for w in workers:
        w.validate()
    config = replace(config, workers=workers, **engine_fields)
    check_router_policy(config.router_policy)
    return config, force


def label(settings: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in settings.items()) or "(the flags as given)"


@dataclass
class RequestOutcome:
    id: str
    worker: int | None
    finish_reason: str
    error: str | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft: float | None
    itl_mean: float | None
    e2e: float | None
    greedy: bool
    token_ids: list[int] = field(default_factory=list)
    speculate: str | None = None   # the mode it speculated with; None = it did not
    spec_rounds: int = 0           # verify rounds with at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return round(self.accepted_tokens / self.draft_tokens, 4) if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per verify round (vLLM's mean acceptance length)."""
        return round(1 + self.accepted_tokens / self.spec_rounds, 3) if self.spec_rounds else None

    def to_json(self) -> dict:
        return {**{k: v for k, v in self.__dict__.items() if k != "token_ids"},
                "acceptance_rate": self.acceptance_rate, "mean_accepted_length": self.mean_accepted_length}


def spec_fields(spec: dict | None) -> dict:
    """A request record's speculation counters as RequestOutcome's fields."""
    if not spec:
        return {}
    return {"speculate": spec.get("mode"), "spec_rounds": spec.get("drafts", 0),
            "draft_tokens": spec.get("draft_tokens", 0), "accepted_tokens": spec.get("accepted_tokens", 0)}


@dataclass
class SideResult:
    name: str
    settings: dict[str, Any]
    requests: list[RequestOutcome]
    completion_s: float
    workers: list[dict]

    def summary(self) -> dict:
        ok = [r for r in self.requests if r.finish_reason in ("stop", "length")]
        out: dict[str, Any] = {"requests": len(self.requests), "ok": len(ok),
                               "failed": sum(r.finish_reason == "error" for r in self.requests),
                               "completion_s": round(self.completion_s, 4),
                               "output_tokens": sum(r.output_tokens for r in self.requests),
                               "aggregate_tok_s": round(sum(r.output_tokens for r in self.requests)
                                                        / self.completion_s, 2) if self.completion_s else None}
        for metric in ("ttft", "itl_mean", "e2e"):
            values = [getattr(r, metric) for r in ok]
            for q in (50, 95, 99):
                v = percentile(values, q)
                out[f"{metric}_p{q}"] = round(v, 5) if v is not None else None
        per_worker: dict[str, int] = {}
        for r in self.requests:
            per_worker[str(r.worker)] = per_worker.get(str(r.worker), 0) + 1
        out["requests_per_worker"] = per_worker
        out.update(self.speculation())
        return out

    def speculation(self) -> dict:
        """The side's drafts: how many were accepted, how long an accepted run was."""
        rounds = sum(r.spec_rounds for r in self.requests)
        drafted = sum(r.draft_tokens for r in self.requests)
        accepted = sum(r.accepted_tokens for r in self.requests)
        return {"spec_rounds": rounds, "draft_tokens": drafted, "accepted_tokens": accepted,
                "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
                "mean_accepted_length": round(1 + accepted / rounds, 3) if rounds else None}


def seeded(items: list[BurstRequest]) -> list[SamplingParams]:
    """Each request's params with a seed: its own, or SEED_BASE + its index (both sides alike)."""
    return [item.params if item.params.seed is not None else replace(item.params, seed=SEED_BASE + i)
            for i, item in enumerate(items)]


def wait_for_kernels(engine, say: Callable[[str], None], limit_s: float = KERNEL_WAIT_S, poll_s: float = 0.5) -> None:
    """Measure no side on the torch fallback: a worker on its first use serves on torch matmuls
    (~4x slower decode) until its kernels are built, which would load one side only."""
    deadline, said = time.monotonic() + limit_s, False
    while building := [w.index for w in engine.snapshot().workers if w.state == "ready" and w.kernels_building]:
        if not said:
            say(f"waiting for worker(s) {', '.join(map(str, building))} to build their kernels (first use)")
            said = True
        if time.monotonic() > deadline:
            raise TokentopError(f"worker(s) {', '.join(map(str, building))} still on the torch fallback after "
                                f"{limit_s:.0f} s of building kernels: the comparison would not be fair")
        time.sleep(poll_s)


def run_side(name: str, config: EngineConfig, settings: dict[str, Any], items: list[BurstRequest], *,
             interval_s: float = 0.0, warm: list[BurstRequest] = (), timeout: float = REQUEST_TIMEOUT_S,
             progress: Callable[[str], None] | None = None) -> SideResult:
    """Start a fresh engine with `settings`, warm each worker with `warm` (not measured), fire
    the burst at `interval_s`, wait for every request, shut the engine down."""
    from engine.facade.engine import Engine

    side_config, force = configure(config, settings)
    say = progress or (lambda text: None)
    say(f"{name}: starting the engine ({label(settings)})")
    engine = Engine(side_config).start()
    try:
        snap = engine.snapshot()
        ready = [w.index for w in snap.workers if w.state == "ready"]
        if force is not None and force not in ready:
            raise TokentopError(f"worker={force}: that worker did not start")
        wait_for_kernels(engine, say)
        for item in warm:                       # every worker's prefix cache gets the warm-up
            for w in ready:
                engine.submit(item.prompt, messages=item.messages, params=item.params, worker=w,
                              burst=f"{name} warm-up").result(timeout)
        params = seeded(items)
        say(f"{name}: {len(items)} requests" + (f", one every {interval_s * 1000:.0f} ms" if interval_s else ""))
        handles = []
        for i in paced(len(items), interval_s):
            item = items[i]
            handles.append((time.monotonic(), engine.submit(item.prompt, messages=item.messages, params=params[i],
                                                            worker=force, burst=f"compare {name}")))
        outcomes, ends = [], []
        for (submitted, handle), item, p in zip(handles, items, params):
            r = handle.result(timeout)
            m = r.metrics
            ends.append(submitted + (m.e2e if m else 0.0))
            outcomes.append(RequestOutcome(
                id=item.id, worker=r.worker, finish_reason=r.finish_reason, error=r.error,
                prompt_tokens=len(r.prompt_token_ids), cached_tokens=m.cached_tokens if m else 0,
                output_tokens=len(r.token_ids), ttft=m.ttft if m else None, itl_mean=m.itl_mean if m else None,
                e2e=m.e2e if m else None, greedy=p.temperature == 0.0, token_ids=list(r.token_ids),
                **spec_fields(m.spec if m else None)))
        completion = max(ends) - handles[0][0] if handles else 0.0
        workers = [{"index": w.index, "name": w.name, "device": w.device, "simulated": w.simulated,
                    "state": w.state} for w in engine.snapshot().workers]
    finally:
        engine.shutdown()
    return SideResult(name, settings, outcomes, completion, workers)


def compare_outputs(a: SideResult, b: SideResult) -> dict:
    """Whether greedy outputs matched, where the question means something."""
    if any(w["simulated"] for w in a.workers + b.workers):
        return {"compared": False, "why": "simulated workers produce placeholder text"}
    pairs = [(x, y) for x, y in zip(a.requests, b.requests) if x.greedy and y.greedy
             and x.finish_reason != "error" and y.finish_reason != "error"]
    if not pairs:
        return {"compared": False, "why": "no request was greedy (temperature 0) on both sides"}
    differing = [x.id for x, y in pairs if x.token_ids != y.token_ids]
    return {"compared": True, "greedy_requests": len(pairs), "identical": not differing, "differing": differing}


def compare(config: EngineConfig, items: list[BurstRequest], a: dict[str, Any], b: dict[str, Any], *,
            burst: str = "", interval_s: float = 0.0, warm: list[BurstRequest] = (),
            timeout: float = REQUEST_TIMEOUT_S, progress: Callable[[str], None] | None = None,
            rounds: int = 1) -> dict:
    """Run the burst under A, then under B (`rounds` times, alternating); the report (plain JSON)."""
    if not items:
        raise ConfigError("the burst has no requests")
    if rounds < 1:
        raise ConfigError(f"the number of rounds must be at least 1, got {rounds}")
    configure(config, a)                       # both sides' settings checked before either runs
    configure(config, b)
    runs: dict[str, list[SideResult]] = {"A": [], "B": []}
    settings = {"A": a, "B": b}
    order = alternation(rounds)
    for r, pair in enumerate(order):
        for name in pair:
            say = progress if rounds == 1 or progress is None else \
                (lambda text, r=r: progress(f"round {r + 1} of {rounds}, {text}"))
            runs[name].append(run_side(name, config, settings[name], items, interval_s=interval_s, warm=warm,
                                       timeout=timeout, progress=say))
    per_round = [(ra.summary(), rb.summary()) for ra, rb in zip(runs["A"], runs["B"])]
    ratios_by_round = [side_ratios(sa, sb) for sa, sb in per_round]
    first_a, first_b = runs["A"][0], runs["B"][0]
    report = {
        "burst": burst, "requests": len(items), "interval_ms": round(interval_s * 1000),
        "warm_up_requests": len(warm), "workers": first_a.workers,
        "a": {"settings": a, "label": label(a), "summary": median_summary([sa for sa, _ in per_round]),
              "requests": [r.to_json() for r in first_a.requests]},
        "b": {"settings": b, "label": label(b), "summary": median_summary([sb for _, sb in per_round]),
              "requests": [r.to_json() for r in first_b.requests]},
        "b_over_a": {key: round(median([r[key] for r in ratios_by_round if key in r]), 4)
                     for key in ratios_by_round[0]},
        "outputs": outputs_over_rounds([compare_outputs(ra, rb) for ra, rb in zip(runs["A"], runs["B"])]),
    }
    if rounds > 1:
        report["rounds"] = {"count": rounds, "order": ["".join(pair) for pair in order],
                            "b_over_a_runs": {key: [r.get(key) for r in ratios_by_round] for key in ROUND_METRICS},
                            "note": "each side's summary: the median over its runs; b_over_a: the median "
                                    "of the rounds' own B/A"}
    return report


ROUND_METRICS = ("aggregate_tok_s", "completion_s", "ttft_p50", "itl_mean_p50", "e2e_p50")


def alternation(rounds: int) -> list[tuple[str, str]]:
    """A B, B A, A B, ...: each side runs first in half the rounds."""
    return [("A", "B") if r % 2 == 0 else ("B", "A") for r in range(rounds)]


def side_ratios(sa: dict, sb: dict) -> dict[str, float]:
    """B/A of every numeric figure both sides have (not the request count)."""
    out = {}
    for key, value in sa.items():
        other = sb.get(key)
        if isinstance(value, (int, float)) and isinstance(other, (int, float)) and value and key != "requests":
            out[key] = round(other / value, 4)
    return out


def median_summary(summaries: list[dict]) -> dict:
    """Per numeric figure, its median over a side's runs (over the runs that have it: a run
    that drafted nothing has no acceptance); anything else from the first run."""
    if len(summaries) == 1:
        return summaries[0]
    out = dict(summaries[0])
    for key in summaries[0]:
        values = [v for v in (s.get(key) for s in summaries) if v is not None]
        if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            m = median(values)   # counts stay whole numbers where their median is one
            out[key] = int(m) if all(isinstance(v, int) for v in values) and m == int(m) else round(m, 5)
    return out


def outputs_over_rounds(results: list[dict]) -> dict:
    """compare_outputs of every round as one verdict: identical only if every round was."""
    if len(results) == 1 or not results[0]["compared"]:
        return results[0]
    differing = sorted({i for r in results for i in r["differing"]})
    return {"compared": True, "greedy_requests": results[0]["greedy_requests"], "identical": not differing,
            "differing": differing, "rounds": len(results)}


# --- the side-by-side text -------------------------------------------------------------------
def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms" if v < 10 else f"{v:.1f} s"


def _cell(r: dict) -> str:
    cell = f"w{r['worker']} {_ms(r['ttft'])} {_ms(r['e2e'])} {r['output_tokens']} tok {r['finish_reason']}"
    if r.get("acceptance_rate") is not None:
        cell += f" acc {r['acceptance_rate']:.0%} x{r['mean_accepted_length']:.1f}"
    return cell


def _speculation_line(name: str, summary: dict) -> str:
    """Why a speculating side gained or lost: how much of what it drafted the target kept."""
    if not summary.get("draft_tokens"):
        return f"{name}: no drafts"
    return (f"{name}: {summary['acceptance_rate']:.0%} of {summary['draft_tokens']} drafted tokens accepted, "
            f"{summary['mean_accepted_length']:.2f} tokens per verify round")


def format_report(report: dict) -> str:
    a, b = report["a"], report["b"]
    sa, sb = a["summary"], b["summary"]
    cells = [_cell(r) for r in a["requests"] + b["requests"]]
    width = max([24, len(a["label"]) + 5, len(b["label"]) + 5] + [len(c) + 2 for c in cells])
    lines = [f"{report['burst'] or 'burst'}: {report['requests']} requests"
             + (f", one every {report['interval_ms']} ms" if report["interval_ms"] else ", all at once")
             + (f", after {report['warm_up_requests']} warm-up request(s) per worker" if report["warm_up_requests"] else ""),
             "workers: " + ", ".join(f"{w['index']} {w['name']}" + (" (simulated)" if w["simulated"] else "")
                                     for w in report["workers"]),
             ""]
    rounds = report.get("rounds")
    if rounds:
        lines += [f"{rounds['count']} rounds, alternated ({' '.join(rounds['order'])}), a fresh engine each run: "
                  "each side's figures are its runs' medians, B/A the median of the rounds' own B/A", ""]
    lines.append(f"{'':18}{'A: ' + a['label']:<{width}}{'B: ' + b['label']:<{width}}B/A")

    def row(title: str, key: str, fmt: Callable[[Any], str]) -> None:
        ratio = report["b_over_a"].get(key)
        lines.append(f"{title:18}{fmt(sa.get(key)):<{width}}{fmt(sb.get(key)):<{width}}"
                     + (f"{ratio:.3f}" if ratio is not None else "-"))

    for metric, title in (("ttft", "TTFT"), ("itl_mean", "ITL"), ("e2e", "end-to-end")):
        for q in (50, 95, 99):
            row(f"{title} p{q}", f"{metric}_p{q}", _ms)
    row("aggregate tok/s", "aggregate_tok_s", lambda v: "-" if v is None else f"{v:.1f}")
    row("completion", "completion_s", _ms)
    row("requests ok", "ok", lambda v: f"{v} of {report['requests']}")
    if sa.get("draft_tokens") or sb.get("draft_tokens"):
        row("acceptance", "acceptance_rate", lambda v: "-" if v is None else f"{v:.0%}")
        row("accepted length", "mean_accepted_length", lambda v: "-" if v is None else f"{v:.2f}")
        lines += ["", "speculation: " + _speculation_line("A", sa) + "; " + _speculation_line("B", sb)]
    if rounds:
        lines.append("")
        for key, title in (("aggregate_tok_s", "aggregate tok/s"), ("itl_mean_p50", "ITL p50")):
            runs = " ".join("-" if v is None else f"{v:.3f}" for v in rounds["b_over_a_runs"][key])
            lines.append(f"{title} B/A by round: {runs}")
    title = "request (round 1)" if rounds else "request"
    lines += ["", f"{title:18}{'A: worker TTFT e2e out end':<{width}}{'B: worker TTFT e2e out end':<{width}}"]
    for ra, rb in zip(a["requests"], b["requests"]):
        lines.append(f"{ra['id'][:17]:18}{_cell(ra):<{width}}{_cell(rb):<{width}}".rstrip())
    outputs = report["outputs"]
    if outputs["compared"]:
        lines.append("")
        every = " in every round" if outputs.get("rounds") else ""
        lines.append(f"outputs: identical on all {outputs['greedy_requests']} greedy requests{every}" if outputs["identical"]
                     else f"outputs: {len(outputs['differing'])} of {outputs['greedy_requests']} greedy requests differ: "
                          + ", ".join(outputs["differing"][:8]))
    else:
        lines += ["", f"outputs: not compared ({outputs['why']})"]
    return "\n".join(lines)


def write_report(report: dict, path: str | os.PathLike | None) -> str:
    """The JSON report at `path`, or compare-YYYYmmdd-HHMMSS.json here; its absolute path."""
    if path is None:
        path = time.strftime("compare-%Y%m%d-%H%M%S.json")
    path = os.path.abspath(os.fspath(path))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return path
