"""The typed script calls (queue/scripts/: one dataclass a call, its fields one JSON argument
read by name in Lua) carry what they carry unchanged: text that JSON escapes, times past a
Lua number's 14 digits, absent fields (never JSON null, which cjson decodes to a true
value), and the blobs that go beside the JSON as they are."""

from __future__ import annotations

import json
import time

from gateway.protocol import State, new_request_id
from gateway.protocol.redis_keys import Shard
from gateway.server.queue import scripts
from gateway.server.queue.jobs import Admission, Job, JobStore, NewRequest, TokenEvent
from gateway.server.queue.scripts.keys import number_text, script_json

SHARD = Shard(0)
OPEN = Admission(max_backlog=10_000, max_batch_backlog=10_000, max_bytes=10**9, reserve=4)
# Quotes, a backslash, control characters, CJK, an emoji, a lone JSON escape's look-alike.
AWKWARD = 'a "quote" \\ back\nslash\t\u0001 猫 🐈 \\u0041 </script>'


async def _started(store: JobStore, created_at: float) -> Job:
    new = NewRequest(new_request_id(created_at), {"inputs": {"text": AWKWARD}}, created_at, created_at + 60)
    submitted = await store.submit([new], model="m", tenant="t", band="normal", admission=OPEN, start_as="c1")
    assert submitted.outcome == "started"
    job = await store.load(new.request_id)
    assert job is not None
    return job


def test_a_field_that_is_none_is_left_out_not_sent_as_null() -> None:
    assert json.loads(script_json({"run": None, "emitted": 0, "output": False})) == {"emitted": 0, "output": False}
    item = scripts.FinishItem("id", "m", "t", "canceled", "canceled", "{}", 1.5, ("queued",))
    fields, record = item.args()
    assert "null" not in fields and record == "{}"


def test_times_go_as_the_text_redis_py_sent() -> None:
    assert number_text(1764364462.1234567) == "1764364462.1234567"
    assert number_text(12) == "12"


async def test_a_payload_and_times_are_stored_as_they_were_sent(store: JobStore) -> None:
    created_at = 1764364462.1234567  # 17 digits: a Lua number would keep 14
    job = await _started(store, created_at)
    h = await store.redis.hgetall(SHARD.request(job.request_id))
    assert h["created_at"] == repr(created_at) and h["deadline"] == repr(created_at + 60)
    assert json.loads(h["payload"]) == {"inputs": {"text": AWKWARD}}
    assert int(h["size"]) == len(h["payload"].encode())


async def test_token_text_that_json_escapes_arrives_as_it_was_sent(store: JobStore) -> None:
    job = await _started(store, time.time())
    ids = [2**31 - 1, 0, 50256]
    emitted = await store.emit(job.request_id, job.run, 0, AWKWARD, 2, ids)
    assert emitted.outcome == "ok" and emitted.emitted == 2
    entries = await store.redis.xrange(SHARD.events(job.request_id))
    token = [fields for _, fields in entries if fields["event"] == "token"]
    assert json.loads(token[0]["data"]) == {"index": 0, "count": 2, "text_output": AWKWARD}
    assert await store.redis.get(SHARD.tokens(job.request_id)) == "2147483647,0,50256,"


async def test_a_finish_without_a_run_or_a_stream_applies(store: JobStore) -> None:
    now = time.time()
    new = NewRequest(new_request_id(now), {"inputs": {}}, now, now + 60)
    await store.submit([new], model="m", tenant="t", band="normal", admission=OPEN)
    job = await store.load(new.request_id)
    assert job is not None
    record = job.record(State.CANCELED, finished_at=1764364499.9876543)
    assert record.finished_at is not None
    assert isinstance(await store.finish(record, allowed=(State.QUEUED,)), str)  # run, emitted: None
    h = await store.redis.hgetall(SHARD.request(job.request_id))
    assert h["state"] == "canceled" and h["finished_at"] == repr(record.finished_at.timestamp())


async def test_an_emit_of_no_events_answers_nothing(store: JobStore) -> None:
    assert await store.emit_many(SHARD, []) == []


async def test_renew_and_hand_over_read_their_runs_by_name(store: JobStore) -> None:
    job = await _started(store, time.time())
    assert await store.renew(SHARD, "c1", [(job.request_id, job.run)]) == [1]
    assert await store.renew(SHARD, "c1", [(job.request_id, "another run")]) == [0]
    assert await store.handover("c1", [(job.request_id, job.run)]) == 1
    assert await store.redis.lrange(SHARD.reclaimed("m"), 0, -1) == [job.request_id]


def test_token_event_ids_go_as_the_text_emit_appends() -> None:
    event = TokenEvent("id", "run", 0, "x", 1, [1, 2])
    (arg,) = scripts.Emit(SHARD, (event,)).args()
    assert json.loads(arg)["events"] == [{"run": "run", "index": 0, "count": 1, "text": "x", "ids": "1,2,"}]
