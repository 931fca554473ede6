"""Event ids of the SSE streams (gateway/server/results/events.py, pure logic): an entry of
the events stream may hold two events (a request started at once: `queued` and `running`;
a request's end: `output` and its terminal event); the one it carries before its own has
the id `<entry>-0`, which sorts before the entry's own, so Last-Event-ID resumes between
them."""

from __future__ import annotations

from gateway.protocol.redis_keys import Shard
from gateway.server.results.events import EventHub, StreamEvent, _Follower, _ShardReader, event_order, read_after


def _fanned_out(after: str, entries: list) -> list[StreamEvent]:
    reader = _ShardReader(Shard(0))
    follower = _Follower("k", after)
    reader.followers["k"] = {follower}
    EventHub._fan_out(reader, "k", entries)
    events = []
    while not follower.queue.empty():
        event = follower.queue.get_nowait()
        assert event is not None
        events.append(event)
    return events


STARTED_AT_ONCE = ("5-0", [("queued", "q"), ("running", "r")], None)
ENDED = ("6-2", [("output", "o"), ("completed", "c")], None)


def test_an_entry_of_two_events_is_read_as_both_each_with_its_own_id() -> None:
    events = _fanned_out("0-0", [STARTED_AT_ONCE, ENDED])
    assert [(e.id, e.kind, e.data) for e in events] == [
        ("5-0-0", "queued", "q"),
        ("5-0", "running", "r"),
        ("6-2-0", "output", "o"),
        ("6-2", "completed", "c"),
    ]


def test_resuming_after_the_first_event_of_an_entry_gives_its_second() -> None:
    assert [e.id for e in _fanned_out("6-2-0", [STARTED_AT_ONCE, ENDED])] == ["6-2"]
    assert [e.id for e in _fanned_out("5-0-0", [STARTED_AT_ONCE, ENDED])] == ["5-0", "6-2-0", "6-2"]


def test_resuming_after_an_entrys_own_event_gives_what_follows_it() -> None:
    assert [e.id for e in _fanned_out("5-0", [STARTED_AT_ONCE, ENDED])] == ["6-2-0", "6-2"]
    assert _fanned_out("6-2", [STARTED_AT_ONCE, ENDED]) == []


def test_the_event_an_entry_carries_sorts_between_the_entry_before_and_its_own() -> None:
    assert event_order("4-9") < event_order("5-0-0") < event_order("5-0") < event_order("5-1-0")


def test_the_events_after_a_carried_one_are_read_from_just_before_its_entry() -> None:
    assert read_after("5-3") == "5-3"
    assert read_after("5-3-0") == "5-2"
    assert read_after("5-0-0") == f"4-{(1 << 64) - 1}"
    assert read_after("0-0-0") == "0-0"
