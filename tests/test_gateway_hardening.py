"""Regressions from the chaos campaign: every accepted request ends, once and promptly,
through replica restarts, Redis restarts, outages and bad input; outages are 503s with a
stable code; no client can hold a connection by trickling its request."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from datetime import datetime

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.protocol import new_request_id
from gateway.protocol.records import replica_name
from gateway.protocol.redis_keys import Shard
from gateway.server import spine
from gateway.server.queue.jobs import Admission, JobStore, NewRequest
from gateway.stack.process import free_port
from gateway.stack.services import redis_spec
from tests.conftest import AUTH, kill_by_pid
from tests.gateway_calls import llm_body, read_events, submit, wait_result

SHARD = Shard(0)  # the local stack has one shard

CLOSED = "127.0.0.1:9"  # nothing listens on the discard port


async def _until(check, timeout: float = 60, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(interval)


async def _state(client: httpx.AsyncClient, request_id: str) -> str:
    return (await client.get(f"/results/{request_id}")).json()["status"]


# -- retries -----------------------------------------------------------------------------


async def test_the_only_replica_restarting_mid_run_serves_the_request_once_it_is_back(stack) -> None:
    triton, triton_url = stack.start_triton("triton-solo")
    gateway, url = stack.start_gateway(
        "gateway-solo", REDIS_URL=stack.redis_db_url(40), **stack.replicas_env(triton_url)
    )
    try:
        async with httpx.AsyncClient(headers=AUTH, base_url=url, timeout=60) as client:
            request_id = await submit(client, llm_body("keep going", 250, timeout_s=180))
            await _until(lambda: _is_running(client, request_id))
            kill_by_pid(triton)
            assert await _state(client, request_id) in ("queued", "running")
            triton.start()
            triton.wait_ready(time.monotonic() + 240)
            ready_at = time.time()
            record = await wait_result(client, request_id, timeout=240)
        assert record["status"] == "succeeded", record.get("error")
        assert record["replica"] == replica_name(triton_url)
        # It started again once the replica was back (the discovery probe notices it within
        # seconds; 60 s leaves room for a loaded machine), not at its deadline (180 s).
        restarted_at = datetime.fromisoformat(record["started_at"]).timestamp()
        assert restarted_at - ready_at < 60
    finally:
        stack.stop(gateway)
        stack.stop(triton)


async def _is_running(client: httpx.AsyncClient, request_id: str) -> bool:
    return await _state(client, request_id) == "running"


async def test_a_prompt_longer_than_the_context_fails_at_once_as_invalid_input(http) -> None:
    # The tiny demo model has a 256-token context; Triton refuses the prompt.
    started = time.monotonic()
    # (The ensemble path: the engine path refuses it before queueing, 422 prompt_too_long.)
    request_id = await submit(http, {**llm_body("word " * 2000, 16), "model": "llm_ensemble"})
    record = await wait_result(http, request_id, timeout=30)
    assert record["status"] == "failed"
    assert record["error"]["code"] == "invalid_input"
    assert record["attempts"] == 1
    assert time.monotonic() - started < 20


# -- Redis and MongoDB outages ------------------------------------------------------------


@pytest.fixture
def own_redis(stack, tmp_path):
    """A Redis of the test's own (so it can be restarted), with its append-only file."""
    port = free_port()
    process = stack.start(redis_spec(data_dir=tmp_path, host="127.0.0.1", port=port, name="redis-own"))
    yield process, f"redis://127.0.0.1:{port}/0"
    stack.stop(process)


async def test_cancel_still_stops_a_running_request_after_redis_restarts(stack, own_redis) -> None:
    redis_process, redis_url = own_redis
    gateway, url = stack.start_gateway("gateway-redis-restart", REDIS_URL=redis_url)
    try:
        async with httpx.AsyncClient(headers=AUTH, base_url=url, timeout=60) as client:
            first = await client.post("/infer", json=llm_body("before", 4), headers={"Prefer": "wait=30"})
            assert first.json()["status"] == "succeeded"

            stack.stop(redis_process)
            redis_process.start()  # same port, same append-only file
            redis_process.wait_ready(time.monotonic() + 30)
            await _until(lambda: _ready(client), timeout=30)

            request_id = await submit(client, llm_body("cancel me after the restart", 250, stream=True))
            await _until(lambda: _is_running(client, request_id), timeout=30)
            cancelled_at = time.monotonic()
            response = await client.post(f"/results/{request_id}/cancel")
            assert response.status_code in (200, 202), response.text
            record = await wait_result(client, request_id, timeout=30)
        assert record["status"] == "canceled"
        assert time.monotonic() - cancelled_at < 5
    finally:
        stack.stop(gateway)


