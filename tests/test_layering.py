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


# The import graph of app/ and engine/, from the AST: a module's edges are what it imports at any
# depth (function-level imports too), except under `if TYPE_CHECKING:` (annotations only).
ROOT = ENGINE.parent
PACKAGES = ("app", "engine")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return skip


def runtime_imports(source: str, module: str, is_package: bool) -> set[str]:
    """Every dotted name `module` imports at run time, relative imports resolved; `from a import b`
    gives both a and a.b (b may be a module)."""
    tree = ast.parse(source)
    skip = _type_checking_nodes(tree)
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of app/ and engine/ it imports (a name resolves to its longest
    module prefix, so `from engine.bench.common import x` is an edge to engine.bench.common)."""
    paths = {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}
    graph = {}
    for module, path in paths.items():
        edges = set()
        for name in runtime_imports(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            while name and name not in paths:
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.add(name)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_graph_resolves_relative_imports_and_skips_type_checking():
    src = ("from typing import TYPE_CHECKING\nfrom . import sibling\nfrom ..kv.pages import PagePool\n"
           "if TYPE_CHECKING:\n    from engine.facade.engine import Engine\n"
           "def f():\n    import engine.stats\n")
    names = runtime_imports(src, "engine.worker.loop", is_package=False)
    assert {"engine.worker.sibling", "engine.kv.pages", "engine.kv.pages.PagePool", "engine.stats"} <= names
    assert not any("facade" in name for name in names)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert "engine.facade.engine" in graph and "engine.facade.dispatch" in graph["engine.facade.engine"]
    found = cycles(graph)
    assert not found, found


def test_kv_never_imports_the_worker():
    """The KV pages and prefix cache serve the worker; what they need of a sequence is
    engine/kv/paged.py's Protocol, so they stand without it (TYPE_CHECKING imports included)."""
    offenders = [f"{path.relative_to(ROOT)}:{line} imports {module}"
                 for path in sorted((ENGINE / "kv").rglob("*.py"))
                 for line, module in imported_modules(path.read_text(encoding="utf-8"))
                 if module == "engine.worker" or module.startswith("engine.worker.")]
    assert not offenders, offenders


def test_root_modules_import_only_root_modules():
    """engine/'s root modules are the leaves both sides share: they import no package of engine/."""
    roots = {path.stem for path in ENGINE.glob("*.py")} - {"__init__"}
    offenders = [f"{path.name}:{line} imports {module}"
                 for path in sorted(ENGINE.glob("*.py"))
                 for line, module in imported_modules(path.read_text(encoding="utf-8"))
                 if module.startswith("engine.") and module.split(".")[1] not in roots]
    assert "outside" in roots and "dtypes" in roots
    assert not offenders, offenders


def test_kv_sizes_without_torch_match_the_store():
    """engine/dtypes.py sizes a KV slot without torch; the store allocates with it: the same."""
    from types import SimpleNamespace

    from engine.dtypes import KV_DTYPE_BYTES, kv_bytes_per_slot
    from engine.models.batch import KV_TORCH_DTYPES, KVStore

    model = SimpleNamespace(n_layers=3, n_kv_heads=2, head_dim=64)
    assert set(KV_DTYPE_BYTES) == set(KV_TORCH_DTYPES)
    for dtype, torch_dtype in KV_TORCH_DTYPES.items():
        assert kv_bytes_per_slot(model, "cpu", dtype) == KVStore.bytes_per_slot(3, 2, 64, torch_dtype)
