"""docs/architecture.md stays short and complete: at most 30 KB, a row in its file table for every
source file of app/, engine/, tools/ and themes/ (an `__init__.py` holding only its docstring
excepted), no row or path for a file that is not there."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
TABLED = ("app", "engine", "tools", "themes")
SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".inc", ".sh", ".tcss"}
# a table's head names its folder: | **engine/facade/** | what it holds |; its rows name files in it
FOLDER_HEAD = re.compile(r"^\| \*\*([\w/]+/)\*\* \|", re.M)
FILE_ROW = re.compile(r"^\| `([^`]+)` \|", re.M)
PATH = re.compile(r"(?<![\w/.])((?:app|engine|tools|themes|tests|docs|sample_prompts|\.ci)/[\w.*/-]*[\w/*])")


def files_section(text: str) -> str:
    return text[text.index("\n## Files\n"):text.index("\n## Where things go\n")]


def tabled_files(text: str) -> list[str]:
    """Every file a row of the file table names, as a path from the repository root."""
    files, folder = [], None
    for line in files_section(text).splitlines():
        if head := FOLDER_HEAD.match(line):
            folder = head[1]
        elif (row := FILE_ROW.match(line)) and folder:
            files.append(folder + row[1])
    return files


def only_a_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def source_files() -> list[str]:
    found = []
    for top in TABLED:
        for p in sorted((ROOT / top).rglob("*")):
            if p.is_file() and p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts:
                if p.name == "__init__.py" and only_a_docstring(p):
                    continue
                found.append(p.relative_to(ROOT).as_posix())
    return found


def test_the_page_is_at_most_30_kb():
    size = len(DOC.read_bytes())
    assert size <= 30 * 1024, f"docs/architecture.md is {size} bytes: say less (details go in docstrings)"


def test_every_source_file_has_a_row():
    rows = set(tabled_files(DOC.read_text()))
    missing = [f for f in source_files() if f not in rows]
    assert not missing, "files without a row in docs/architecture.md's file table:\n" + "\n".join(missing)


def test_every_python_file_of_app_and_engine_has_a_row():
    rows = set(tabled_files(DOC.read_text()))
    python = [p.relative_to(ROOT).as_posix() for top in ("app", "engine") for p in (ROOT / top).rglob("*.py")
              if p.name != "__init__.py" and "__pycache__" not in p.parts]
    assert len(python) > 50
    assert not [f for f in python if f not in rows]


def test_every_row_and_path_names_something_that_is_there():
    text = DOC.read_text()
    rows = tabled_files(text)
    assert len(rows) == len(set(rows)), "a file with two rows"
    named = rows + PATH.findall(text)
    gone = [p for p in named if not (any(ROOT.glob(p)) if "*" in p else (ROOT / p).exists())]
    assert not gone, "docs/architecture.md names paths that do not exist:\n" + "\n".join(gone)


def test_the_table_reader_reads_heads_rows_and_paths():
    text = ("\n## Files\n\n| **engine/kv/** | KV pages |\n|---|---|\n| `pages.py` | pools |\n\n"
            "| **tools/** | tools |\n|---|---|\n| `x.py` | y |\n\n## Where things go\n")
    assert tabled_files(text) == ["engine/kv/pages.py", "tools/x.py"]
    assert PATH.findall("see `engine/kv/`'s pages (docs/bench/*.json, .ci/run).") == [
        "engine/kv/", "docs/bench/*.json", ".ci/run"]


@pytest.mark.parametrize("section", ["Boundaries", "The data path of one request", "Files",
                                     "Where things go", "Why not the obvious alternative"])
def test_the_sections_that_must_stay_are_there(section):
    assert f"\n## {section}\n" in DOC.read_text()
