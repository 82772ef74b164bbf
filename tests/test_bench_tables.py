"""docs/benchmarks.md is generated from the kept reports in docs/bench/, docs/kernels.md from the
tool's own text (tools/bench_tables.py): neither can drift from what the tool gives, docs/bench/
keeps one report per benchmark and CPU class, each report shape renders, and every pointer into
either page from code or docs names a heading or entry that is on that page."""
import json
import re
from argparse import Namespace

import pytest

from tools import bench_tables as bt

FILES = sorted(p for p in bt.BENCH.rglob("*") if p.is_file())
NAME = re.compile(r"(?P<bench>[a-z0-9.-]+?)-(?P<cls>(?:zen[345]|spr|emr|cpu-unknown|h200)(?:-avx2)?)\.json")
CLASS_OF_SUFFIX = {"zen3": "Zen 3", "zen4": "Zen 4", "zen5": "Zen 5", "spr": "Sapphire Rapids",
                   "emr": "Emerald Rapids", "cpu-unknown": "CPU not recorded",
                   "emr-avx2": "Emerald Rapids, AVX2 kernels"}


@pytest.mark.parametrize("path", [bt.PAGE, bt.KERNELS_PAGE], ids=lambda p: p.name)
def test_the_page_is_what_the_tool_gives(path):
    assert path.read_text() == bt.pages()[path], f"docs/{path.name} is out of date: run python tools/bench_tables.py"


def test_every_report_is_on_the_page():
    page = bt.PAGE.read_text()
    missing = [p.relative_to(bt.DOCS).as_posix() for p in FILES
               if f"]({p.relative_to(bt.DOCS).as_posix()})" not in page]
    assert not missing


@pytest.mark.parametrize("path, kib", [(bt.PAGE, 36), (bt.KERNELS_PAGE, 15)], ids=lambda v: getattr(v, "name", v))
def test_the_page_is_short_and_has_no_history(path, kib):
    page = path.read_text()
    assert len(page.encode()) <= kib * 1024
    assert not re.search(r"\b20\d\d-\d\d-\d\d|\bpass(es)?\b|\bround \d|\bsession\b", page, re.I)


def test_the_benchmarks_intro_links_the_kernels_page_and_back():
    intro = bt.PAGE.read_text().split("\n## ", 1)[0]
    assert "](kernels.md)" in intro
    assert "](benchmarks.md)" in bt.KERNELS_PAGE.read_text().split("\n## ", 1)[0]


def test_one_report_per_benchmark_and_cpu_class_named_after_both():
    assert len(FILES) <= 28     # a few per CPU class the project has run on (and AVX2 kernels forced)
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
    # Intel's generic model name: the family tells the class
    ({"cpu_model": "Intel(R) Xeon(R) Processor", "cpu_family_model": "6/207", "isa": ["avx512f", "amx_tile"]},
     "Emerald Rapids"),
    # the AVX2 kernels forced on an AVX-512 CPU are reported apart from its own kernels
    ({"cpu_model": "Intel(R) Xeon(R) Processor", "cpu_family_model": "6/207", "isa": ["avx512f", "amx_tile"],
      "quantized_kernels": "avx2 (dots: avx-vnni)"}, "Emerald Rapids, AVX2 kernels"),
    ({"cpu_model": "AMD EPYC", "cpu_family_model": "25/1", "isa": ["avx2", "fma"], "quantized_kernels": "avx2"},
     "Zen 3"),
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


# --- each report shape renders ------------------------------------------------------------------
# Shapes as the bench code writes them (engine/bench/), most of them with no report kept yet.
ZEN4 = {"cpu_model": "AMD EPYC", "cpu_family_model": "25/17"}
EMR = {"cpu_model": "Intel(R) Xeon(R) Processor", "cpu_family_model": "6/207", "isa": ["avx512f", "amx_tile"]}


