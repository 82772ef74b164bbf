"""Speculative decoding in the dashboard: the `s` key, the speculation panel, the request
table's spec column and the streams' colouring of accepted-draft text (a real tiny model)."""
from __future__ import annotations

import time

from app.main import TokentopApp
from app.widgets.requests import spec_text
from app.widgets.spec import gain_line, spec_markup
from app.widgets.streams import DRAFTED_STYLE, drafted_ranges, stream_content, stream_lines
from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.facade.snapshot import RequestView
from tests.fixtures.tiny_gguf import write_tiny_model


async def wait_for(pilot, predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await pilot.pause(0.05)


async def test_s_cycles_the_mode_and_the_panel_shows_acceptance(tmp_path):
    model = write_tiny_model(tmp_path / "tiny.gguf", "qwen2")
    cfg = WorkerConfig(model=str(model), threads=1, calibrate=False, spec_k="4")
    app = TokentopApp(EngineConfig(workers=(cfg,), worker_mode="thread"),
                      settings_path=tmp_path / "settings.json")
    async with app.run_test(size=(140, 40)) as pilot:
        await wait_for(pilot, lambda: app.engine.ready, "the worker")
        assert app.engine.spec_modes() == ("off", "ngram", "suffix")   # no draft model loaded
        await pilot.press("s")
        assert app.engine.spec_mode == "ngram"
        handles = [app.engine.submit("zebra " * 20, params=SamplingParams(max_tokens=40, ignore_eos=True))
                   for _ in range(2)]
        results = [h.result(60) for h in handles]
        assert all(r.metrics.spec["mode"] == "ngram" for r in results)
        await wait_for(pilot, lambda: "pos 1" in app.panels["spec"]._shown, "acceptance by position")
        assert "acc " in app.panels["spec"]._shown and "new requests: [b]ngram" in app.panels["spec"]._shown
        await wait_for(pilot, lambda: "gain [b]" in app.panels["spec"]._shown, "the measured gain")
        spec = app.engine.snapshot().workers[0].spec
        assert spec["spec_tok_s"] > 0 and spec["plain_tok_s_est"] > 0
        await pilot.press("s")
        assert app.engine.spec_mode == "suffix"
        await pilot.press("s")
        assert app.engine.spec_mode == "off"
        off = app.engine.submit("zebra " * 20, params=SamplingParams(max_tokens=5)).result(60)
        assert off.metrics.spec is None


def _view(text: str, spans, spec=None) -> RequestView:
    return RequestView("r7", 0, "decode", 3, 0, 10, 20, None, None, None, None, text, None, None, 1.0,
                       spec=spec, drafted_spans=spans)


def test_streams_colour_exactly_the_drafted_text():
    r = _view("hello world foo bar", ((6, 11), (16, 19)))
    label = " r7 w0 "
    joined = "\n".join(stream_lines(label, r.text_tail, 15))
    assert [joined[a:b].replace("\n", "") for a, b in drafted_ranges(r, label, 15)] == ["world", "bar"]
    content, _ = stream_content(r, 40)
    styled = [content.plain[s.start:s.end] for s in content.spans if str(s.style) == DRAFTED_STYLE]
    assert styled == ["world", "bar"]


def test_request_column_and_panel_text():
    spec = {"mode": "draft", "drafts": 3, "draft_tokens": 12, "accepted_tokens": 9, "emitted_tokens": 12,
            "acceptance_rate": 0.75, "mean_accepted_length": 4.0, "acceptance_per_position": [1.0, 0.5], "k": 4}
    r = _view("x", (), spec)
    assert spec_text(r) == "draft 75%"
    assert spec_text(_view("x", ())) == ""
    text = spec_markup((), (r,), "draft", 60)
    assert "r7 draft k 4 acc 75% len 4.00" in text
    line = gain_line({"gain": 1.5, "spec_tok_s": 30.0, "plain_tok_s_est": 20.0})
    assert "×1.50" in line and "30.0 tok/s" in line and "20.0 est. without" in line and "$success" in line
    assert "$error" in gain_line({"gain": 0.8, "spec_tok_s": 16.0, "plain_tok_s_est": 20.0})
