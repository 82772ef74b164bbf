"""The whole command line: `tokentop` (the dashboard, app/main.py), `tokentop generate`,
`tokentop bench SCENARIO`, `tokentop serve`, `tokentop watch`, `tokentop models`, `tokentop status`
(app/status.py), and the engine flags they share.

The engine (engine/) is a library with no command line of its own: this module turns flags
into its settings (EngineConfig, SamplingParams, ServeConfig). Every user error is one line on
stderr and exit code 2. Heavy modules (torch, the engine's model code) are imported inside the
command that needs them, so `tokentop --help` and a flag error answer at once.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from dataclasses import replace

from engine.config import (CUDA_GRAPHS, KV_DTYPES, KV_MODES, PREFIX_CACHE, ROUTER_POLICIES, SCHED_POLICIES,
                           SINGLE_FLIGHT, SPEC_MODES, EngineConfig, SamplingParams)
from engine.bench import SCENARIOS
from engine.facade.devices import parse_devices
from engine.config import parse_size
from app.flags import as_flags, describe_error, worker_from_flags
from app.printing import err, json_text, out, stream_text
from engine.errors import ConfigError, TokentopError
from engine.trace import DETAILS, check_trace_dir

EXIT_USAGE = 2
MAX_PROMPT_FILE_BYTES = 8 * 2**20   # ~8 million characters: far beyond any model's context
LATENCY_WINDOW_NAMES = ("10s", "60s", "session")   # engine/facade/latency.py WINDOWS, as /snapshot names them
COMMANDS = ("generate", "bench", "models", "serve", "replay", "compare", "watch", "web", "status")   # else: the dashboard's


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is a single line (and exit code 2), not a usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"tokentop: error: {message} (see `{self.prog} --help`)\n")


def _executable(path: str) -> str:
    """A flag naming a program to run: checked when read, not after tokentop's half of a bench."""
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise argparse.ArgumentTypeError(f"{path!r} is not an executable file: give the path to the program")
    return path


def _writable_file(path: str) -> str:
    """--out: its folder must exist and take a new file, checked before a bench of minutes."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {path!r}: its folder does not exist or is not writable")
    return path


def _positive(kind: type, what: str):
    """An argparse type: a positive, finite number of `kind`; else a one-line error saying `what`."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = kind(0)
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


_positive_int = _positive(int, "a positive whole number; e.g. 3")
_positive_minutes = _positive(float, "a positive number of minutes; e.g. 2 or 0.5")


def _timeout_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds from 0 to 3600; e.g. 5 or 0.5")
    return value