async def _ready(client: httpx.AsyncClient) -> bool:
    return (await client.get("/readyz")).status_code == 200


async def test_submit_while_redis_is_down_is_503_redis_unavailable(stack) -> None:
    gateway, url = stack.start_gateway(
        "gateway-no-redis", ready_path="/healthz", REDIS_URL=f"redis://{CLOSED}/0", REDIS_TIMEOUT_S="1"
    )
    try:
        async with httpx.AsyncClient(headers=AUTH, base_url=url, timeout=30) as client:
            started = time.monotonic()
            response = await client.post("/infer", json=llm_body("hello", 4))
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "redis_unavailable"
            assert "retry-after" in response.headers
            assert time.monotonic() - started < 10
            ready = await client.get("/readyz")
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "redis_unavailable"
    finally:
        stack.stop(gateway)


async def test_results_while_mongodb_is_down_are_503_and_not_ready(stack) -> None:
    gateway, url = stack.start_gateway(
        "gateway-no-mongo",
        ready_path="/healthz",
        REDIS_URL=stack.redis_db_url(41),
        MONGO_URL=f"mongodb://{CLOSED}",
        MONGO_TIMEOUT_S="1",
    )
    try:
        async with httpx.AsyncClient(headers=AUTH, base_url=url, timeout=30) as client:
            started = time.monotonic()
            response = await client.get(f"/results/{new_request_id()}")
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "mongo_unavailable"
            assert time.monotonic() - started < 10
            ready = await client.get("/readyz")
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "mongo_unavailable"
    finally:
        stack.stop(gateway)


# -- Server-Sent Events ---------------------------------------------------------------------


async def test_resuming_after_the_final_event_answers_204_at_once(http) -> None:
    request_id = await submit(http, llm_body("short", 4, stream=True))
    events = await read_events(http, request_id)
    assert events[-1]["event"] == "completed"
    started = time.monotonic()
    response = await http.get(f"/results/{request_id}/events", headers={"Last-Event-ID": events[-1]["id"]})
    assert response.status_code == 204
    assert time.monotonic() - started < 2


@pytest.mark.parametrize("event_id", ["99999999999999999999999-0", "1-18446744073709551616", "-1-0", "1-2-3"])
async def test_a_last_event_id_that_is_not_a_stream_id_is_422(http, event_id: str) -> None:
    request_id = await submit(http, llm_body("short", 4))
    response = await http.get(f"/results/{request_id}/events", headers={"Last-Event-ID": event_id})
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_last_event_id"


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/results/%00abc"),
        ("GET", "/results/x%00/events"),
        ("POST", "/results/a%0Ab/cancel"),
        ("POST", "/results/%7F/webhook/replay"),
    ],
)
async def test_a_control_character_in_a_request_id_is_404(http, method: str, path: str) -> None:
    response = await http.request(method, path)
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "not_found"


async def test_a_stop_word_longer_than_256_characters_is_422(http) -> None:
    body = llm_body("hello", 4)
    body["inputs"]["stop_words"] = ["x" * 257]
    response = await http.post("/infer", json=body)
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_inputs"


_NESTED_TOO_DEEP = {
    "arrays": "[" * 1000 + "]" * 1000,
    "objects": '{"a":' * 1000 + "1" + "}" * 1000,
    "in a field": '{"model": "llm", "inputs": ' + '{"a":' * 1000 + "1" + "}" * 1001,
}


@pytest.mark.parametrize("path", ["/infer", "/v1/chat/completions", "/v1/embeddings"])
@pytest.mark.parametrize("shape", list(_NESTED_TOO_DEEP))
async def test_a_json_body_nested_a_thousand_deep_is_400_not_500(http, path: str, shape: str) -> None:
    body = _NESTED_TOO_DEEP[shape]
    response = await http.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["message"]) == ("bad_request", "the JSON body is nested too deeply")


async def test_tool_call_arguments_nested_a_thousand_deep_are_no_500(http) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "[" * 1000 + "]" * 1000}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ]
    body = {"model": "llm_synthetic", "messages": messages, "max_tokens": 2}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code in (200, 400), response.text


async def test_too_many_stop_words_are_422(http) -> None:
    body = llm_body("hello", 4)
    body["inputs"]["stop_words"] = ["stop"] * 17
    response = await http.post("/infer", json=body)
    assert response.status_code == 422