@pytest.fixture
def bench_dir(monkeypatch, tmp_path):
    """An empty docs/bench for the tool; write(name, fields) puts a report there, framed as
    engine/bench's run_bench frames it."""
    monkeypatch.setattr(bt, "DOCS", tmp_path)
    monkeypatch.setattr(bt, "BENCH", tmp_path / "bench")
    bt.BENCH.mkdir()

    def write(name: str, fields: dict, machine: dict = ZEN4) -> None:
        scenario = name.rsplit("-", 1)[0]
        report = {"scenario": scenario, "command": f"tokentop bench {scenario} --out /x/{name}.json",
                  "machine": machine, "started": "2000-01-01T00:00:00", "seconds": 1.0, **fields}
        (bt.BENCH / f"{name}.json").write_text(json.dumps(report))
    return write


@pytest.mark.parametrize("section, command", [
    (bt.sec_router, "tokentop bench router"), (bt.sec_record, "tokentop bench record"),
    (bt.sec_soak, "tokentop bench soak --minutes N"), (bt.sec_first_start, "tokentop bench first-start"),
    (bt.sec_rows, "tokentop bench rows --models qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")])
def test_a_benchmark_without_a_report_gets_what_it_measures_and_its_command(bench_dir, section, command):
    text = section()
    assert f"no report kept: `{command} --out docs/bench/" in text and "|" not in text


def test_router_renders_what_bench_router_writes(bench_dir):
    from engine.bench.router_cost import bench_router
    fields = bench_router(Namespace(sizes="8,16", quick=True, queued=1000, runs=1))
    bench_dir("router-zen4", fields)
    text = bt.sec_router()
    assert f"Zen 4: {fields['rows'][0]['queued']} requests queued" in text and "median ≤ 1 ms" in text
    for row in fields["rows"]:
        assert (f"| {row['workers']} | {row['policy']} | {bt.f(row['loads']['median_us'])} | "
                f"{bt.f(row['reuse']['median_us'])} | {bt.f(row['choose']['median_us'])} |") in text
        assert f"**{bt.f(row['total']['median_us'])}** / {bt.f(row['total']['p99_us'])}" in text
    assert "`tokentop bench router`" in text          # the command without its --out


def test_record(bench_dir):
    bench_dir("record-zen4", {"seconds": 60.0, "requests": 16, "frames": 301, "requests_finished": 16,
                              "bytes": 91404, "bytes_per_frame": 304, "bytes_per_minute": 91404,
                              "uncompressed_bytes_per_minute": 660264, "goals": {"record_le_1mb_per_minute": True}})
    assert "| Zen 4 | 60 | 16 (16) | 301 | 304 | **91,404** | 660,264 | met |" in bt.sec_record()


def soak_fields(**over) -> dict:
    fields = {
        "minutes": 30.0, "load_seconds": 1800.0,
        "events": {"worker_kill": {"at_s": 600.0, "dead_at_s": 600.3, "ready_again_at_s": 606.5},
                   "remote_restart": {"at_s": 1200.0, "down_at_s": 1200.9, "readmitted_at_s": 1205.7}},
        "requests": {"client": {"submitted": 4600, "open": 0, "finished": 3910, "aborted": 220, "failed": 0,
                                "disconnected": 470, "lost": 0, "doubled": 0, "streamed_after_finish": 0,
                                "wrong_length": 0, "failed_by_disruption": 0, "failed_unexpected": 0},
                     "engine": {"routed": 4600, "finished": 4600, "unfinished": 0, "finished_twice": 0}},
        "verdicts": {"rss": {"processes": {
            "main (pid 628)": {"judged": True, "growth_pct": 1.16},
            "worker1 (pid 706)": {"judged": True, "growth_pct": 0.03},
            "remote_server (pid 848)": {"judged": False, "why": "2 samples after its warm-up"}}},
            "kv_pages": {"workers": {"sim:soak0": {"pages_used": 0, "pages_held": 0, "pages_cached": 356}},
                         "remote_server_pages_used": 0}},
        "goals": {"rss_flat_le_5pct": True, "no_leaked_pages": True, "worker_respawned": True}}
    fields.update(over)
    return fields


