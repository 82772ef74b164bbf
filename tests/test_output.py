"""OutputProcessor on its own: sampled tokens -> streamed text, stop strings, finish reasons."""
import pytest

from engine.config import SamplingParams
from engine.worker.output import OutputProcessor, SampledToken
from engine.worker.sequence import Sequence

EOG = 99
PIECES = {1: "Hel", 2: "lo ", 3: "EN", 4: "D!", 5: "x", 6: "y"}


class PieceDetok:
    """Each token id reads as a fixed piece; `tail` is what flush() releases at the end."""

    def __init__(self, tail: str = ""):
        self.tail = tail

    def push(self, token_id: int) -> str:
        return PIECES.get(token_id, "")

    def flush(self) -> str:
        tail, self.tail = self.tail, ""
        return tail


def run(tokens, max_context=1000, tail="", **params):
    seq = Sequence("r1", [7, 7], SamplingParams(**{"max_tokens": 100, **params}), arrival=0.0)
    seq.detok = PieceDetok(tail)
    out = OutputProcessor([EOG], max_context)
    deltas, reason = [], None
    for step, token_id in enumerate(tokens, 1):
        d, reason = out.on_token(seq, SampledToken(token_id, -0.5, ((token_id, -0.5),)), now=float(step))
        deltas += d
        if reason:
            break
    return seq, deltas, reason


def test_text_streams_with_each_token_and_its_logprobs():
    seq, deltas, reason = run([1, 2])
    assert reason is None and seq.text == "Hello " and seq.output_ids == [1, 2]
    assert [(d.token_id, d.text, d.logprob, d.top_logprobs) for d in deltas] == \
        [(1, "Hel", -0.5, ((1, -0.5),)), (2, "lo ", -0.5, ((2, -0.5),))]


def test_a_stop_string_split_over_tokens_is_held_back_and_cut():
    seq, deltas, reason = run([1, 2, 3, 4, 5], stop=("END",))
    assert reason == "stop" and seq.text == "Hello "
    assert "".join(d.text for d in deltas) == "Hello "          # "EN" never streamed
    assert seq.output_ids == [1, 2, 3, 4]                        # nothing after the stop


def test_held_text_is_released_when_the_request_ends_otherwise():
    seq, deltas, reason = run([1, 3], stop=("END",), max_tokens=2)
    assert reason == "length" and seq.text == "HelEN" and "".join(d.text for d in deltas) == "HelEN"


@pytest.mark.parametrize("tokens, params, reason, n_out", [
    ([1, EOG, 2], {}, "stop", 2),                                   # end of generation
    ([1, EOG, 2], {"ignore_eos": True, "max_tokens": 3}, "length", 3),
    ([1, 5, 2], {"stop_token_ids": (5,)}, "stop", 2),
    ([1, 2, 1, 2], {"max_tokens": 3}, "length", 3),
])
def test_finish_reasons(tokens, params, reason, n_out):
    seq, _, got = run(tokens, **params)
    assert got == reason and len(seq.output_ids) == n_out


def test_the_context_limit_ends_a_request_as_length():
    seq, _, reason = run([1, 2, 1, 2], max_context=4)          # 2 prompt tokens + 2 output
    assert reason == "length" and seq.output_ids == [1, 2]


def test_a_stop_token_flushes_the_detokenizer_tail_but_is_not_text():
    seq, deltas, reason = run([1, EOG], tail="!")
    assert reason == "stop" and seq.text == "Hel!" and deltas[-1].token_id == -1


def test_finished_event_carries_the_metrics():
    seq, _, _ = run([1, 2, 5], max_tokens=3)
    seq.first_scheduled, seq.finished_at, seq.finish_reason = 0.25, 3.5, "length"
    event = OutputProcessor.finished_event(seq)
    m = event.metrics
    assert (event.request_id, event.reason, event.error) == ("r1", "length", None)
    assert (m.prompt_tokens, m.output_tokens, m.queue_time, m.ttft, m.e2e) == (2, 3, 0.25, 1.0, 3.5)
    assert m.itl_mean == pytest.approx(1.0) and m.itl_max == pytest.approx(1.0)


def test_many_long_stops_hold_back_at_most_the_longest_but_one():
    """64 stop strings of 256 characters (the cap): the text held back per token never grows
    past 255 characters, so each token's search stays bounded; the last stop is still found
    when it arrives split over tokens."""
    from engine.config import MAX_STOP_CHARS, MAX_STOPS
    stops = tuple(f"{i:02d}" + "q" * (MAX_STOP_CHARS - 2) for i in range(MAX_STOPS - 1)) + ("lo EN",)
    seq = Sequence("r1", [7, 7], SamplingParams(max_tokens=1000, stop=stops).validate(), arrival=0.0)
    seq.detok = PieceDetok()
    out = OutputProcessor([EOG], 10_000)
    held = []
    for step, token_id in enumerate([5, 6] * 200 + [1, 2, 3, 4], 1):
        _, reason = out.on_token(seq, SampledToken(token_id), now=float(step))
        held.append(len(seq.held_text))
        if reason:
            break
    assert reason == "stop" and max(held) == MAX_STOP_CHARS - 1
    assert seq.text == "xy" * 200 + "Hel"
