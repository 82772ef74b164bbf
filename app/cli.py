"""`tokentop` entry point: no subcommand opens the dashboard; others go to engine.cli."""
from __future__ import annotations

import sys

ENGINE_COMMANDS = {"generate", "bench", "models", "serve"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ENGINE_COMMANDS:
        from engine.cli import main as engine_main
        return engine_main(argv)
    from app.main import run_dashboard
    return run_dashboard(argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