def test_soak(bench_dir):
    bench_dir("soak-zen4", soak_fields())
    assert ("| Zen 4 | 30.00 | 4,600 | 3,910 / 220 / 0 / 470 | 0 / 0 | 0, 0 / 0, 0 | +1.16% (main) | 0, remote 0 "
            "| 6.5 | 5.7 | all 3 met |") in bt.sec_soak()


def test_a_failed_soak_says_what_failed(bench_dir):
    fields = soak_fields(goals={"rss_flat_le_5pct": True, "remote_readmitted": False},
                         error="verdicts failed: remote_readmitted")
    fields["events"]["remote_restart"].pop("readmitted_at_s")
    fields["verdicts"]["kv_pages"]["workers"]["sim:soak0"]["pages_held"] = 3
    bench_dir("soak-zen4", fields)
    row = bt.sec_soak().splitlines()[-1]
    assert "| 3, remote 0 | 6.5 | — | **missed**: remote_readmitted (1 of 2 met); **verdicts failed" in row


def test_first_start_shows_every_number_of_any_shape(bench_dir):
    bench_dir("first-start-zen4", {"model": "qwen2.5-coder-0.5b", "ready_s": 4.214, "first_token_s": 4.9,
                                   "stages": {"tokenizer_s": 0.31, "kernels": {"build_s": 0.004}},
                                   "runs_s": [4.1, 4.3], "cached": True, "goals": {"ready_le_10s": False}})
    bench_dir("first-start-zen5", {"ready_s": 3.0, "kernels_switched_s": 61}, {"cpu_model": "AMD EPYC",
                                                                             "cpu_family_model": "26/2"})
    text = bt.sec_first_start()
    assert "| field | Zen 4 | Zen 5 |" in text
    for row in ("| `ready_s` | 4.21 | 3.00 |", "| `first_token_s` | 4.90 | — |", "| `stages.tokenizer_s` | 0.31 | — |",
                "| `stages.kernels.build_s` | 0.004 | — |", "| `kernels_switched_s` | — | 61 |",
                "| goals | **missed**: ready_le_10s (0 of 1 met) | — |"):
        assert row in text
    assert "runs_s" not in text and "cached" not in text and "`seconds`" not in text


def test_dashboard_with_and_without_the_frame_and_the_chart(bench_dir):
    old = {"headless_tok_s": 17.08, "dashboard_tok_s": 18.76, "dashboard_over_headless": 1.099}
    bench_dir("dashboard-cpu-unknown", old, {"python": "3.11.7"})
    bench_dir("dashboard-zen4", {**old, "frame": {"live_requests": 200, "frames": 30, "table_frame_ms": 12.5,
                                                  "timeline_frame_ms": 31.25, "goal_ms": 25.0},
                                 "chart": {"redraw_ms": 31.44}})
    text = bt.sec_dashboard()
    assert "| Zen 4 | 17.1 | 18.8 | 1.099× | 12.50 / **31.25** (200) | 31.4 |" in text
    assert "| CPU not recorded | 17.1 | 18.8 | 1.099× | — | — |" in text