def _sizes(text: str) -> str:
    """bench batching's N,N,...: positive counts, checked when read (not after a first bench)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: write positive request counts separated by commas, e.g. 1,2,4,8")
    return text


def _bind_address(text: str) -> str:
    """--serve [HOST:]PORT: checked when read, so a bad one names the flag."""
    from engine.serve.server import parse_bind

    try:
        parse_bind(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _duration(text: str) -> float:
    """--trace-window: '120s', '5m', '1h' or plain seconds; more than 0."""
    units = {"s": 1, "m": 60, "h": 3600}
    s = text.strip().lower()
    scale = units.get(s[-1:], 1) if s else 1
    try:
        value = float(s[:-1] if s[-1:] in units else s) * scale
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration; write e.g. 120s, 5m or 1h")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _http_url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r}: write the server's URL, e.g. http://127.0.0.1:8000")
    return text.rstrip("/")


def _names(text: str) -> str:
    if not [n for n in text.split(",") if n.strip()]:
        raise argparse.ArgumentTypeError("name at least one model, e.g. qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    return text


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="qwen2.5-coder-0.5b",
                   help="catalog name (see `tokentop models`), a .gguf path, or owner/repo/file.gguf")
    g.add_argument("--device", action="append", default=None, metavar="DEV",
                   help="repeatable: cpu, cuda, cuda:N, sim:NAME[:prefill=R,decode=R], "
                        "remote:URL[,name=N,api_key=ENV_VAR,read_timeout=S,ca=PATH] (default: cpu)")
    g.add_argument("--threads", type=int, default=0,
                   help="CPU threads per worker (0 = all cores, split among several CPU workers)")
    g.add_argument("--max-active", type=int, default=8, help="max running requests per worker")
    g.add_argument("--max-batched-tokens", type=int, default=512, help="token budget per step")
    g.add_argument("--max-context", type=int, default=None,
                   help="max prompt + output tokens per request (default: the model's, at most 4096)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--kv-cache-memory", default="256MiB", help="KV memory per worker, e.g. 256MiB")
    g.add_argument("--kv-cache", choices=KV_MODES, default="paged")
    g.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto",
                   help="dtype K and V are stored in (auto: the measured-faithful choice per device)")
    g.add_argument("--policy", choices=SCHED_POLICIES, default="fcfs", help="scheduler policy")
    g.add_argument("--router-policy", choices=ROUTER_POLICIES, default="cost")
    g.add_argument("--prefix-cache", choices=PREFIX_CACHE, default="on",
                   help="reuse KV pages of identical prompt prefixes (paged KV only)")
    g.add_argument("--single-flight", choices=SINGLE_FLIGHT,
                   default="after-prefill",
                   help="a request whose prefix pages another request is computing waits for them")
    g.add_argument("--deterministic", action="store_true",
                   help="batch-invariant greedy output (fixed kernels and prefill chunks)")
    g.add_argument("--activation-dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto")
    g.add_argument("--cuda-graphs", choices=CUDA_GRAPHS, default=None,
                   help="CUDA workers replay decode steps of up to 32 sequences as captured CUDA graphs "
                        "(default: on; CPU workers ignore it)")
    g.add_argument("--worker-mode", choices=["process", "thread"], default=None,
                   help="run each worker in its own process (default for several workers) or a thread")
    g.add_argument("--recalibrate", action="store_true",
                   help="measure each worker's prefill/decode speed again (else cached after first use)")
    add_spec_flags(g)
    add_trace_flags(g)
    g.add_argument("--routing-log", default=None, help="append every routing decision as JSON lines")


def add_spec_flags(g) -> None:
    """Speculative decoding's flags (engine/speculative/)."""
    g.add_argument("--speculate", choices=SPEC_MODES, default=None,
                   help="speculative decoding of requests (default: draft with --draft-model, else off)")
    g.add_argument("--draft-model", default="", metavar="NAME|PATH",
                   help="draft model for --speculate draft, e.g. qwen2.5-coder-0.5b for the 1.5B")
    g.add_argument("--spec-k", default="adaptive:cost", metavar="N|POLICY",
                   help="draft length: N, adaptive:cost (default), adaptive:acceptance, adaptive:length")
    g.add_argument("--spec-tv-budget", type=float, default=0.0, metavar="D",
                   help="mentored decoding: accept drafts within total-variation budget D (0 = lossless)")
    g.add_argument("--no-spec-bonus", action="store_true",
                   help="no bonus token after a fully accepted draft (mini-vllm-rs's setting)")
    g.add_argument("--ngram-min", type=int, default=1, help="prompt lookup: shortest n-gram matched")
    g.add_argument("--ngram-max", type=int, default=4, help="prompt lookup: longest n-gram matched")


def add_trace_flags(g) -> None:
    """The flight recorder's flags (engine/trace.py, engine/facade/recorder.py)."""
    g.add_argument("--trace-dir", default=None,
                   help="write Perfetto (Chrome JSON) traces here (default ./traces); implies --trace-detail full")
    g.add_argument("--trace-detail", choices=DETAILS, default=None,
                   help="what the flight recorder keeps: light (steps, counters, routing, request "
                        "lifecycles; the default), full (+ per-layer scopes, NVTX on GPUs), off")
    g.add_argument("--trace-window", type=_duration, default="120s", metavar="SECONDS",
                   help="the flight recorder keeps the last this long, e.g. 120s, 5m (default 120s)")
    g.add_argument("--trace-memory", type=_size, default="64MiB", metavar="SIZE",
                   help="... or at most this much memory per worker and for the facade (default 64MiB)")
    g.add_argument("--trace-keep", type=_positive_int, default=20, metavar="N",
                   help="trace files kept in the trace folder; writing one more deletes the oldest (default 20)")
    g.add_argument("--trace-keep-mib", type=_positive_int, default=512, metavar="MIB",
                   help="... and at most this many MiB of them (default 512)")


