"""StopMatcher (gateway/server/llm/stops.py), pure logic: OpenAI's stop sequences matched on
the generated text across piece boundaries, the text ending before the first of them, and
streamed text held back only while its end may begin one, so that no client ever sees text
a stop sequence takes back. (tests/test_stops.py has the first cases; these add the rest.)"""

from __future__ import annotations

import itertools

from gateway.server.llm.stops import StopMatcher


def _given_out(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    """What each feed() gave out, then finish(); and whether a stop sequence was found."""
    matcher = StopMatcher(stops)
    out = [matcher.feed(piece) for piece in pieces]
    out.append(matcher.finish())
    return out, matcher.stopped


def _splits(text: str, parts: int) -> list[list[str]]:
    """Every way to cut `text` into `parts` pieces (empty pieces included, as an engine
    step may decode to no text)."""
    return [
        [text[a:b] for a, b in itertools.pairwise((0, *cuts, len(text)))]
        for cuts in itertools.combinations_with_replacement(range(len(text) + 1), parts - 1)
    ]


TEXT = "The capital of France is Paris. It lies on the Seine."


def test_however_the_text_is_cut_into_pieces_the_text_before_the_stop_comes_out_once() -> None:
    for pieces in _splits(TEXT, 3):
        out, stopped = _given_out(["Paris"], pieces)
        assert "".join(out) == "The capital of France is " and stopped, pieces


def test_without_a_stop_in_the_text_every_character_comes_out_once_in_order() -> None:
    for pieces in _splits("a stop-free answer: Par is", 3):
        out, stopped = _given_out(["Paris", "\n\n"], pieces)
        assert "".join(out) == "a stop-free answer: Par is" and not stopped, pieces


def test_a_stop_at_the_very_start_gives_out_nothing() -> None:
    out, stopped = _given_out(["STOP"], ["STOP and the rest"])
    assert out == ["", ""]
    assert stopped


def test_a_stop_spread_over_three_pieces_is_found() -> None:
    out, stopped = _given_out(["abc"], ["xa", "b", "c", "d"])
    assert out == ["", "", "x", "", ""]
    assert stopped


def test_text_whose_end_cannot_begin_a_stop_is_given_out_at_once() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("hello ") == "hello "
    assert matcher.held == ""


def test_a_false_start_does_not_hide_a_stop_that_begins_inside_it() -> None:
    """After "aa" (which may begin "aab") and "aaa" (still may), the stop starts at the second "a"."""
    matcher = StopMatcher(["aab"])
    assert matcher.feed("aa") == ""
    assert matcher.feed("a") == ""
    assert matcher.feed("b") == "a"
    assert matcher.stopped


def test_held_text_that_turns_out_not_to_be_a_stop_is_given_out_whole() -> None:
    matcher = StopMatcher(["end"])
    assert matcher.feed("the en") == ""
    assert matcher.feed("emy") == "the enemy"
    assert not matcher.stopped


def test_the_stop_earliest_in_the_text_wins_over_one_listed_first() -> None:
    out, stopped = _given_out(["yz", "x"], ["wxyz"])
    assert "".join(out) == "w"
    assert stopped


def test_a_stop_inside_held_text_that_may_begin_a_longer_one_ends_the_text() -> None:
    out, stopped = _given_out(["xyz", "y"], ["wxy"])
    assert "".join(out) == "wx"
    assert stopped


def test_a_stop_of_several_characters_is_found_across_held_pieces() -> None:
    out, stopped = _given_out(["\n\n"], ["a\n", "b\n", "\n", "c"])
    assert "".join(out) == "a\nb"
    assert stopped


def test_empty_stop_strings_are_ignored() -> None:
    assert _given_out(["", "x"], ["axb"]) == (["a", ""], True)
    assert StopMatcher([""]).feed("anything") == "anything"


def test_finish_gives_out_held_text_only_once() -> None:
    matcher = StopMatcher(["Paris"])
    assert matcher.feed("to Par") == ""
    assert matcher.finish() == "to Par"
    assert matcher.finish() == ""


def test_a_stop_fed_after_the_first_gives_out_nothing_more() -> None:
    matcher = StopMatcher(["x", "y"])
    assert matcher.feed("axb") == "a"
    assert matcher.feed("cyd") == ""
    assert matcher.finish() == ""
