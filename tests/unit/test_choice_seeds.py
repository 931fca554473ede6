"""The seeds of n choices (gateway/server/calls/requests.py's `seeds`), pure logic: the call's
seed + i, so n choices are n distinct draws and the same call repeats them."""

from __future__ import annotations

from gateway.server.calls.requests import seeds


def test_each_choice_gets_the_calls_seed_plus_its_index() -> None:
    assert seeds(1234, 3) == [1234, 1235, 1236]


def test_the_same_seed_gives_the_same_seeds_again() -> None:
    assert seeds(7, 4) == seeds(7, 4)


def test_the_same_idempotency_key_gives_the_same_distinct_seeds() -> None:
    first = seeds(None, 3, key="retry-me")
    assert first == seeds(None, 3, key="retry-me") != seeds(None, 3, key="another")
    assert len(set(first)) == 3


def test_an_explicit_seed_wins_over_the_key() -> None:
    assert seeds(5, 2, key="retry-me") == [5, 6]


def test_without_a_seed_or_key_the_submission_picks_the_seeds() -> None:
    assert seeds(None, 2) == [None, None]


def test_seeds_wrap_below_2_to_the_63() -> None:
    assert seeds(2**63 - 1, 2) == [2**63 - 1, 0]
