"""docs/benchmarks.md is generated from the kept reports in docs/bench/ (tools/bench_tables.py):
it cannot drift from them, and docs/bench/ keeps one report per benchmark and CPU class."""
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