def engine_config_from(args: argparse.Namespace, default_mode: str = "process") -> EngineConfig:
    base = worker_from_flags(args)
    workers = parse_devices(args.device or ["cpu"], base)
    if args.trace_dir:
        check_trace_dir(args.trace_dir)
    return EngineConfig(workers=workers, router_policy=args.router_policy, trace_dir=args.trace_dir,
                        routing_log=args.routing_log, worker_mode=args.worker_mode or default_mode,
                        trace_detail=args.trace_detail or "", trace_window_s=args.trace_window,
                        trace_memory=args.trace_memory, trace_keep=args.trace_keep,
                        trace_keep_mib=args.trace_keep_mib)


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="tokentop", description="htop for an LLM inference engine")
    sub = p.add_subparsers(dest="command", parser_class=OneLineParser)
    for add in (_add_generate, _add_bench, _add_serve, _add_replay, _add_compare, _add_watch, _add_web, _add_models,
                _add_status):
        add(sub)
    return p


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    g.add_argument("prompt", nargs="?", help="the prompt text")
    g.add_argument("--prompt-file", help="read the prompt from this file ('-' = stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_engine_flags(g)


def _add_bench(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks (JSON out)", formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="scenarios:\n" + "\n".join(f"  {name:<12} {s.summary}" for name, s in SCENARIOS.items()))
    b.add_argument("scenario", choices=list(SCENARIOS), help="which benchmark (listed above)")
    b.add_argument("--models", default="qwen2.5-coder-0.5b", type=_names, help="comma-separated (bench single, rows)")
    b.add_argument("--runs", type=_positive_int, default=3)
    b.add_argument("--quick", action="store_true", help="fewer/shorter runs (smoke test)")
    b.add_argument("--minutes", type=_positive_minutes, default=2.0, metavar="N",
                   help="bench soak: how long the mixed load runs (fractions allowed, e.g. 0.5)")
    b.add_argument("--out", default=None, type=_writable_file, help="also write the JSON report here")
    b.add_argument("--policies", default="forced-fastest,round-robin,least-loaded,cost",
                   help="bench routing: which policies to compare")
    b.add_argument("--sizes", default=None, metavar="N,N,...", type=_sizes,
                   help="bench batching: concurrent request counts (1 and 8 always included); "
                        "bench router: worker counts (default 8,64,256); bench rows: row counts (default 1-16)")
    b.add_argument("--queued", type=_positive_int, default=1000,
                   help="bench router: requests queued on the workers while it decides")
    b.add_argument("--no-sequential", action="store_true",
                   help="bench batching: skip the one-after-another comparison")
    b.add_argument("--llama-cpp", default=None, metavar="PYTHON", type=_executable,
                   help="bench single: a python with llama-cpp-python, to measure llama.cpp side by side")
    b.add_argument("--llama-server", default=None, metavar="PATH", type=_executable,
                   help="bench batching: a llama-server binary; runs it on the same GGUF with -np 8 and "
                        "compares it with tokentop's HTTP server through one client at N=1 and N=8")
    add_engine_flags(b)


def _add_serve(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP API (with /metrics), headless")
    add_serve_flags(s)
    add_record_flag(s)
    s.add_argument("--access-log", action="store_true",
                   help="print one line per HTTP request (method, path, status) on stderr")
    s.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish vLLM-format KV cache events over ZMQ, e.g. tcp://*:5557 "
                        "(for KV-aware routers; needs tokentop[kv-events])")
    add_engine_flags(s)


def _add_replay(sub) -> None:
    r = sub.add_parser("replay", help="play a --record recording in the dashboard (read-only), or make it a trace")
    r.add_argument("file", help="a recording written by tokentop --record FILE or tokentop serve --record FILE")
    r.add_argument("--trace", default=None, metavar="OUT.json",
                   help="write the recording as a Perfetto trace instead of playing it")
    r.add_argument("--partial", action="store_true",
                   help="play a recording that was cut short (its complete frames)")
    r.add_argument("--speed", type=float, default=1.0, choices=(0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0),
                   help="playback speed to start at (+ and - change it)")


def _add_compare(sub) -> None:
    c = sub.add_parser("compare", help="one burst under settings A, then B, side by side (fresh engines, "
                                       "same requests, arrival times and seeds)")
    c.add_argument("burst", help="a burst file (JSONL, see sample_prompts/README.md)")
    c.add_argument("--a", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="side A's settings: policy, router-policy, prefix-cache, single-flight, speculate, "
                        "spec-k, spec-tv-budget, max-active, worker (every request to worker N)")
    c.add_argument("--b", nargs="+", action="extend", default=[], metavar="KEY=VALUE", help="side B's settings")
    c.add_argument("--interval-ms", type=int, default=0, help="between submissions (default 0: all at once)")
    c.add_argument("--warm", default=None, metavar="FILE",
                   help="a burst file sent to every worker before the measured burst (not measured), "
                        "to seed the prefix caches")
    c.add_argument("--out", default=None, type=_writable_file,
                   help="the JSON report (default ./compare-YYYYmmdd-HHMMSS.json)")
    c.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    c.add_argument("--rounds", type=_positive_int, default=1, metavar="N",
                   help="run the sides N times, alternating (A B, B A, ...): medians, and B/A round by round, "
                        "for a machine whose speed drifts (default 1)")
    add_burst_limit_flag(c)
    add_engine_flags(c)


def _add_watch(sub) -> None:
    w = sub.add_parser("watch", help="the dashboard over running servers: tokentop serve, vLLM, SGLang, "
                                     "llama.cpp's server, vllm-router")
    w.add_argument("urls", nargs="+", metavar="URL", type=_http_url, help="a server's base URL, e.g. http://10.0.0.2:8000")
    w.add_argument("--interval", type=float, default=1.0, help="seconds between looks (default 1)")
    w.add_argument("--once", action="store_true", help="print one snapshot and exit (1 if a server is down)")
    w.add_argument("--json", action="store_true", help="with --once: the snapshot as JSON")
    w.add_argument("--timeout", type=_timeout_seconds, default=3.0, metavar="SECONDS",
                   help="seconds one look at a server may take, every request and body included; "
                        "past it the server shows as down (default 3)")
    w.add_argument("--api-key", default=os.environ.get("TOKENTOP_WATCH_API_KEY"),
                   help="for tokentop servers started with --api-key: read their /snapshot (workers, "
                        "the engine's percentiles and alerts); without it they are read from /metrics "
                        "(default: $TOKENTOP_WATCH_API_KEY)")


def _add_web(sub) -> None:
    web = sub.add_parser("web", help="tokentop watch in a browser (textual-serve: one process per tab)")
    web.add_argument("urls", nargs="*", metavar="URL", type=_http_url, default=["http://127.0.0.1:8000"],
                     help="the servers to watch (default http://127.0.0.1:8000: a local tokentop serve "
                          "or a dashboard started with --serve 8000)")
    web.add_argument("--host", default="127.0.0.1", help="address the page listens on (default: loopback only)")
    web.add_argument("--port", type=int, default=8080, help="the page's port (default 8080)")
    web.add_argument("--api-key", default=None,
                     help="the key the page asks for (open /?key=KEY once); required beyond loopback")
    web.add_argument("--server-api-key", default=os.environ.get("TOKENTOP_WATCH_API_KEY"),
                     help="the watched tokentop servers' --api-key (default: $TOKENTOP_WATCH_API_KEY)")
    web.add_argument("--interval", type=float, default=1.0, help="seconds between looks (default 1)")
    web.add_argument("--max-tabs", type=int, default=8, help="browser tabs open at once, each a process (default 8)")


def _add_models(sub) -> None:
    m = sub.add_parser("models", help="list bundled models and whether they are installed")
    m.add_argument("--json", action="store_true")


def _add_status(sub) -> None:
    st = sub.add_parser("status", help="a running server's workers, latency and alerts, once (GET /snapshot)")
    st.add_argument("url", nargs="?", default="http://127.0.0.1:8000",
                    help="the server's address (default http://127.0.0.1:8000)")
    st.add_argument("--json", action="store_true", help="print the snapshot's JSON as the server sent it")
    st.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    st.add_argument("--window", choices=LATENCY_WINDOW_NAMES, default="60s", help="latency window shown")
    st.add_argument("--timeout", type=_timeout_seconds, default=5.0, metavar="SECONDS",
                    help="seconds the whole answer may take, body included (default 5)")


def build_dashboard_parser() -> OneLineParser:
    p = OneLineParser(prog="tokentop", description="htop for an LLM inference engine: the dashboard. "
                      "Subcommands generate, bench, serve and models run without it.")
    add_engine_flags(p)
    p.add_argument("--burst-file", metavar="FILE", default=None,
                   help="fire this burst file (JSONL, see sample_prompts/README.md) once the "
                        "workers have started: each line once, with its own sampling settings")
    p.add_argument("--serve", default=None, metavar="[HOST:]PORT", type=_bind_address,
                   help="also serve the OpenAI-compatible API here; its requests show in the panels")
    add_burst_limit_flag(p)
    add_serve_flags(p)
    add_record_flag(p)
    return p


def add_burst_limit_flag(p) -> None:
    from app.bursts import MAX_BURST_REQUESTS
    p.add_argument("--max-burst-requests", type=_positive_int, default=MAX_BURST_REQUESTS, metavar="N",
                   help=f"the most requests a burst file may hold (default {MAX_BURST_REQUESTS:,}): "
                        "each is queued at once")


def add_record_flag(p) -> None:
    p.add_argument("--record", default=None, metavar="FILE",
                   help="write what the dashboard shows (5 snapshots a second, as deltas, gzip) to FILE; "
                        "play it with tokentop replay FILE")


def with_worker(args):
    """`tokentop bench`'s arguments with the engine flags made into `args.worker`, the
    WorkerConfig the scenarios start from: the engine takes fields, not flags."""
    args.worker = worker_from_flags(args)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        return cmd_dashboard(build_dashboard_parser().parse_args(argv))
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench":
            from app.bench import app_scenarios
            from engine.bench import run_bench
            return run_bench(with_worker(args), app_scenarios())
        if args.command == "models":
            return cmd_models(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "replay":
            return cmd_replay(args)
        if args.command == "compare":
            return cmd_compare(args)
        if args.command == "watch":
            if args.json and not args.once:
                raise ConfigError("--json prints one snapshot: add --once")
            if args.interval <= 0:
                raise ConfigError(f"--interval must be a positive number of seconds, got {args.interval:g}")
            if args.api_key is not None and not args.api_key.strip():
                raise ConfigError("--api-key is empty: give the key the servers were started with, or leave it out")
            from app.watch import run_watch
            return run_watch(args.urls, args.interval, args.once, args.json, args.api_key, args.timeout)
        if args.command == "web":
            if args.interval <= 0:
                raise ConfigError(f"--interval must be a positive number of seconds, got {args.interval:g}")
            from app.web import run_web
            return run_web(args.urls, args.host, args.port, args.interval, args.api_key,
                           args.server_api_key, args.max_tabs)
        if args.command == "status":
            from app.status import cmd_status
            return cmd_status(args)
        build_parser().print_help()
        return EXIT_USAGE
    except TokentopError as exc:
        err(f"tokentop: error: {describe_error(exc)}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - unexpected: one line; TOKENTOP_DEBUG=1 shows where
        if os.environ.get("TOKENTOP_DEBUG"):
            raise
        err(f"tokentop: error: {describe_error(exc)} (run with TOKENTOP_DEBUG=1 for the traceback)")
        return 1


def read_prompt(args) -> str:
    from app.bursts import read_text_file

    if args.prompt is not None and args.prompt_file:
        raise TokentopError("give the prompt as an argument or --prompt-file, not both")
    if args.prompt_file:
        try:
            if args.prompt_file == "-":
                return _read_stdin(MAX_PROMPT_FILE_BYTES)
            return read_text_file(args.prompt_file, MAX_PROMPT_FILE_BYTES)
        except (OSError, ValueError) as exc:
            raise TokentopError(f"cannot read --prompt-file {args.prompt_file}: {exc}") from None
    if args.prompt is None:
        raise TokentopError('no prompt: write tokentop generate "your prompt" or use --prompt-file')
    return args.prompt


def _read_stdin(limit: int) -> str:
    """stdin up to `limit` bytes (characters where it has no byte stream), as --prompt-file -."""
    stream = getattr(sys.stdin, "buffer", None)
    data = stream.read(limit + 1) if stream is not None else sys.stdin.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"it is larger than {limit / 2**20:g} MiB, the most tokentop reads as a prompt")
    return data.decode("utf-8") if isinstance(data, bytes) else data


def cmd_generate(args) -> int:
    from engine.facade.engine import Engine
    from engine.models.catalog import tty_progress

    prompt = read_prompt(args)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
        stop=tuple(args.stop), ignore_eos=args.ignore_eos).validate()
    if not prompt.strip():
        raise TokentopError("the prompt is empty; type some text")
    config = engine_config_from(args, default_mode="thread")
    if len(config.workers) > 1:
        config = replace(config, worker_mode=args.worker_mode or "process")
    bars = {}

    def progress(name, done, total):
        bars.setdefault(name, tty_progress(f"assembling {name}"))(done, total)

    engine = Engine(config, progress=progress)
    try:
        engine.start()
        print_startup_warnings(engine)
        kw = {"messages": [{"role": "user", "content": prompt}]} if args.chat else {"prompt": prompt}
        handle = engine.submit(params=params, **kw)
        if handle.notice:
            err(f"tokentop: note: {as_flags(handle.notice)}")
        if not args.json:
            for delta in handle:
                sys.stdout.write(stream_text(delta.text))
                sys.stdout.flush()
            sys.stdout.write("\n")
        result = handle.result()
        if result.finish_reason == "error":
            raise TokentopError(result.error or "generation failed")
        if args.json:
            print(json_text(result_json(engine, result, args.model)))
        if args.trace_dir:
            path = engine.export_trace(args.trace_dir)
            print(f"trace written to {path}", file=sys.stderr)
    finally:
        engine.shutdown()
    return 0


def print_startup_warnings(engine) -> None:
    """What the engine's start-up warned of, on stderr (the dashboard shows its log instead)."""
    for line in engine.snapshot().log:
        if line.level == "warning":
            err(f"tokentop: warning: {as_flags(line.text)}")


def result_json(engine, result, model: str) -> dict:
    m = result.metrics
    prefill_time = m.ttft if m and m.ttft else None
    decode_time = (m.e2e - m.ttft) if m and m.ttft is not None else None
    n_out = len(result.token_ids)
    return {
        "model": model,
        "prompt_token_ids": result.prompt_token_ids,
        "token_ids": result.token_ids,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "prefill_tokens_per_s": (m.prompt_tokens - m.cached_tokens) / prefill_time if prefill_time else None,
        "decode_tokens_per_s": (n_out - 1) / decode_time if decode_time and n_out > 1 else None,
        "metrics": m.__dict__ if m else None,
        "worker": result.worker,
    }


def cmd_models(args) -> int:
    from engine.models.catalog import list_models

    models = list_models()
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    for m in models:
        flag = "assembled" if m.get("assembled") else "installed" if m.get("installed") else "not installed"
        print(f"{m['name']:22} {m.get('arch', ''):8} {m.get('size', 0) / 1e6:8.0f} MB  {flag}")
    print("\n".join(_what_runs()))
    from engine import kernels  # imports torch: only here, not for every command
    from engine.cpuinfo import cpu_summary
    from engine.models import huge_pages
    print(f"{kernels.describe()}; CPU: {cpu_summary()}")
    print("model weights: the file mapping, " + ("in 2 MiB pages of the page cache where the filesystem "
          "allows (TOKENTOP_WEIGHTS=4k: 4 KiB pages)" if huge_pages.offered() else "in 4 KiB pages"))
    return 0


def _what_runs() -> list[str]:
    """Which architectures and GGUF types a --model file may use, and how each was checked."""
    from engine.models.gguf import DENSE_FALLBACK_TYPES, KERNEL_TYPES, SUPPORTED_ARCHS

    def names(types) -> str:
        return " ".join(t.name for t in types)
    return [
        f"any .gguf of: {', '.join(SUPPORTED_ARCHS)} (llama covers Llama 2/3.x, Mistral, SmolLM; "
        f"phi3 without LongRoPE)",
        f"types: F32 F16 BF16; in place on the GGUF kernels {names(KERNEL_TYPES)}; as a dense copy "
        f"made at load (bf16 or fp32, 2-4 bytes a weight) {names(DENSE_FALLBACK_TYPES)}; others refused",
        "checked: every architecture and type, greedy ids and top-5 logits against llama.cpp on tiny "
        "random files (tests/test_llama_cpp_refs.py); the bundled models against transformers "
        "(tests/test_fidelity.py)",
    ]


# --- serve -------------------------------------------------------------------------------
# the server flags' defaults (also: which flags were given; the dashboard uses them with --serve only)
SERVER_FLAG_DEFAULTS = {"--port": 8000, "--host": "127.0.0.1", "--api-key": None, "--max-queue": 256,
                        "--max-body": "4MiB", "--allowed-host": None, "--enable-per-request-metrics": False}


def add_serve_flags(p) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default=SERVER_FLAG_DEFAULTS["--host"],
                   help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=int, default=SERVER_FLAG_DEFAULTS["--port"])
    g.add_argument("--api-key", default=SERVER_FLAG_DEFAULTS["--api-key"],
                   help="require Authorization: Bearer KEY on /v1/*, /tokenize and /snapshot")
    g.add_argument("--max-queue", type=int, default=SERVER_FLAG_DEFAULTS["--max-queue"],
                   help="answer 429 when this many requests wait beyond what the workers can run")
    g.add_argument("--max-body", default=SERVER_FLAG_DEFAULTS["--max-body"], help="largest request body accepted")
    g.add_argument("--allowed-host", action="append", default=SERVER_FLAG_DEFAULTS["--allowed-host"],
                   metavar="NAME", help="on loopback, also answer requests whose Host header is NAME "
                                        "(repeatable; localhost and the bound address always are)")
    g.add_argument("--enable-per-request-metrics", action="store_true",
                   help="add a `metrics` object (TTFT, queue, generation time, ITL, tokens/s, speculative "
                        "acceptance) to each response, on the final usage chunk when streaming")


def check_dashboard_server_flags(args) -> None:
    """The dashboard serves the API only with --serve: a server flag without it would do
    nothing, and --port beside it would be ignored (--serve names the port)."""
    given = [flag for flag, default in SERVER_FLAG_DEFAULTS.items()
             if getattr(args, flag[2:].replace("-", "_")) != default]
    if args.serve is None and given:
        raise ConfigError(f"{given[0]} applies to the API server, which the dashboard runs with --serve "
                          f"only; add e.g. --serve {args.port}")
    if args.serve is not None and "--port" in given:
        raise ConfigError(f"--serve names the port ([HOST:]PORT); drop --port {args.port} "
                          f"or write --serve {args.port}")


def serve_config_from(args, host: str | None = None, port: int | None = None):
    """The server flags (of `serve` or the dashboard's --serve) as a ServeConfig; host and port
    as --serve [HOST:]PORT gave them, if it did."""
    from engine.serve.app import ServeConfig

    if args.max_queue < 0:
        raise ConfigError("--max-queue must be >= 0")
    if port is None and not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: the port must be 0..65535 (0 picks a free one), e.g. --port 8000")
    return ServeConfig(host=args.host if host is None else host, port=args.port if port is None else port,
                       api_key=args.api_key, max_queue=args.max_queue, max_body=parse_size(args.max_body),
                       allowed_hosts=tuple(args.allowed_host or ()),
                       per_request_metrics=args.enable_per_request_metrics).check()


def start_recording(engine, path: str | None):
    """--record FILE: the snapshot stream, from now until close(); None without the flag."""
    if not path:
        return None
    from engine.facade.snapshot_file import SnapshotRecorder
    try:
        return SnapshotRecorder(engine, path, command=["tokentop", *sys.argv[1:]]).start()
    except ConfigError as exc:
        raise ConfigError(f"--record {path}: {exc}") from None


def cmd_compare(args) -> int:
    from app.bursts import load_burst
    from engine.facade.compare import compare, format_report, parse_settings, write_report

    a, b = parse_settings(args.a, "--a"), parse_settings(args.b, "--b")
    if args.interval_ms < 0:
        raise ConfigError(f"--interval-ms must be >= 0, got {args.interval_ms}")
    items = load_burst(args.burst, args.max_burst_requests)
    warm = load_burst(args.warm, args.max_burst_requests) if args.warm else []
    config = engine_config_from(args, default_mode="process")
    if len(config.workers) == 1:
        config = replace(config, worker_mode=args.worker_mode or "thread")
    report = compare(config, items, a, b, burst=args.burst, interval_s=args.interval_ms / 1000, warm=warm,
                     progress=lambda text: err(f"tokentop: {text}"), rounds=args.rounds)
    path = write_report(report, args.out)
    if args.json:
        print(json_text(report, indent=2))
    else:
        out(format_report(report))     # the burst file's ids are outside text
    print(f"tokentop: report written to {path}", file=sys.stderr)
    return 0


def cmd_replay(args) -> int:
    from engine.facade.recording_read import read_recording
    from engine.facade.snapshot_file import RecordingError

    try:
        recording = read_recording(args.file, partial=args.partial)
    except RecordingError as exc:
        if exc.cut_short:   # what the engine calls a partial replay is this flag
            raise RecordingError(f"{exc}: add --partial to play them") from None
        raise
    if args.trace:
        from engine.facade.snapshot_trace import write_recording_trace
        try:
            path = write_recording_trace(recording, args.trace)
        except OSError as exc:
            raise TokentopError(f"--trace {args.trace}: cannot write it ({exc.strerror or exc})") from None
        print(f"trace of {len(recording)} frames ({recording.duration:.1f} s) written to {path}", file=sys.stderr)
        return 0
    from app.replay import ReplayApp
    ReplayApp(recording, speed=args.speed).run()
    return 0


def write_trace(engine, refuse_busy: bool = False) -> None:
    """Headless `t`: the flight recorder's trace, and where it went (or why not), on stderr.
    refuse_busy (SIGUSR1): a signal while one is being written, or right after, writes none."""
    try:
        path = engine.export_trace(refuse_busy=refuse_busy)
    except TokentopError as exc:
        err(f"tokentop: error: {describe_error(exc)}")
        return
    engine.log("info", f"trace written to {path}")
    print(f"tokentop: trace written to {path}", file=sys.stderr, flush=True)


def cmd_serve(args) -> int:
    from engine.facade.engine import Engine
    from engine.serve.server import HttpServer

    serve_config = serve_config_from(args)                  # bad server flags fail before any work
    config = engine_config_from(args, default_mode="process")
    engine = Engine(config)
    kv_events = None
    if args.kv_events:                                      # binds (or connects) before any work
        from engine.serve.kv_events import KvEventPublisher
        try:
            kv_events = KvEventPublisher(engine, args.kv_events)
        except ConfigError as exc:
            raise ConfigError(f"--kv-events: {exc}") from None
    try:
        http = HttpServer(engine, serve_config, access_log=args.access_log)   # binds now: a busy port fails here
    except ConfigError:
        if kv_events is not None:
            kv_events.close()
        raise
    recorder = start_recording(engine, args.record)
    failed: list[str] = []

    def start_engine() -> None:
        try:
            engine.start(wait=True)
            print_startup_warnings(engine)
            err(f"tokentop: serving {http.api.model} on {http.url}/v1 (metrics at {http.url}/metrics)")
        except Exception as exc:  # noqa: BLE001 - one line, then stop serving
            failed.append(describe_error(exc))
            http.server.should_exit = True

    print(f"tokentop: listening on {http.url} (GET /health answers 503 until the model is loaded)",
          file=sys.stderr, flush=True)
    if serve_config.exposure_warning():
        print(f"tokentop: warning: {as_flags(serve_config.exposure_warning())}", file=sys.stderr, flush=True)
    threading.Thread(target=start_engine, name="tokentop-start", daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: setattr(http.server, "should_exit", True))
    # kill -USR1: write the flight recorder, off the signal handler (it waits on the workers)
    signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(target=write_trace, args=(engine, True),
                                                              name="tokentop-trace", daemon=True).start())
    try:
        http.run()
    finally:
        if args.trace_dir and engine.ready:   # what the last window held, as `generate --trace-dir` does
            write_trace(engine)
        if recorder is not None:
            recorder.close()
        engine.shutdown()
        if kv_events is not None:
            kv_events.close()
    if failed:
        raise TokentopError(failed[0])
    return 0


