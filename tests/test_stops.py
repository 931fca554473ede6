"""Stop sequences matched on text (pure logic, no servers): across pieces, held back while
they may begin a stop sequence, left out of the text."""

from __future__ import annotations

from gateway.server.llm.stops import StopMatcher


def _run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    matcher = StopMatcher(stops)
    out = [matcher.feed(piece) for piece in pieces]
    out.append(matcher.finish())
    return [piece for piece in out if piece], matcher.stopped


def test_text_before_a_stop_sequence_is_given_out_and_the_sequence_is_left_out() -> None:
    out, stopped = _run(["Paris"], ["The capital is ", "Paris", ". Yes"])
    assert "".join(out) == "The capital is "
    assert stopped


def test_a_stop_sequence_split_over_tokens_is_found() -> None:
    out, stopped = _run(["Paris"], ["The capital is P", "ar", "is."])
    assert "".join(out) == "The capital is "
    assert stopped


def test_a_stop_sequence_inside_a_token_is_found_in_context() -> None:
    out, stopped = _run(["\n"], ["France", ".\n", "Next"])
    assert "".join(out) == "France."
    assert stopped


def test_text_that_may_begin_a_stop_sequence_is_held_until_it_cannot() -> None:
    matcher = StopMatcher(["Paris"])
    assert matcher.feed("going to Pa") == ""
    assert matcher.feed("ndora") == "going to Pandora"
    assert not matcher.stopped


def test_held_text_is_given_out_at_the_end_when_no_stop_came() -> None:
    out, stopped = _run(["Paris"], ["to Par"])
    assert out == ["to Par"]
    assert not stopped


def test_the_first_of_several_stop_sequences_ends_the_text() -> None:
    out, stopped = _run(["world", "lo"], ["hello world"])
    assert "".join(out) == "hel"
    assert stopped


def test_nothing_is_given_out_after_a_stop() -> None:
    matcher = StopMatcher(["x"])
    assert matcher.feed("abxcd") == "ab"
    assert matcher.feed("more") == ""
    assert matcher.finish() == ""


def test_without_stop_sequences_text_passes_at_once() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("anything") == "anything"
