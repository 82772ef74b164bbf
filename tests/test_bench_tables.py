"""docs/benchmarks.md is generated from the kept reports in docs/bench/ (tools/bench_tables.py):
it cannot drift from them, docs/bench/ keeps one report per benchmark and CPU class, and every
pointer into the page from code or docs names a heading or entry that is on it."""
import re

import pytest

from tools import bench_tables as bt

FILES = sorted(p for p in bt.BENCH.rglob("*") if p.is_file())
NAME = re.compile(r"(?P<bench>[a-z0-9.-]+?)-(?P<cls>zen[345]|cpu-unknown|h200)\.json")
CLASS_OF_SUFFIX = {"zen3": "Zen 3", "zen4": "Zen 4", "zen5": "Zen 5", "cpu-unknown": "CPU not recorded"}


def test_the_page_is_what_the_reports_give():
    assert bt.PAGE.read_text() == bt.render(), "docs/benchmarks.md is out of date: run python tools/bench_tables.py"


def test_every_report_is_on_the_page():
    page = bt.PAGE.read_text()
    missing = [p.relative_to(bt.DOCS).as_posix() for p in FILES
               if f"]({p.relative_to(bt.DOCS).as_posix()})" not in page]
    assert not missing


def test_the_page_is_short_and_has_no_history():
    page = bt.PAGE.read_text()
    assert len(page.encode()) <= 25 * 1024
    assert not re.search(r"\b20\d\d-\d\d-\d\d|\bpass(es)?\b|\bround \d|\bsession\b", page, re.I)


def test_one_report_per_benchmark_and_cpu_class_named_after_both():
    assert len(FILES) <= 20
    seen = set()
    for p in FILES:
        m = NAME.fullmatch(p.name)
        assert m, f"{p.name}: reports are named BENCH-CLASS.json"
        assert (m["bench"], m["cls"]) not in seen
        seen.add((m["bench"], m["cls"]))
        if m["cls"] in CLASS_OF_SUFFIX:     # the name says the CPU the report records
            assert bt.Report(p).cls == CLASS_OF_SUFFIX[m["cls"]], p.name


@pytest.mark.parametrize("machine, cls", [
    ({"cpu_model": "AMD EPYC", "cpu_family_model": "25/1", "isa": ["avx2", "fma"]}, "Zen 3"),
    ({"cpu_model": "AMD EPYC", "cpu_family_model": "25/17", "isa": ["avx2", "avx512f"]}, "Zen 4"),
    ({"cpu_model": "AMD EPYC", "cpu_family_model": "26/2", "isa": ["avx512f", "avx_vnni"]}, "Zen 5"),
    # reports that do not record the family: the ISA tells these three apart
    ({"cpu_model": "AMD EPYC", "isa": ["avx2", "fma"]}, "Zen 3"),
    ({"cpu_model": "AMD EPYC", "isa": ["avx2", "avx512f", "avx512_vnni"]}, "Zen 4"),
    ({"cpu_model": "AMD EPYC", "isa": ["avx2", "avx_vnni", "avx512f"]}, "Zen 5"),
    ({"python": "3.11.7"}, "CPU not recorded"),
    ({"cpu_model": "Intel(R) Xeon(R) Processor", "isa": ["avx512f", "avx_vnni", "amx_tile"]},
     "Intel(R) Xeon(R) Processor"),
])
def test_cpu_class(machine, cls):
    assert bt.cpu_class(machine) == cls


def test_the_command_shown_is_the_report_s_without_its_out_path():
    r = bt.Report.__new__(bt.Report)
    r.data = {"command": "tokentop bench single --runs 5 --out /tmp/x/y.json --threads 2"}
    assert r.command == "tokentop bench single --runs 5 --threads 2"


def test_the_readme_quotes_the_headline_table():
    """README.md's Measured section is the page's headline table (the same reports)."""
    readme = (bt.ROOT / "README.md").read_text()
    assert bt.headline() in readme
    measured = readme[readme.index("## Measured"):]
    assert len(measured.splitlines()) <= 15 and "docs/benchmarks.md" in measured
    assert len(readme.encode()) < 10 * 1024


# --- pointers into the page --------------------------------------------------------------------
# Code and docs cite a section of the page as docs/benchmarks.md, a comma, then one or more quoted
# names (a heading or a bold entry of the page), wrapped over comment lines where long.
QUOTED_NAME = r"'[^']+'|" + r'"[^"]+"'
POINTER = re.compile(rf"benchmarks\.md,\s*((?:{QUOTED_NAME})(?:\s*,\s*(?:{QUOTED_NAME}))*)")
CITED_NAME = re.compile(r"'([^']+)'|" + r'"([^"]+)"')
CITING = [bt.ROOT / d for d in ("engine", "app", "tools", "tests")] + [bt.ROOT / "docs", bt.ROOT / "README.md"]
SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".inc", ".md", ".sh"}


def normal(name: str) -> str:
    return " ".join(name.split()).rstrip(".:").lower()


def pointer_names(text: str) -> list[str]:
    """The names the text's pointers cite, comment markers and line breaks taken out."""
    flat = " ".join(re.sub(r"^\s*(//+|#+|\*+)?\s*", "", line) for line in text.splitlines())
    return [" ".join((a or b).split()) for group in POINTER.findall(flat) for a, b in CITED_NAME.findall(group)]


def page_names(page: str) -> set[str]:
    """The page's headings and bold entries (**Name.**), normalized."""
    return {normal(n) for n in re.findall(r"^#+ (.+)$", page, re.M) + re.findall(r"\*\*(.+?)\*\*", page)}


def citing_files() -> list:
    files = []
    for top in CITING:
        for p in sorted(top.rglob("*")) if top.is_dir() else [top]:
            if p.is_file() and p.suffix in SOURCE_SUFFIXES and p != bt.PAGE and "__pycache__" not in p.parts:
                files.append(p)
    return files


def test_pointer_names_are_read_across_comment_lines():
    text = """x = 1  # as measured (docs/benchmarks.md, 'Measurements behind
    // defaults', "KV dtype"), and docs/benchmarks.md alone
    """
    assert pointer_names(text) == ["Measurements behind defaults", "KV dtype"]
    assert page_names("## Measurements behind defaults\n\n* **KV dtype.** fp32") == {
        "measurements behind defaults", "kv dtype"}


def test_every_pointer_into_the_page_names_a_heading_or_entry_of_it():
    names = page_names(bt.PAGE.read_text())
    cited = [(p.relative_to(bt.ROOT).as_posix(), n) for p in citing_files() for n in pointer_names(p.read_text())]
    assert len(cited) >= 20, "the pointers are no longer found: POINTER does not match how they are written"
    dangling = [f"{path}: {name!r}" for path, name in cited if normal(name) not in names]
    assert not dangling, "pointers to no heading or bold entry of docs/benchmarks.md:\n" + "\n".join(dangling)
