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
