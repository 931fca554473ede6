"""What storage cannot hold, against the real stack: a number past 64 bits in a tool's schema
is refused at validation on every API that takes tools (400 under /v1, 422 natively, code
`unstorable_number`, naming where the number is); a result MongoDB cannot store ends as
failed (`result_unstorable`) for the caller's poll and its webhook, and its dead letter is a
reference that expires."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import redis.asyncio as aioredis

from gateway.common.result_store import RESULT_UNSTORABLE
from gateway.common.streams import Entry, StreamConsumer
from gateway.protocol import ResultRecord, State, WebhookSpec, new_request_id, utc
from gateway.protocol.redis_keys import BINDER_GROUP, Shard, webhook_slot
from gateway.protocol.storable import NESTING_MOST, UNSTORABLE_NESTING, UNSTORABLE_NUMBER

HUGE = 100000000000000000000  # the schema: `"maximum": 100000000000000000000`
SCHEMA = {
    "type": "object",
    "properties": {"count": {"type": "integer", "minimum": 0, "maximum": HUGE}},
    "required": ["count"],
}
TOOLS_MODEL = "llm_synthetic"  # (a tool's description needs more context than the tiny GPT-2 has)
WHERE = "properties.count.maximum is 100000000000000000000"


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 60, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(interval)


async def test_an_unstorable_number_in_a_tool_schema_is_refused_on_v1_responses(http) -> None:
    body = {
        "model": TOOLS_MODEL,
        "input": "How many?",
        "tools": [{"type": "function", "name": "count", "parameters": SCHEMA}],
        "max_output_tokens": 8,
    }
    response = await http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text  # was a 500 (the response store's OverflowError)
    error = response.json()["error"]
    assert error["code"] == UNSTORABLE_NUMBER and error["param"] == "tools.0.parameters"
    assert WHERE in error["message"]


async def test_an_unstorable_number_in_a_tool_schema_is_refused_on_v1_chat_completions(http) -> None:
    body = {
        "model": TOOLS_MODEL,
        "messages": [{"role": "user", "content": "How many?"}],
        "tools": [{"type": "function", "function": {"name": "count", "parameters": SCHEMA}}],
        "max_tokens": 8,
    }
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == UNSTORABLE_NUMBER and error["param"] == "tools.0.function.parameters"
    assert WHERE in error["message"]


def _nested(levels: int) -> dict[str, Any]:
    """A tool schema whose properties nest `levels` objects deep."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


async def test_a_tool_schema_nested_past_what_storage_holds_is_refused_on_v1_responses(http) -> None:
    body = {
        "model": TOOLS_MODEL,
        "input": "Deep?",
        "tools": [{"type": "function", "name": "deep", "parameters": _nested(60)}],
        "max_output_tokens": 8,
    }
    response = await http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text  # was a 503 mongo_unavailable (MongoDB: 100 levels)
    error = response.json()["error"]
    assert error["code"] == UNSTORABLE_NESTING and error["param"] == "tools.0.parameters"
    assert f"more than {NESTING_MOST} levels" in error["message"]


async def test_a_tool_schema_nested_past_what_storage_holds_is_refused_on_infer(http) -> None:
    inputs = {
        "messages": [{"role": "user", "content": "Deep?"}],
        "tools": [{"type": "function", "function": {"name": "deep", "parameters": _nested(60)}}],
        "max_tokens": 8,
    }
    response = await http.post("/infer", json={"model": TOOLS_MODEL, "inputs": inputs})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == UNSTORABLE_NESTING


async def test_an_unstorable_number_in_a_tool_schema_is_refused_on_infer(http) -> None:
    inputs = {
        "messages": [{"role": "user", "content": "How many?"}],
        "tools": [{"type": "function", "function": {"name": "count", "parameters": SCHEMA}}],
        "max_tokens": 8,
    }
    response = await http.post("/infer", json={"model": TOOLS_MODEL, "inputs": inputs})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == UNSTORABLE_NUMBER
    assert "tools.0.function.parameters" in error["message"] and WHERE in error["message"]


