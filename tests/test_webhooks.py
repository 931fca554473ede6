"""Signed webhooks, sent by the binder to a real local HTTP receiver."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from ipaddress import ip_address

import pytest
import pytest_asyncio
import uvicorn
from standardwebhooks import Webhook

from binder.webhooks import AddressGuard, Refused, sign
from gateway.stack.process import free_port
from tests.conftest import WEBHOOK_SECRET
from tests.gateway_calls import submit, wait_result


@dataclass
class Call:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float


@dataclass
class Receiver:
    """An ASGI app that records every POST and answers as scripted per path:
    responses[path] is a list of (status, headers) used in turn, then 200."""

    port: int = 0
    calls: list[Call] = field(default_factory=list)
    responses: dict[str, list[tuple[int, dict[str, str]]]] = field(default_factory=dict)
    delays: dict[str, float] = field(default_factory=dict)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.calls.append(Call(path, headers, body, time.time()))
        await asyncio.sleep(self.delays.get(path, 0))
        script = self.responses.get(path) or []
        status, extra = script.pop(0) if script else (200, {})
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(k.encode(), v.encode()) for k, v in extra.items()],
            }
        )
        await send({"type": "http.response.body", "body": b"ok"})

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def to(self, path: str) -> list[Call]:
        return [c for c in self.calls if c.path == path]


@pytest_asyncio.fixture(scope="module")
async def receiver() -> AsyncIterator[Receiver]:
    app = Receiver(port=free_port())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=app.port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    yield app
    server.should_exit = True
    await task


def _path(name: str) -> str:
    return f"/{name}-{time.time_ns()}"


async def _with_webhook(http, url: str) -> str:
    request_id = await submit(http, {"model": "clip_text", "inputs": {"text": "hook"}, "webhook": {"url": url}})
    assert (await wait_result(http, request_id))["status"] == "succeeded"
    return request_id


async def _webhook_status(http, request_id: str, wanted: set[str], timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        record = (await http.get(f"/results/{request_id}")).json()
        if record.get("webhook_status") in wanted:
            return record
        assert time.monotonic() < deadline, f"webhook_status is {record.get('webhook_status')}"
        await asyncio.sleep(0.1)


async def test_the_signature_verifies_with_the_standard_webhooks_package(http, receiver) -> None:
    path = _path("ok")
    request_id = await _with_webhook(http, receiver.url(path))
    record = await _webhook_status(http, request_id, {"delivered"})
    [call] = receiver.to(path)
    payload = Webhook(WEBHOOK_SECRET).verify(call.body, call.headers)
    assert payload["type"] == "request.completed"
    assert payload["data"]["request_id"] == request_id
    assert call.headers["webhook-id"].startswith("msg_")
    assert record["webhook_attempts"][0]["status_code"] == 200


async def test_a_500_then_a_200_delivers_on_retry_with_the_same_webhook_id(http, receiver) -> None:
    path = _path("flaky")
    receiver.responses[path] = [(500, {})]
    request_id = await _with_webhook(http, receiver.url(path))
    record = await _webhook_status(http, request_id, {"delivered"})
    calls = receiver.to(path)
    assert len(calls) == 2
    assert calls[0].headers["webhook-id"] == calls[1].headers["webhook-id"]
    assert [a["status_code"] for a in record["webhook_attempts"]] == [500, 200]


async def test_410_gone_stops_the_retries(http, receiver) -> None:
    path = _path("gone")
    receiver.responses[path] = [(410, {})]
    request_id = await _with_webhook(http, receiver.url(path))
    record = await _webhook_status(http, request_id, {"gone"})
    await asyncio.sleep(1.5)  # longer than the whole test retry schedule
    assert len(receiver.to(path)) == 1
    assert len(record["webhook_attempts"]) == 1


async def test_retry_after_is_honoured(http, receiver) -> None:
    path = _path("busy")
    receiver.responses[path] = [(503, {"retry-after": "2"})]
    request_id = await _with_webhook(http, receiver.url(path))
    await _webhook_status(http, request_id, {"delivered"})
    first, second = receiver.to(path)
    assert second.at - first.at >= 1.9  # not the 0.3 s of the schedule


async def test_an_address_that_is_not_allowlisted_is_refused_and_recorded(http, receiver) -> None:
    request_id = await _with_webhook(http, "http://169.254.169.254/latest/meta-data")
    record = await _webhook_status(http, request_id, {"refused"})
    assert "not a public address" in record["webhook_attempts"][0]["error"]
    assert len(record["webhook_attempts"]) == 1


async def test_one_slow_receiver_does_not_delay_the_others(http, receiver) -> None:
    slow, fast = _path("slow"), _path("fast")
    receiver.delays[slow] = 6.0
    await _with_webhook(http, receiver.url(slow))
    fast_id = await _with_webhook(http, receiver.url(fast))
    finished = time.time()
    await _webhook_status(http, fast_id, {"delivered"}, timeout=5)
    assert receiver.to(fast)[0].at - finished < 2.0
    assert len(receiver.to(slow)) == 1


async def test_replay_sends_the_stored_webhook_again_with_the_same_id(http, receiver) -> None:
    path = _path("replay")
    request_id = await _with_webhook(http, receiver.url(path))
    await _webhook_status(http, request_id, {"delivered"})
    response = await http.post(f"/results/{request_id}/webhook/replay")
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 10
    while len(receiver.to(path)) < 2:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    first, again = receiver.to(path)
    assert first.headers["webhook-id"] == again.headers["webhook-id"]
    assert json.loads(again.body)["data"]["request_id"] == request_id


async def test_replay_of_a_request_without_webhook_is_409(http) -> None:
    request_id = await submit(http, {"model": "clip_text", "inputs": {"text": "no hook"}})
    await wait_result(http, request_id)
    await asyncio.sleep(0.5)  # stored
    response = await http.post(f"/results/{request_id}/webhook/replay")
    assert response.status_code == 409


def test_each_secret_during_a_rotation_verifies_the_signature() -> None:
    old, new = WEBHOOK_SECRET, "whsec_" + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldY"
    now = datetime.now(UTC)
    header = sign([new, old], "msg_1", now, '{"a":1}')
    headers = {"webhook-id": "msg_1", "webhook-timestamp": str(int(now.timestamp())), "webhook-signature": header}
    for secret in (old, new):
        assert Webhook(secret).verify('{"a":1}', headers) == {"a": 1}


async def test_the_address_guard_allows_public_and_allowlisted_addresses_only() -> None:
    guard = AddressGuard(["10.1.0.0/16", "hooks.internal"])
    assert guard._allowed("example.com", ip_address("93.184.216.34"))
    assert guard._allowed("x", ip_address("10.1.2.3"))
    assert guard._allowed("hooks.internal", ip_address("192.168.1.5"))
    for private in ("127.0.0.1", "10.2.0.1", "192.168.1.5", "169.254.169.254", "::1", "::ffff:127.0.0.1"):
        assert not guard._allowed("x", ip_address(private)), private
    with pytest.raises(Refused):
        await AddressGuard([]).resolve("http://localhost:9/hook")
