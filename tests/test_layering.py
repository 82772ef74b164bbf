"""engine/ is a library with no knowledge of the UI: nothing under it imports `app`."""
from __future__ import annotations

import ast
import re
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


# The engine speaks fields, not flags: its messages name a setting by its config field, in
# backticks (engine/errors.py), and the command line renders them as flags (app/flags.py).
FLAG = re.compile(r"--[A-Za-z][A-Za-z-]*")
FIELD = re.compile(r"`([a-z][a-z0-9_]*)(?:=[^`]*)?`")
COMMAND_LINE_TOOLS = ENGINE / "bench"          # benchmarks are command-line tools: flags are theirs
OTHER_PROGRAMS_FLAGS = {"--force-reinstall"}  # pip's, in the fix a model error prints


def docstrings(tree: ast.AST) -> set[int]:
    """id() of every docstring node: documentation, like comments, may name a flag."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def string_texts(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string literal but docstrings; an f-string's text is its literal
    parts with {} where a value goes (so `max_context={}` reads as one field with a value)."""
    tree = ast.parse(source)
    skip = docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.JoinedStr):
            skip.update(id(part) for part in ast.walk(node))
            found.append((node.lineno, "".join(part.value if isinstance(part, ast.Constant) else "{}"
                                               for part in node.values)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append((node.lineno, node.value))
    return found


def engine_sources() -> list[Path]:
    return [path for path in sorted(ENGINE.rglob("*.py")) if COMMAND_LINE_TOOLS not in path.parents]


def test_the_string_walk_reads_f_strings_whole_and_skips_docstrings():
    src = ('def f(n):\n    """Run with `--flag`."""\n'
           '    raise ValueError(f"use --max-context {n} or `kv_cache_memory={n:,}`", "x")\n')
    assert [text for _, text in string_texts(src)] == ["use --max-context {} or `kv_cache_memory={}`", "x"]
    assert FLAG.search("use --max-context") and not FLAG.search("a -- b, ---, --1")
    assert [m.group(1) for m in FIELD.finditer("`max_context` and `kv_cache_memory={}`")] == \
        ["max_context", "kv_cache_memory"]


def test_engine_strings_name_fields_not_flags():
    offenders = [f"{path.relative_to(ENGINE.parent)}:{line}: {text!r}"
                 for path in engine_sources()
                 for line, text in string_texts(path.read_text(encoding="utf-8"))
                 if any(m.group() not in OTHER_PROGRAMS_FLAGS for m in FLAG.finditer(text))]
    assert engine_sources(), "engine/ not found"
    assert not offenders, offenders


def test_every_field_engine_messages_name_has_a_flag():
    """The command line renders `field` as its flag: a field missing from the map would reach
    the user raw."""
    from app.flags import FIELD_FLAGS

    named = {(path.relative_to(ENGINE.parent), line, m.group(1))
             for path in engine_sources()
             for line, text in string_texts(path.read_text(encoding="utf-8"))
             for m in FIELD.finditer(text)}
    assert named, "no engine message names a field: the pattern no longer matches them"
    missing = sorted(f"{path}:{line}: `{name}`" for path, line, name in named if name not in FIELD_FLAGS)
    assert not missing, missing