async def test_a_client_that_never_finishes_its_headers_is_disconnected(stack) -> None:
    gateway, url = stack.start_gateway("gateway-slowloris", ready_path="/healthz", HEADER_TIMEOUT_S="1")
    try:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            started = time.monotonic()
            assert sock.recv(1024) == b""  # the server closed the connection
            assert time.monotonic() - started < 5
    finally:
        stack.stop(gateway)


async def test_headers_over_the_limit_are_431_and_the_gateway_serves_on(http) -> None:
    response = await http.get("/healthz", headers={"X-Big": "a" * 100_000})  # MAX_HEADER_BYTES: 32 KiB
    assert response.status_code == 431, response.text
    assert response.json()["error"]["code"] == "headers_too_large"
    assert (await http.get("/healthz")).status_code == 200


# -- the queue's scripts under client retries ----------------------------------------------------


@pytest.fixture
async def jobs(stack):
    client = aioredis.from_url(stack.redis_db_url(42), decode_responses=True)
    await client.flushdb()
    yield JobStore(client, idempotency_ttl_s=60), client
    await client.aclose()


async def _submit(store: JobStore, request_id: str) -> str:
    now = time.time()
    submitted = await store.submit(
        [NewRequest(request_id, {"inputs": {}}, now, now + 60)],
        model="llm",
        tenant="default",
        band="normal",
        admission=Admission(max_backlog=100, max_batch_backlog=100, max_bytes=10**9),
    )
    return submitted.outcome


async def test_a_submit_replayed_by_a_client_retry_queues_once_and_counts_once(jobs) -> None:
    store, client = jobs
    request_id = new_request_id()
    assert await _submit(store, request_id) == "accepted"
    assert await _submit(store, request_id) == "accepted"  # the same call, replayed
    assert await client.llen(SHARD.queue("llm", "normal", "default")) == 1
    assert await client.hget(SHARD.backlog, "all") == "1"


async def test_cancelling_a_request_whose_state_expired_creates_nothing(jobs) -> None:
    store, client = jobs
    request_id = new_request_id()
    assert await spine.cancel(store, request_id) is None
    assert await client.exists(SHARD.request(request_id)) == 0


async def test_one_broken_request_does_not_stop_the_expiry_of_the_others(stack) -> None:
    redis_url = stack.redis_db_url(43)
    client = aioredis.from_url(redis_url, decode_responses=True)
    await client.flushdb()
    broken = new_request_id()
    await client.hset(SHARD.request(broken), mapping={"state": "no-such-state", "payload": "{not json"})
    await client.zadd(SHARD.deadlines, {broken: time.time() - 10})
    gateway, url = stack.start_gateway(
        "gateway-sweep", ready_path="/healthz", REDIS_URL=redis_url, TRITON_GRPC_URLS=CLOSED
    )
    try:
        async with httpx.AsyncClient(headers=AUTH, base_url=url, timeout=30) as http:
            request_id = await submit(http, llm_body("nobody runs me", 4, timeout_s=1))
            record = await wait_result(http, request_id, timeout=30)
        assert record["status"] == "expired"
        assert record["error"]["code"] == "deadline_exceeded"
    finally:
        stack.stop(gateway)
        await client.aclose()


# -- fencing: a request re-run by another gateway ---------------------------------------------


async def test_a_stream_rerun_by_another_gateway_continues_its_token_indexes(stack) -> None:
    redis_url = stack.redis_db_url(44)
    first, first_url = stack.start_gateway("gateway-fenced-a", REDIS_URL=redis_url)
    async with httpx.AsyncClient(headers=AUTH, base_url=first_url, timeout=60) as client:
        request_id = await submit(client, llm_body("A long story about a gateway", 220, stream=True))
        seen = await read_events(client, request_id, limit=6)
    assert [e["event"] for e in seen][-1] == "token"
    kill_by_pid(first)
    stack.extra.remove(first)
    second, second_url = stack.start_gateway("gateway-fenced-b", REDIS_URL=redis_url)
    try:
        async with httpx.AsyncClient(headers=AUTH, base_url=second_url, timeout=60) as client:
            record = await wait_result(client, request_id, timeout=120)
            events = await read_events(client, request_id)
        assert record["status"] == "succeeded" and record["attempts"] >= 2
        tokens = [json.loads(e["data"]) for e in events if e["event"] == "token"]
        expected = 0
        for token in tokens:  # each event's first index follows the last one's pieces
            assert token["index"] == expected, (token["index"], expected)
            expected += token["count"]
        assert "".join(t["text_output"] for t in tokens) == record["outputs"]["text_output"]
        restarts = [json.loads(e["data"]) for e in events if e["event"] == "running"]
        assert restarts[-1]["restarted"] is True and restarts[-1]["resume_from"] > 0
    finally:
        stack.stop(second)
