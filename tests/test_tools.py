"""tools/ holds only maintained tools: few of them, and each one answers --help.

This is how CI runs the tools: a tool that no longer imports, parses or compiles against the
engine fails here instead of on the next person who needs it.
"""
import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
MAX_TOOLS = 11


def tool_files() -> list[Path]:
    return sorted(p for p in TOOLS.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def test_tools_are_few():
    files = tool_files()
    assert len(files) <= MAX_TOOLS, f"{len(files)} files in tools/ (at most {MAX_TOOLS}): {[p.name for p in files]}"


@pytest.mark.parametrize("tool", [p for p in tool_files() if p.suffix == ".py"], ids=lambda p: p.name)
def test_python_tool_has_a_one_line_docstring_and_help(tool):
    doc = ast.get_docstring(ast.parse(tool.read_text()))
    assert doc and "\n" not in doc.strip(), f"{tool.name}: the module docstring is one line"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(tool), "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage:") and doc.strip() in " ".join(out.stdout.split())


@pytest.mark.parametrize("tool", [p for p in tool_files() if p.suffix == ".sh"], ids=lambda p: p.name)
def test_shell_tool_has_help(tool):
    out = subprocess.run(["bash", str(tool), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and tool.name in out.stdout, out.stderr


@pytest.mark.parametrize("tool", [p for p in tool_files() if p.suffix == ".cpp"], ids=lambda p: p.name)
def test_cpp_tool_compiles_and_has_help(tool, tmp_path):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ (the kernels need it too)")
    binary = tmp_path / tool.stem
    built = subprocess.run([compiler, "-O1", "-std=c++17", "-Wno-psabi", str(tool), "-o", str(binary)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    out = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and tool.stem in out.stdout


def test_every_tool_is_one_of_the_kinds_above():
    assert {p.suffix for p in tool_files()} <= {".py", ".sh", ".cpp"}