def cmd_dashboard(args) -> int:
    """`tokentop` with no subcommand: the dashboard (app/main.py), with --serve and --record."""
    from app.main import TokentopApp

    try:
        check_dashboard_server_flags(args)
        burst = startup_burst(args.burst_file, args.max_burst_requests) if args.burst_file else None
        config = engine_config_from(args, default_mode="process")
        # the routing panel shows the cost router's estimates: every worker gets a speed
        # profile (cached after its first start-up; measured then, as a start-up stage)
        config = replace(config, workers=tuple(replace(w, calibrate=True) for w in config.workers))
        app = TokentopApp(replace(config, worker_log=str(dashboard_log())), startup_burst=burst,
                          max_burst_requests=args.max_burst_requests)
        http = start_dashboard_http(app, args) if args.serve else None
        recorder = start_recording(app.engine, args.record)
    except (TokentopError, OSError) as exc:
        print(f"tokentop: error: {describe_error(exc)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        app.run()
    finally:
        if http is not None:
            http.stop()
        if recorder is not None:
            recorder.close()
    app.wait_for_shutdown()
    return app.return_code or 0


def dashboard_log():
    import platformdirs
    from pathlib import Path

    return Path(platformdirs.user_log_dir("tokentop")) / "workers.log"


def startup_burst(path: str, max_requests: int | None = None):
    """--burst-file: checked now (a bad file is a one-line error before anything loads);
    fired once every worker has started."""
    from pathlib import Path
    from app.burst_runner import BurstPlan
    from app.bursts import load_burst
    from app.screens.burst import DEFAULTS

    items = load_burst(path, max_requests) if max_requests else load_burst(path)
    return BurstPlan(path=Path(path), count=len(items), interval_ms=int(DEFAULTS["interval"]),
                     max_tokens=None, temperature=None)


def start_dashboard_http(app, args):
    """`--serve`: the HTTP API on the app's own engine, so its requests appear in the panels."""
    from engine.serve.server import HttpServer, parse_bind

    host, port = parse_bind(args.serve, default_host=args.host)
    http = HttpServer(app.engine, serve_config_from(args, host=host, port=port), quiet=True).start()
    app.serve_url = http.url
    app.engine.log("info", f"serving the OpenAI API on {http.url}/v1 (metrics at {http.url}/metrics)")
    return http


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