# FINISH as it leaves a request that ended: its record on the results stream, and the hash
# naming it (one script, so the binder cannot read the entry before the hash names it).
# KEYS: results stream, request hash. ARGV: id, record, tenant, model, created_at.
_FINISHED = """
local entry = redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 'record', ARGV[2])
redis.call('HSET', KEYS[2], 'state', 'succeeded', 'tenant', ARGV[3], 'model', ARGV[4],
           'created_at', ARGV[5], 'finished_at', ARGV[5], 'result', entry, 'payload', '')
return entry
"""


async def _tenant(http: httpx.AsyncClient) -> str:
    response = await http.post(
        "/infer", json={"model": "text_embed", "inputs": {"text": "whose?"}}, headers={"Prefer": "wait=60"}
    )
    assert response.status_code == 200, response.text
    return str(response.json()["tenant"])


async def test_a_result_mongodb_cannot_store_ends_failed_for_the_poll_and_the_webhook(http, redis) -> None:
    tenant = await _tenant(http)
    now = time.time()
    record = ResultRecord(
        request_id=new_request_id(now),
        model="llm",
        status=State.SUCCEEDED,
        tenant=tenant,
        inputs={"text_input": "prompt"},
        outputs={"text_output": "counted", "count": 2**70},  # BSON cannot encode it
        created_at=utc(now - 0.05),
        finished_at=utc(now),
        attempts=1,
        webhook=WebhookSpec(url="http://127.0.0.1:9/hook", events=["failed"]),
    )
    shard = Shard(0)  # the local stack has one shard
    rid = record.request_id
    await redis.eval(
        _FINISHED, 2, shard.results, shard.request(rid), rid, record.model_dump_json(), tenant, "llm", str(now)
    )

    async def failed() -> bool:
        response = await http.get(f"/results/{rid}")
        return response.status_code == 200 and response.json()["status"] == "failed"

    await until(failed, timeout=60)  # the old code answered succeeded, then 404 once trimmed
    answer = (await http.get(f"/results/{rid}")).json()
    assert answer["error"]["code"] == RESULT_UNSTORABLE and "unencodable" in answer["error"]["message"]
    assert answer["outputs"] is None and answer["inputs"] == {}

    async def stored() -> bool:
        return (await redis.hget(shard.request(rid), "stored")) == "1"

    await until(stored, timeout=30)  # the failed record is stored as any other
    # Its webhook: a delivery of the `failed` event (the receiver is nobody; the delivery exists).
    delivery = webhook_slot(tenant, 1).delivery(f"{rid}:failed")
    assert (await redis.hget(delivery, "event")) == "failed"
    # The dead letter names it, without the record, and expires.
    dead = [fields for _, fields in await redis.xrange(shard.results_dead) if fields.get("id") == rid]
    assert len(dead) == 1 and "fields" not in dead[0] and "(unencodable)" in dead[0]["error"]
    assert await redis.ttl(shard.results_dead) > 0


async def test_dead_letters_are_kept_for_their_time_and_bounded(stack) -> None:
    client = aioredis.from_url(stack.redis_db_url(14), decode_responses=True)
    try:
        await client.flushdb()
        consumer = StreamConsumer(client, BINDER_GROUP, "test", "dead", 1000, 3, dead_letter_keep_s=60)
        await consumer.ensure_group("live")
        old = int((time.time() - 3600) * 1000)  # an hour old: past its time
        await client.xadd("dead", {"id": "old", "error": "parked long ago"}, id=f"{old}-0")
        entry_id = await client.xadd("live", {"id": "r1", "record": "x" * 10_000})
        await consumer.read({"live": 10}, block_ms=None)
        await consumer.dead_letter(
            Entry("live", entry_id, {"id": "r1", "record": "x" * 10_000}), "bad", replayable=False
        )
        parked = await client.xrange("dead")
        assert [fields["id"] for _, fields in parked] == ["r1"]  # the old one trimmed by age
        assert "fields" not in parked[0][1] and len(str(parked[0][1])) < 500  # by reference
        assert 0 < await client.ttl("dead") <= 60
        assert (await client.xpending("live", BINDER_GROUP))["pending"] == 0
        replayable: dict[str, Any] = {"id": "r2", "record": "{}"}
        second = await client.xadd("live", replayable)
        await consumer.read({"live": 10}, block_ms=None)
        await consumer.dead_letter(Entry("live", second, replayable), "retried too often")
        assert (await client.xrange("dead"))[-1][1]["fields"] == '{"id": "r2", "record": "{}"}'
    finally:
        await client.flushdb()
        await client.aclose()