def test_trace_in_both_shapes(bench_dir):
    bench_dir("trace-zen4", {"no_recording_tok_s": 20.0, "light_tok_s": 19.9, "full_tok_s": 17.0,
                             "light_over_none": 0.995, "full_over_none": 0.85, "light_noop_scope_ns": 310.4,
                             "scopes_per_step": 194, "light_noop_scopes_fraction_of_step": 0.00031,
                             "goals": {"light_costs_le_1pct": True, "full_costs_le_10pct": False}})
    text = bt.sec_trace()
    assert ("| Zen 4 | 20.0 | 19.9 | 17.0 | 0.995× | 0.850× | — | "
            "**missed**: full_costs_le_10pct (1 of 2 met) |") in text
    assert "before the detail levels" not in text
    bench_dir("trace-zen4", {"no_recording_tok_s": 20.0, "light_tok_s": 19.9, "full_tok_s": 19.0,
                             "light_over_none": 0.995, "full_over_none": 0.95, "light_over_none_range": [0.98, 1.012],
                             "full_over_none_range": [0.93, 0.97], "light_step_records_us": 12.34,
                             "light_step_records_fraction_of_step": 0.0006, "light_noop_scope_ns": 310.4,
                             "scopes_per_step": 194, "light_noop_scopes_fraction_of_step": 0.00031,
                             "goals": {"light_costs_le_1pct": True, "full_costs_le_10pct": True}})
    text = bt.sec_trace()
    assert "| Zen 4 | 20.0 | 19.9 | 19.0 | 0.995× (0.980–1.012) | 0.950× (0.930–0.970) | 12.3 µs, 0.06% | all 2 met |" in text
    bench_dir("trace-cpu-unknown", {"tracing_off_tok_s": 21.4, "tracing_on_tok_s": 22.2, "on_over_off": 1.039,
                                    "disabled_scope_ns": 326.0, "scopes_per_step": 197,
                                    "disabled_cost_fraction_of_step": 0.00034}, {"python": "3.11.7"})
    text = bt.sec_trace()
    assert "Tracing off and on, before the detail levels:" in text
    assert "| CPU not recorded | 21.4 | 22.2 | 1.039× | 326 ns | 197 | 0.034% |" in text


def test_a_fuzz_run_shows_the_commonest_refusals_over_its_tests():
    run = {"report": {
        "tiny models: header mutations": {"examples": 10, "outcomes": {"refused at load": 8, "loaded": 2},
                                          "refusals": {"FILE is corrupt: a; re-download or re-assemble the model file": 5,
                                                       "FILE | b": 3}},
        "real model": {"examples": 4, "outcomes": {"refused at load": 4},
                       "refusals": {"FILE | b": 4}}}}
    text = bt.fuzz_table(run)
    assert text.splitlines()[0] == "|  | tiny models | real model |"
    rows = text.splitlines()[2:]
    assert rows[:3] == ["| examples | 10 | 4 |", "| outcomes | refused at load 8, loaded 2 | refused at load 4 |",
                        "| kinds of refusal | 2 | 1 |"]
    assert rows[3:] == ["| FILE \\| b | 3 | 4 |", "| FILE is corrupt: a | 5 | 0 |"]   # 7 of one, 5 of the other


# --- pointers into the pages -------------------------------------------------------------------
# Code and docs cite a section of a page as docs/benchmarks.md or docs/kernels.md, a comma, then one
# or more quoted names (a heading or a bold entry of that page), wrapped over comment lines where long.
QUOTED_NAME = r"'[^']+'|" + r'"[^"]+"'
POINTER = re.compile(rf"\b(benchmarks|kernels)\.md,\s*((?:{QUOTED_NAME})(?:\s*,\s*(?:{QUOTED_NAME}))*)")
CITED_NAME = re.compile(r"'([^']+)'|" + r'"([^"]+)"')
CITING = [bt.ROOT / d for d in ("engine", "app", "tools", "tests")] + [bt.ROOT / "docs", bt.ROOT / "README.md"]
SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".inc", ".md", ".sh"}
PAGE_OF = {"benchmarks": bt.PAGE, "kernels": bt.KERNELS_PAGE}


def normal(name: str) -> str:
    return " ".join(name.split()).rstrip(".:").lower()


def pointer_names(text: str) -> list[tuple[str, str]]:
    """(page, name) for each name the text's pointers cite, comment markers and line breaks taken out."""
    flat = " ".join(re.sub(r"^\s*(//+|#+|\*+)?\s*", "", line) for line in text.splitlines())
    return [(page, " ".join((a or b).split())) for page, group in POINTER.findall(flat)
            for a, b in CITED_NAME.findall(group)]


