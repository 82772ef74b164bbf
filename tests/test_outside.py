"""engine/outside.py: the one sanitizer and the one JSON loader for outside data."""
import pytest

from engine.outside import OutsideDataError, json_depth, load_json, visible

HOSTILE = "\x1b]0;x\x07\x1b[2J\x9b2J"


def test_visible_leaves_no_control_character():
    shown = visible(HOSTILE + "\ud800" + "\x7f" + "\r\n\t")
    assert shown == "^[]0;x^G^[[2J<9b>2J<d800>^?^M^J^I"
    assert all(0x20 <= ord(c) < 0x7F or ord(c) > 0x9F for c in shown)


def test_visible_multiline_keeps_newlines_and_tabs_only():
    assert visible("a\n\tb\x1b\r", multiline=True) == "a\n\tb^[^M"


def test_visible_leaves_ordinary_text_alone():
    text = "héllo, 世界 — «ok» ✓"
    assert visible(text) == text
    assert visible(42) == "42"


def test_json_depth_skips_brackets_inside_strings():
    assert json_depth('{"a": [1, {"b": "[[[[{{{"}]}') == 3
    assert json_depth('"\\"[["') == 0


def test_load_json_refuses_deep_nesting_before_parsing():
    with pytest.raises(OutsideDataError, match=r"run\.rec, line 3: JSON nested deeper than 64"):
        load_json("[" * 100_000 + "]" * 100_000, source="run.rec", line=3)


def test_load_json_refuses_over_size_and_bad_text():
    with pytest.raises(OutsideDataError, match="over the 10-byte limit"):
        load_json(b'{"a": "0123456789"}', source="x", max_bytes=10)
    with pytest.raises(OutsideDataError, match="not UTF-8"):
        load_json(b'"\xff"', source="x")
    with pytest.raises(OutsideDataError, match=r"http://h/\^\[: not valid JSON"):
        load_json("{", source="http://h/\x1b")


def test_load_json_parses_a_good_document():
    assert load_json(b'{"a": [1, 2, {"b": null}]}', source="x") == {"a": [1, 2, {"b": None}]}
