"""engine/ is a library with no knowledge of the UI: nothing under it imports `app`."""
from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "engine"


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) for every import statement, at any depth (function-level ones too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_the_walk_sees_function_level_imports():
    src = "import os\ndef f():\n    from app.main import TokentopApp\n    import app.cli as c\n"
    assert [m for _, m in imported_modules(src)] == ["os", "app.main", "app.cli"]


def test_engine_never_imports_app():
    offenders = [f"{path.relative_to(ENGINE.parent)}:{line} imports {module}"
                 for path in sorted(ENGINE.rglob("*.py"))
                 for line, module in imported_modules(path.read_text(encoding="utf-8"))
                 if module == "app" or module.startswith("app.")]
    assert list(ENGINE.rglob("*.py")), "engine/ not found"
    assert not offenders, offenders


# The process boundary: what runs inside a worker (its loop, runners, KV, model, kernels,
# speculation) never reaches back into the facade's side, the remote worker, the HTTP server
# or the benchmarks. Both sides meet in engine/messages.py and the shared leaf modules.
WORKER_SIDE = ("worker", "kv", "models", "kernels", "speculative")
FACADE_SIDE = ("engine.facade", "engine.remote", "engine.serve", "engine.bench", "engine.watch")


def test_worker_side_never_imports_the_facade_side():
    offenders = [f"{path.relative_to(ENGINE.parent)}:{line} imports {module}"
                 for folder in WORKER_SIDE
                 for path in sorted((ENGINE / folder).rglob("*.py"))
                 for line, module in imported_modules(path.read_text(encoding="utf-8"))
                 if any(module == side or module.startswith(side + ".") for side in FACADE_SIDE)]
    assert all((ENGINE / folder).is_dir() for folder in WORKER_SIDE)
    assert not offenders, offenders


def test_shared_modules_import_neither_side():
    """engine/'s root modules (messages, config, errors, trace, ...) are what both sides share."""
    sides = FACADE_SIDE + tuple(f"engine.{folder}" for folder in ("worker", "speculative"))
    offenders = [f"{path.name}:{line} imports {module}"
                 for path in sorted(ENGINE.glob("*.py"))
                 for line, module in imported_modules(path.read_text(encoding="utf-8"))
                 if any(module == side or module.startswith(side + ".") for side in sides)]
    assert not offenders, offenders
