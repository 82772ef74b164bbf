"""Small pieces: no function in app/ or engine/ over 60 lines, no class over 300 (a longer one is doing
more than one job; split it into named steps or a helper of its own)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300


def oversized(source: str, where: str) -> list[str]:
    """'where:line name (N lines)' for each function over MAX_FUNCTION_LINES and each class over
    MAX_CLASS_LINES, at any depth; a definition's lines run from its `def`/`class` to its end."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            lines = node.end_lineno - node.lineno + 1
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            if lines > limit:
                found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_the_check_counts_lines_of_functions_and_classes():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert oversized(f"def long():\n{body}", "f.py") == [f"f.py:1 long ({MAX_FUNCTION_LINES + 1} lines)"]
    assert oversized(f"def fits():\n{body[:-len('    x59 = 59') - 1]}", "f.py") == []
    methods = "".join(f"    def m{i}(self):\n        return {i}\n\n" for i in range(MAX_CLASS_LINES // 3 + 1))
    assert [line.split()[1] for line in oversized(f"class Big:\n{methods}", "c.py")] == ["Big"]


def test_no_function_or_class_in_app_or_engine_is_oversized():
    paths = sorted((ROOT / "engine").rglob("*.py")) + sorted((ROOT / "app").rglob("*.py"))
    assert len(paths) > 90
    offenders = [line for p in paths
                 for line in oversized(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))]
    assert not offenders, offenders
