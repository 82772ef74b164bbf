"""`tokentop serve`: the engine behind an OpenAI-compatible HTTP API, headless."""
from __future__ import annotations

import signal
import sys
import threading

from engine.errors import TokentopError


def add_serve_flags(p) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1/*")
    g.add_argument("--max-queue", type=int, default=256,
                   help="answer 429 when this many requests wait beyond what the workers can run")
    g.add_argument("--max-body", default="4MiB", help="largest request body accepted")


def serve_config_from(args, host: str | None = None, port: int | None = None):
    from engine.devices import parse_size
    from engine.errors import ConfigError
    from engine.serve.app import ServeConfig

    if getattr(args, "max_queue", 256) < 0:
        raise ConfigError("--max-queue must be >= 0")
    return ServeConfig(host=host or getattr(args, "host", "127.0.0.1"),
                       port=getattr(args, "port", 8000) if port is None else port,
                       api_key=getattr(args, "api_key", None), max_queue=getattr(args, "max_queue", 256),
                       max_body=parse_size(getattr(args, "max_body", "4MiB")))


def cmd_serve(args) -> int:
    from engine.cli import engine_config_from
    from engine.engine import Engine
    from engine.serve.server import HttpServer

    config = engine_config_from(args, default_mode="process")
    engine = Engine(config)
    http = HttpServer(engine, serve_config_from(args))      # binds now: a busy port fails here
    failed: list[str] = []

    def start_engine() -> None:
        try:
            engine.start(wait=True)
            print(f"tokentop: serving {http.api.model} on {http.url}/v1 (metrics at {http.url}/metrics)",
                  file=sys.stderr, flush=True)
        except TokentopError as exc:
            failed.append(str(exc))
            http.server.should_exit = True
        except Exception as exc:  # noqa: BLE001 - one line, then stop serving
            failed.append(f"{type(exc).__name__}: {exc}")
            http.server.should_exit = True

    print(f"tokentop: listening on {http.url} (GET /health answers 503 until the model is loaded)",
          file=sys.stderr, flush=True)
    threading.Thread(target=start_engine, name="tokentop-start", daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: setattr(http.server, "should_exit", True))
    try:
        http.run()
    finally:
        engine.shutdown()
    if failed:
        raise TokentopError(failed[0])
    return 0