def page_names(page: str) -> set[str]:
    """The page's headings and bold entries (**Name.**), normalized."""
    return {normal(n) for n in re.findall(r"^#+ (.+)$", page, re.M) + re.findall(r"\*\*(.+?)\*\*", page)}


def citing_files() -> list:
    files = []
    for top in CITING:
        for p in sorted(top.rglob("*")) if top.is_dir() else [top]:
            if (p.is_file() and p.suffix in SOURCE_SUFFIXES and p not in PAGE_OF.values()
                    and "__pycache__" not in p.parts):
                files.append(p)
    return files


def test_pointer_names_are_read_across_comment_lines():
    text = """x = 1  # as measured (docs/kernels.md, 'Measurements behind
    // defaults', "KV dtype"), and docs/benchmarks.md alone; docs/benchmarks.md,
    # 'prefix: prefix caching'
    """
    assert pointer_names(text) == [("kernels", "Measurements behind defaults"), ("kernels", "KV dtype"),
                                   ("benchmarks", "prefix: prefix caching")]
    assert page_names("## Measurements behind defaults\n\n* **KV dtype.** fp32") == {
        "measurements behind defaults", "kv dtype"}


def test_every_pointer_names_a_heading_or_entry_of_the_page_it_names():
    names = {page: page_names(path.read_text()) for page, path in PAGE_OF.items()}
    cited = [(p.relative_to(bt.ROOT).as_posix(), page, n) for p in citing_files() for page, n in pointer_names(p.read_text())]
    assert len(cited) >= 20, "the pointers are no longer found: POINTER does not match how they are written"
    assert {page for _, page, _ in cited} == set(PAGE_OF), "pointers into each page are found"
    dangling = [f"{path}: docs/{page}.md, {name!r}" for path, page, name in cited if normal(name) not in names[page]]
    assert not dangling, "pointers to no heading or bold entry of the page they name:\n" + "\n".join(dangling)


def compare_run(burst: str, a: dict, b: dict, requests: list[tuple], workers=({"index": 0, "simulated": False},),
                per_worker=None, completion=(10.0, 9.0)) -> dict:
    """A compare report's fields the seeds section reads; requests: (ttft, e2e, output_tokens) per request,
    the same on both sides but B's TTFT halved."""
    def side(settings, half, completion_s):
        reqs = [{"ttft": t / (2 if half else 1), "e2e": e, "output_tokens": n} for t, e, n in requests]
        tokens = sum(n for _, _, n in requests)
        return {"settings": settings, "requests": reqs,
                "summary": {"completion_s": completion_s, "aggregate_tok_s": tokens / completion_s,
                            "requests_per_worker": per_worker or {"0": len(requests)}}}
    return {"label": burst, "command": f"tokentop compare sample_prompts/{burst}.jsonl --a x --b y",
            "report": {"burst": f"sample_prompts/{burst}.jsonl", "requests": len(requests), "workers": list(workers),
                       "a": side(a, False, completion[0]), "b": side(b, True, completion[1])}}


