"""Signed webhooks, sent by the binder to a real local HTTP receiver."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from ipaddress import ip_address

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import uvicorn
from pydantic import ValidationError
from standardwebhooks import Webhook

from binder.settings import BinderSettings
from binder.webhooks import AddressGuard, Refused, sign
from gateway.common.result_store import RESULTS_COLLECTION
from gateway.stack.process import LaunchError, free_port
from tests.conftest import WEBHOOK_SECRET
from tests.gateway_calls import submit, wait_result
from tests.records import publish, text_record


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
    assert guard.refusal("example.com", ip_address("93.184.216.34"), 443) is None
    assert guard.refusal("x", ip_address("10.1.2.3"), 8080) is None
    assert guard.refusal("hooks.internal", ip_address("192.168.1.5"), 9000) is None
    for private in ("127.0.0.1", "10.2.0.1", "192.168.1.5", "169.254.169.254", "::1", "::ffff:127.0.0.1", "fec0::1"):
        assert guard.refusal("x", ip_address(private), 443), private
    with pytest.raises(Refused):
        await AddressGuard([]).resolve("http://localhost:9/hook")


def test_nat64_counts_as_its_embedded_ipv4_and_6to4_teredo_and_multicast_are_refused() -> None:
    guard = AddressGuard([])
    assert guard.refusal("x", ip_address("64:ff9b::5db8:d822"), 443) is None  # NAT64 of 93.184.216.34
    refused = {
        "64:ff9b::7f00:1": "NAT64 address of 127.0.0.1",
        "64:ff9b:1::5db8:d822": "local-use NAT64",
        "2002:5db8:d822::1": "6to4",
        "2001:0:4136:e378:8000:63bf:3fff:fdd2": "Teredo",
        "ff0e::1": "multicast",
        "224.0.0.1": "multicast",
        "::7f00:1": "not a public address",
    }
    for address, why in refused.items():
        assert why in (guard.refusal("x", ip_address(address), 443) or ""), address


def test_allowlist_entries_with_a_port_allow_only_that_port() -> None:
    guard = AddressGuard(["127.0.0.1:8080", "[fd00::/8]:8443", "hooks.internal:9000", "*:8443"])
    assert guard.refusal("127.0.0.1", ip_address("127.0.0.1"), 8080) is None
    assert guard.refusal("127.0.0.1", ip_address("127.0.0.1"), 8081)
    assert guard.refusal("x", ip_address("fd00::1"), 8443) is None
    assert guard.refusal("hooks.internal", ip_address("10.0.0.1"), 9000) is None
    assert guard.refusal("hooks.internal", ip_address("10.0.0.1"), 443)
    assert guard.refusal("example.com", ip_address("93.184.216.34"), 8443) is None  # `*:8443`: public only
    assert "port 8080 is not allowed" in (guard.refusal("example.com", ip_address("93.184.216.34"), 8080) or "")
    assert "not a public address" in (guard.refusal("x", ip_address("10.0.0.1"), 8443) or "")


def test_an_allowlist_entry_that_does_not_parse_is_a_settings_error() -> None:
    with pytest.raises(ValidationError, match="is not a port"):
        BinderSettings(webhook_allowlist=["10.0.0.1:http"])


async def test_a_host_with_a_64_character_label_is_recorded_as_a_refused_attempt(http) -> None:
    request_id = await _with_webhook(http, f"http://{'a' * 64}.example.com/hook")
    record = await _webhook_status(http, request_id, {"refused"})
    [attempt] = record["webhook_attempts"]
    assert "invalid host name" in attempt["error"]


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://[64:ff9b::7f00:1]/hook", "NAT64 address of 127.0.0.1"),
        ("http://[64:ff9b:1::7f00:1]/hook", "local-use NAT64"),
        ("http://[2002:7f00:1::1]/hook", "6to4"),
        ("http://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/hook", "Teredo"),
        ("http://[ff0e::1]/hook", "multicast"),
        ("http://224.0.0.251/hook", "multicast"),
        ("http://93.184.216.34:8080/hook", "port 8080 is not allowed"),
    ],
)
async def test_a_tunnelled_multicast_or_non_default_port_destination_is_refused_and_recorded(
    http, url: str, why: str
) -> None:
    request_id = await _with_webhook(http, url)
    record = await _webhook_status(http, request_id, {"refused"})
    [attempt] = record["webhook_attempts"]
    assert attempt["error"].startswith("refused: ") and why in attempt["error"]


# -- binders started by the tests below, on Redis databases and MongoDB databases of their own


@pytest.fixture
def isolated(stack) -> dict[str, str]:
    number = next(_databases)
    return {"REDIS_URL": stack.redis_db_url(number), "MONGO_DB": f"webhooks_test_{number}_{time.time_ns()}"}


_databases = itertools.count(46)


async def _stored_webhook(mongo, database: str, request_id: str, wanted: set[str], timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        document = await mongo[database][RESULTS_COLLECTION].find_one({"_id": request_id})
        if document and document.get("webhook_status") in wanted:
            return document
        assert time.monotonic() < deadline, f"webhook_status is {document and document.get('webhook_status')}"
        await asyncio.sleep(0.1)


@dataclass
class Trickler:
    """A raw HTTP receiver that reads the request, then sends its status line one byte
    every `every_s` seconds: each read of the sender succeeds, the answer takes ~half an
    hour. Records when each connection opened and when the sender closed it."""

    every_s: float = 0.2
    connections: list[tuple[float, float | None]] = field(default_factory=list)  # (opened, closed)
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = len(self.connections)
        self.connections.append((time.monotonic(), None))
        trickle = asyncio.create_task(self._trickle(reader, writer))
        try:
            await trickle
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the sender gave up on us
        finally:
            self.connections[number] = (self.connections[number][0], time.monotonic())
            writer.close()

    async def _trickle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        found = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        await reader.readexactly(int(found.group(1)) if found else 0)
        closed = asyncio.create_task(reader.read())  # b"" once the sender closes the connection
        for byte in b"HTTP/1.1 200 OK\r\nx-slow: " + b"." * 10_000:
            writer.write(bytes([byte]))
            await writer.drain()
            try:
                await asyncio.wait_for(asyncio.shield(closed), self.every_s)
                return
            except TimeoutError:
                pass
        closed.cancel()

    def overlapping(self) -> bool:
        spans = sorted((opened, closed or float("inf")) for opened, closed in self.connections)
        return any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans))


async def test_a_trickling_receiver_gets_one_connection_per_attempt_and_no_duplicate(stack, mongo, isolated) -> None:
    trickler = Trickler()
    server = await asyncio.start_server(trickler.handle, "127.0.0.1", 0)
    trickler.port = server.sockets[0].getsockname()[1]
    lease_s = 3.0
    process, _ = stack.start_binder(
        "binder-trickle",
        WEBHOOK_LEASE_S=str(lease_s),
        WEBHOOK_TIMEOUT_S="1.5",
        WEBHOOK_RETRY_SCHEDULE="0,0.5",
        **isolated,
    )
    redis = aioredis.from_url(isolated["REDIS_URL"], decode_responses=True)
    try:
        record = text_record(webhook=f"http://127.0.0.1:{trickler.port}/slow")
        await publish(redis, [record])
        document = await _stored_webhook(mongo, isolated["MONGO_DB"], record.request_id, {"failed"})
        attempts = document["webhook_attempts"]
        assert len(attempts) == 2
        assert all("attempt deadline" in attempt["error"] for attempt in attempts)
        # Past the lease of the last attempt: had an attempt outlived its lease, the
        # delivery would have been claimed again and sent once more by now.
        deadline = time.monotonic() + lease_s + 1
        while time.monotonic() < deadline and len(trickler.connections) == len(attempts):
            await asyncio.sleep(0.1)
        assert len(trickler.connections) == len(attempts)
        assert not trickler.overlapping()
    finally:
        stack.stop(process)
        server.close()
        await redis.aclose()


def test_an_invalid_signing_secret_stops_the_binder_at_start_with_one_line(stack) -> None:
    name = f"binder-bad-secret-{time.time_ns()}"
    with pytest.raises(LaunchError, match="exited with code 2"):
        stack.start_binder(name, WEBHOOK_SECRETS="whsec_REPLACE_ME")
    lines = (stack.data_dir / "logs" / f"{name}.log").read_text().strip().splitlines()
    assert lines == [
        "binder: invalid settings: WEBHOOK_SECRETS: secret 1 of 1 is not base64 after whsec_ "
        "(expected whsec_ and the base64 of 24 to 64 random bytes)"
    ]