def test_seeds_show_ours_beside_the_published(bench_dir):
    assert "no report kept: `tokentop compare" in bt.sec_seeds()
    sf = [compare_run(f"single_flight_{n}", {"single-flight": "at-completion"}, {"single-flight": "after-prefill"},
                      [(1.0, 5.0, 128)] * n) for n in (2, 8)]
    routing = [compare_run("warm_prefix_8", {"worker": 1}, {"router-policy": "cost"}, [(0.5, 9.0, 128)] * 8,
                           ({"index": 0, "simulated": False}, {"index": 1, "simulated": True}), {"0": 1, "1": 7})]
    spec = [compare_run("spec_code_edit", {"speculate": "off"}, {"speculate": mode}, [(1.0, 6.0, 101)])
            for mode in ("ngram", "draft")]
    bench_dir("compare-seeds-zen4", {"experiments": {"single_flight": sf, "routing": routing, "spec": spec}})
    text = bt.sec_seeds()
    assert "`tokentop compare sample_prompts/single_flight_{2,8}.jsonl --a x --b y`" in text
    assert "| 2 | 1,000 | 500 | **−50.0%** | 1,357.5 | 584.7 | −56.9% |" in text
    assert "| 8 | 10.00 | 9.00 | **−10.0%** | +11.1% | 1 | 11.47 | 10.35 | −9.8% | — | 1 |" in text
    # 100 tokens after the first: over 5 s on the off side, 5.5 s on B's
    assert "| `spec_code_edit` | 20.0 | 18.2 (**−9.1%**) | 18.2 (**−9.1%**) | +38.3%, 98.5% accepted |" in text
    assert "Batching: no report of this class kept" in text and "Why Continuous Batching" in text


def test_seeds_batching_rows_beside_the_published(bench_dir):
    bench_dir("compare-seeds-zen4", {"experiments": {}})
    bench_dir("batching-zen4", {"batching": [{"n": 1, "batched_tok_s": 30.0}, {"n": 3, "batched_tok_s": 60.0}],
                                "paged_vs_contiguous": [], "aggregate_n8_over_n1": None})
    text = bt.sec_seeds()
    assert "| 3 | 60.0 | 2.00× | 17.41 | 13.05 | 17.52 |" in text
    assert "| 2 | — | — | 16.15 | 8.70 | 16.25 |" in text


def test_alternated_rounds_show_the_median_of_the_rounds_and_their_range(bench_dir):
    run = compare_run("mixed", {"speculate": "off"}, {"speculate": "suffix"}, [(1.0, 6.0, 101)])
    rep = run["report"]
    rep["a"]["label"], rep["b"]["label"] = "speculate=off", "speculate=suffix"
    rep["b"]["summary"]["acceptance_rate"] = 0.5
    rep["rounds"] = {"count": 3, "order": ["AB", "BA", "AB"],
                     "b_over_a_runs": {"aggregate_tok_s": [0.9, 1.2, 1.01], "itl_mean_p50": [1.1, 0.9, 1.0]}}
    rep["b_over_a"] = {"aggregate_tok_s": 1.01, "itl_mean_p50": 1.0}
    rep["outputs"] = {"compared": True, "greedy_requests": 1, "identical": True, "differing": [], "rounds": 3}
    bench_dir("compare-seeds-emr", {"experiments": {"rounds": [run]}}, EMR)
    text = bt.sec_seeds()
    assert ("| `mixed` | speculate=off | speculate=suffix | 3 | **1.010×** (0.900–1.200) | 1.000× | 50% "
            "| identical |") in text
    assert "Alternated A/B (`--rounds N`)" in text
    assert "Batching:" not in text   # a bundle of alternated rounds only: no batching line for its class


def test_rows_renders_what_bench_rows_writes(bench_dir):
    row = lambda n, ms, read, mm: {"rows": n, "step_ms": ms, "vs_1_row": round(ms / 18.0, 3), "tok_s": n / ms * 1000,
                                   "read_gb_s": 20.0, "read_share": read, "gflops": 10.0, "compute_share": mm,
                                   "nearer_bound": "bandwidth"}
    bench_dir("rows-zen4", {"sizes": [1, 8], "results": [
        {"model": "qwen2.5-coder-0.5b", "rows": [row(1, 18.0, 0.8, 0.05), row(8, 39.6, 0.4, 0.62)]},
        {"model": "qwen2.5-coder-1.5b", "error": "not found"}]})
    text = bt.sec_rows()
    assert ("| CPU | model | 1 row | 8 rows | read share, 1 row | read share, 8 rows "
            "| matmul-peak share, 8 rows |") in text
    assert "| Zen 4 | 0.5B | 1.00× | 2.20× | 80% | 40% | 62% |" in text
