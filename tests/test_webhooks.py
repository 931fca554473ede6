"""Signed webhooks, sent by the binder to a real local HTTP receiver: signed with the
tenant's own secrets (all of them, for rotation) or those derived for it from the
deployment's; retried, guarded; replayed on request, a few times a minute per tenant.
Deliveries in Redis refer to the stored record (the body is made from it when sent),
spread over the shards, and expire once they have ended."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from ipaddress import ip_address

import httpx
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import uvicorn
from pydantic import ValidationError
from pymongo import AsyncMongoClient
from standardwebhooks import Webhook, WebhookVerificationError

from binder.settings import BinderSettings
from binder.webhooks import AddressGuard, Refused, sign
from binder.webhooks.secrets import SecretsUnavailable, TenantSecrets
from binder.webhooks.sender import retry_at
from gateway.common.result_store import RESULTS_COLLECTION
from gateway.common.webhooks import enqueue_delivery
from gateway.protocol import new_request_id
from gateway.protocol.records import TENANTS_COLLECTION
from gateway.protocol.redis_keys import all_shards, shard_for_tenant, webhook_slot
from gateway.stack.process import LaunchError, free_port
from tests.conftest import AUTH, WEBHOOK_SECRET, webhook_secret_of
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
    holds: dict[str, asyncio.Event] = field(default_factory=dict)  # answer once set

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
        if path in self.holds:
            await self.holds[path].wait()
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
    payload = Webhook(webhook_secret_of("local")).verify(call.body, call.headers)  # the `http` key's tenant
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
    receiver.holds[slow] = asyncio.Event()  # the slow receiver answers only when let go
    try:
        slow_id = await _with_webhook(http, receiver.url(slow))
        await _calls(receiver, slow, 1)  # its delivery is under way, unanswered
        fast_id = await _with_webhook(http, receiver.url(fast))
        await _webhook_status(http, fast_id, {"delivered"}, timeout=30)
        # Delivered while the slow one's attempt was still open (an attempt is recorded when it
        # ends: here only when let go, or at the binder's 15 s timeout): nothing waited for it.
        held = (await http.get(f"/results/{slow_id}")).json()
        assert held["webhook_attempts"] == [] and held["webhook_status"] != "delivered", held
    finally:
        receiver.holds[slow].set()
    assert (await _webhook_status(http, slow_id, {"delivered"}))["webhook_attempts"][0]["attempt"] == 1
    assert (len(receiver.to(slow)), len(receiver.to(fast))) == (1, 1)


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
    deadline = time.monotonic() + 30
    while (response := await http.post(f"/results/{request_id}/webhook/replay")).status_code == 404:
        assert time.monotonic() < deadline, "the result was never stored"  # the binder replays stored ones
        await asyncio.sleep(0.05)
    assert response.status_code == 409


# -- tenants' own secrets, and replays (each test a tenant of its own, made through the admin API)

# The stack binder's defaults (binder/settings.py).
REPLAYS_PER_MINUTE = 10
TENANT_SECRETS_CACHE_S = 5.0


def _new_secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


async def _tenant(stack, webhook_secrets: list[str] | None = None) -> tuple[str, httpx.AsyncClient]:
    """A new tenant (given its own webhook secrets when some are named) and a client with a user key of it."""
    tenant = f"hooks-{time.time_ns()}"
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH, timeout=60) as admin:
        response = await admin.post("/admin/keys", json={"tenant": tenant, "name": "webhook test"})
        assert response.status_code == 201, response.text
        key = response.json()["key"]
        if webhook_secrets is not None:
            await _set_secrets(admin, tenant, webhook_secrets)
    return tenant, httpx.AsyncClient(base_url=stack.gateway_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


async def _set_secrets(admin: httpx.AsyncClient, tenant: str, secrets: list[str]) -> None:
    response = await admin.put(f"/admin/tenants/{tenant}", json={"webhook_secrets": secrets})
    assert response.status_code == 200, response.text
    assert response.json()["webhook_secrets"] == len(secrets)  # how many, never the secrets


def _verifies(secret: str, call: Call) -> bool:
    try:
        Webhook(secret).verify(call.body, call.headers)
    except WebhookVerificationError:
        return False
    return True


async def _calls(receiver: Receiver, path: str, count: int, timeout: float = 15) -> list[Call]:
    deadline = time.monotonic() + timeout
    while len(receiver.to(path)) < count:
        assert time.monotonic() < deadline, f"{len(receiver.to(path))} calls to {path}, not {count}"
        await asyncio.sleep(0.05)
    return receiver.to(path)


async def test_a_tenant_with_its_own_secret_gets_webhooks_that_verify_with_it_and_not_with_the_deployments(
    stack, receiver
) -> None:
    secret = _new_secret()
    path = _path("own-secret")
    _, client = await _tenant(stack, [secret])
    async with client:
        request_id = await _with_webhook(client, receiver.url(path))
        await _webhook_status(client, request_id, {"delivered"})
    [call] = receiver.to(path)
    assert Webhook(secret).verify(call.body, call.headers)["data"]["request_id"] == request_id
    assert not _verifies(WEBHOOK_SECRET, call)


async def test_a_tenant_without_secrets_of_its_own_gets_webhooks_signed_with_its_derived_secret(
    stack, receiver
) -> None:
    _, beside = await _tenant(stack, [_new_secret()])  # another tenant has secrets of its own
    await beside.aclose()
    path = _path("derived-secret")
    tenant, client = await _tenant(stack)
    async with client:
        request_id = await _with_webhook(client, receiver.url(path))
        await _webhook_status(client, request_id, {"delivered"})
    [call] = receiver.to(path)
    assert _verifies(webhook_secret_of(tenant), call)
    assert not _verifies(WEBHOOK_SECRET, call)  # the deployment's own secret signs no tenant's


async def test_during_a_rotation_either_of_a_tenants_two_secrets_verifies(stack, receiver) -> None:
    new, old = _new_secret(), _new_secret()
    path = _path("rotation")
    _, client = await _tenant(stack, [new, old])
    async with client:
        request_id = await _with_webhook(client, receiver.url(path))
        await _webhook_status(client, request_id, {"delivered"})
    [call] = receiver.to(path)
    assert len(call.headers["webhook-signature"].split()) == 2  # one v1 signature per secret
    assert _verifies(new, call) and _verifies(old, call)
    assert not _verifies(WEBHOOK_SECRET, call)


async def test_a_retry_after_a_rotation_is_signed_with_the_new_secret(stack, receiver) -> None:
    old, new = _new_secret(), _new_secret()
    path = _path("rotated-retry")
    # The first attempt is held until the rotation is saved, then answered 503 with a
    # Retry-After longer than the binder keeps a tenant's secrets.
    receiver.holds[path] = asyncio.Event()
    receiver.responses[path] = [(503, {"retry-after": str(int(TENANT_SECRETS_CACHE_S) + 1)})]
    tenant, client = await _tenant(stack, [old])
    try:
        request_id = await _with_webhook(client, receiver.url(path))
        await _calls(receiver, path, 1)
        async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH) as admin:
            await _set_secrets(admin, tenant, [new])
        receiver.holds[path].set()
        await _webhook_status(client, request_id, {"delivered"}, timeout=30)
    finally:
        receiver.holds[path].set()
        await client.aclose()
    first, retry = receiver.to(path)
    assert _verifies(old, first) and not _verifies(new, first)
    assert _verifies(new, retry) and not _verifies(old, retry)


async def test_a_secret_that_cannot_sign_is_refused_by_the_admin_api_without_quoting_it(stack) -> None:
    tenant = f"hooks-bad-{time.time_ns()}"
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH) as admin:
        for bad, problem in [
            ("whsec_REPLACE_ME", "is not base64 after whsec_"),
            ("whsec_" + base64.b64encode(b"short").decode(), "decodes to 5 bytes, not 24 to 64"),
            (_new_secret().removeprefix("whsec_"), "does not start with whsec_"),
        ]:
            response = await admin.put(f"/admin/tenants/{tenant}", json={"webhook_secrets": [_new_secret(), bad]})
            assert response.status_code == 422, response.text
            assert response.json()["error"]["code"] == "validation_error"
            assert f"secret 2 of 2 {problem}" in response.json()["error"]["message"]
            assert bad not in response.text


async def test_a_stored_tenant_secret_that_cannot_sign_is_a_refused_attempt_and_the_sender_goes_on(
    stack, mongo, receiver
) -> None:
    bad = "whsec_NOT-A-SECRET"
    tenant, client = await _tenant(stack)
    try:
        # Stored as before the admin API checked secrets (straight into MongoDB).
        database = os.environ.get("MONGO_DB", "triton_gateway")
        await mongo[database][TENANTS_COLLECTION].update_one(
            {"_id": tenant}, {"$set": {"webhook_secrets": [bad]}}, upsert=True
        )
        refused = _path("bad-secret")
        request_id = await _with_webhook(client, receiver.url(refused))
        record = await _webhook_status(client, request_id, {"refused"})
    finally:
        await client.aclose()
    [attempt] = record["webhook_attempts"]
    assert attempt["error"] == (
        f"refused: tenant {tenant}'s webhook secret 1 of 1 is not base64 after whsec_ "
        "(expected whsec_ and the base64 of 24 to 64 random bytes); "
        f"set valid ones with PUT /admin/tenants/{tenant}"
    )
    assert receiver.to(refused) == []
    assert bad not in (stack.data_dir / "logs" / "binder.log").read_text()
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH, timeout=60) as http:
        later = _path("after-bad-secret")
        await _webhook_status(http, await _with_webhook(http, receiver.url(later)), {"delivered"})


async def test_a_tenants_last_known_secrets_sign_through_a_mongodb_outage(mongo) -> None:
    secret = _new_secret()
    tenants = mongo[f"secrets_test_{time.time_ns()}"][TENANTS_COLLECTION]
    await tenants.insert_one({"_id": "known", "webhook_secrets": [secret]})
    secrets = TenantSecrets(tenants, [WEBHOOK_SECRET], cache_s=0)  # every call asks MongoDB
    assert (await secrets.for_tenant("known")).secrets == (secret,)
    assert (await secrets.for_tenant("plain")).secrets == (webhook_secret_of("plain"),)
    unreachable: AsyncMongoClient = AsyncMongoClient(f"mongodb://127.0.0.1:{free_port()}", serverSelectionTimeoutMS=200)
    try:
        secrets.tenants = unreachable[tenants.database.name][TENANTS_COLLECTION]
        assert (await secrets.for_tenant("known")).secrets == (secret,)
        assert (await secrets.for_tenant("plain")).secrets == (webhook_secret_of("plain"),)
        with pytest.raises(SecretsUnavailable):  # never read: not signed with a derived secret in its place
            await secrets.for_tenant("never-read")
    finally:
        await unreachable.close()
        await mongo.drop_database(tenants.database.name)


async def test_a_second_replay_while_the_first_is_pending_is_409_and_queues_nothing(stack, receiver) -> None:
    path = _path("pending")
    _, client = await _tenant(stack)
    try:
        request_id = await _with_webhook(client, receiver.url(path))
        await _webhook_status(client, request_id, {"delivered"})
        receiver.holds[path] = asyncio.Event()
        assert (await client.post(f"/results/{request_id}/webhook/replay")).status_code == 200
        await _calls(receiver, path, 2)  # the replay, held: pending
        again = await client.post(f"/results/{request_id}/webhook/replay")
        assert again.status_code == 409, again.text
        assert again.json()["error"]["code"] == "replay_pending"
        receiver.holds[path].set()
        deadline = time.monotonic() + 15
        while (after := await client.post(f"/results/{request_id}/webhook/replay")).status_code == 409:
            assert time.monotonic() < deadline, "the replay stayed pending"
            await asyncio.sleep(0.1)
        assert after.status_code == 200, after.text
        await _calls(receiver, path, 3)
    finally:
        receiver.holds.setdefault(path, asyncio.Event()).set()
        await client.aclose()
    assert len({call.headers["webhook-id"] for call in receiver.to(path)}) == 1


async def test_a_tenants_replays_beyond_its_limit_a_minute_are_429_with_retry_after(stack, http, receiver) -> None:
    path = _path("replay-limit")
    _, client = await _tenant(stack)
    try:
        request_ids = await asyncio.gather(
            *(_with_webhook(client, receiver.url(path)) for _ in range(REPLAYS_PER_MINUTE + 1))
        )
        for request_id in request_ids:
            await _webhook_status(client, request_id, {"delivered"})
        for request_id in request_ids[:REPLAYS_PER_MINUTE]:
            response = await client.post(f"/results/{request_id}/webhook/replay")
            assert response.status_code == 200, response.text
        over = await client.post(f"/results/{request_ids[-1]}/webhook/replay")
    finally:
        await client.aclose()
    assert over.status_code == 429, over.text
    assert over.json()["error"]["code"] == "replay_rate_limited"
    assert 1 <= int(over.headers["retry-after"]) <= 60
    await _calls(receiver, path, 2 * REPLAYS_PER_MINUTE + 1)  # each first delivery, and the replays accepted
    # Another tenant's replays are its own.
    mine = _path("replay-other-tenant")
    request_id = await _with_webhook(http, receiver.url(mine))
    await _webhook_status(http, request_id, {"delivered"})
    assert (await http.post(f"/results/{request_id}/webhook/replay")).status_code == 200


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
        assert why in (guard.refusal(address, ip_address(address), 443) or ""), address


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


async def _due_after_first_attempt(redis, delivery_id: str, tenant: str, timeout: float = 20) -> float:
    """The next attempt's due time, once the first attempt is saved (a binder of one shard)."""
    slot = webhook_slot(tenant, 1)
    deadline = time.monotonic() + timeout
    while await redis.hget(slot.delivery(delivery_id), "attempts") != "1":
        assert time.monotonic() < deadline, "the first attempt was not saved in time"
        await asyncio.sleep(0.1)
    due = await redis.zscore(slot.due, delivery_id)
    assert due is not None, "no retry was scheduled"
    return due


async def test_a_receivers_retry_after_of_days_gets_the_retry_at_the_cap(stack, isolated, receiver) -> None:
    path = _path("retry-after-days")
    receiver.responses[path] = [(503, {"retry-after": "999999"})]
    process, _ = stack.start_binder(
        "binder-retry-after-cap", WEBHOOK_RETRY_SCHEDULE="0,1", WEBHOOK_RETRY_AFTER_MAX_S="30", **isolated
    )
    redis = aioredis.from_url(isolated["REDIS_URL"], decode_responses=True)
    try:
        record = text_record(webhook=receiver.url(path))
        await publish(redis, [record])
        due = await _due_after_first_attempt(redis, f"{record.request_id}:completed", record.tenant)
        [call] = receiver.to(path)
        assert call.at + 29 <= due <= call.at + 31  # the Retry-After honoured up to the cap, not 11 days
    finally:
        stack.stop(process)
        await redis.aclose()


async def test_a_proxy_named_in_the_binders_environment_is_not_used_for_webhooks(
    stack, mongo, isolated, receiver
) -> None:
    path = _path("no-proxy")
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there: a proxied attempt fails
    names = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
    process, _ = stack.start_binder(
        "binder-proxy-env", **dict.fromkeys(names, nowhere), NO_PROXY="", no_proxy="", **isolated
    )
    redis = aioredis.from_url(isolated["REDIS_URL"], decode_responses=True)
    try:
        record = text_record(webhook=receiver.url(path))
        await publish(redis, [record])
        document = await _stored_webhook(mongo, isolated["MONGO_DB"], record.request_id, {"delivered", "failed"})
        assert document["webhook_status"] == "delivered", document["webhook_attempts"]
        assert len(receiver.to(path)) == 1
    finally:
        stack.stop(process)
        await redis.aclose()


def test_a_retry_after_longer_than_the_cap_counts_as_the_cap() -> None:
    assert retry_at(1000.0, 5.0, 999999.0, cap_s=3600, expires_at=None) == 1000.0 + 3600
    assert retry_at(1000.0, 5.0, 60.0, cap_s=3600, expires_at=None) == 1000.0 + 60  # below the cap: as asked
    assert retry_at(1000.0, 300.0, 60.0, cap_s=3600, expires_at=None) == 1000.0 + 300  # the schedule's is longer


def test_a_retry_after_never_moves_an_attempt_past_the_deliverys_expiry() -> None:
    assert retry_at(1000.0, 5.0, 3000.0, cap_s=3600, expires_at=2000.0) == 2000.0
    assert retry_at(2000.0, 5.0, None, cap_s=3600, expires_at=2000.0) is None  # expired: no attempt left


# -- deliveries in Redis: references, spread over the shards, expiring once ended (one
# binder of SHARDS shards, on Redis and MongoDB databases of its own)

SHARDS = 4


@dataclass
class ShardedBinder:
    redis: aioredis.Redis
    database: str  # its MongoDB database


@pytest_asyncio.fixture(scope="module")
async def sharded(stack) -> AsyncIterator[ShardedBinder]:
    """A binder over SHARDS shards whose ended deliveries stay in Redis one second."""
    number = next(_databases)
    env = {"REDIS_URL": stack.redis_db_url(number), "MONGO_DB": f"webhooks_sharded_{number}_{time.time_ns()}"}
    process, _ = stack.start_binder("binder-sharded-webhooks", REDIS_SHARDS=str(SHARDS), WEBHOOK_KEEP_S="1", **env)
    redis = aioredis.from_url(env["REDIS_URL"], decode_responses=True)
    try:
        yield ShardedBinder(redis, env["MONGO_DB"])
    finally:
        stack.stop(process)
        await redis.aclose()


async def _delivery_keys(redis, request_id: str) -> list[str]:
    """The Redis keys of the request's webhook deliveries, wherever they are."""
    return [key async for key in redis.scan_iter(match=f"*delivery:{request_id}:*", count=1000)]


async def _delivery_key(redis, request_id: str, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while not (keys := await _delivery_keys(redis, request_id)):
        assert time.monotonic() < deadline, f"no delivery of {request_id} in Redis"
        await asyncio.sleep(0.05)
    [key] = keys
    return key


async def _gone_from_redis(redis, request_id: str, timeout: float = 10) -> None:
    """Wait until no delivery of the request is left in Redis: no hash, no place in a due set."""
    deadline = time.monotonic() + timeout
    while True:
        keys = await _delivery_keys(redis, request_id)
        due = [
            member
            for slot in (shard.webhooks for shard in all_shards(SHARDS))
            for member in await redis.zrange(slot.due, 0, -1)
            if member.startswith(request_id)
        ]
        if not keys and not due:
            return
        ttls = {key: await redis.ttl(key) for key in keys}
        assert time.monotonic() < deadline, f"still in Redis: {ttls} (seconds to live), due {due}"
        await asyncio.sleep(0.1)


def _a_tenant_per_shard(shards: int) -> list[str]:
    found: dict[int, str] = {}
    for number in itertools.count():
        tenant = f"spread-{number}"
        found.setdefault(shard_for_tenant(tenant, shards), tenant)
        if len(found) == shards:
            return [found[shard] for shard in range(shards)]
    raise AssertionError("unreachable")


async def test_a_delivery_holds_a_reference_not_the_record(sharded, receiver) -> None:
    path = _path("reference")
    receiver.holds[path] = asyncio.Event()
    record = text_record("x" * 9000, webhook=receiver.url(path))  # a 9 KB record
    try:
        await publish(sharded.redis, [record])
        await _calls(receiver, path, 1, timeout=20)  # being sent: the delivery is in Redis
        key = await _delivery_key(sharded.redis, record.request_id)
        delivery = await sharded.redis.hgetall(key)
        size = await sharded.redis.memory_usage(key)
    finally:
        receiver.holds[path].set()
    assert delivery["request_id"] == record.request_id
    assert "payload" not in delivery
    assert not any("x" * 100 in value for value in delivery.values())
    assert size is not None and size < 1024, size


async def test_a_webhook_is_made_of_the_stored_record_and_signed(sharded, mongo, receiver) -> None:
    path = _path("stored-body")
    record = text_record("the stored text", webhook=receiver.url(path))
    await publish(sharded.redis, [record])
    document = await _stored_webhook(mongo, sharded.database, record.request_id, {"delivered"})
    [call] = receiver.to(path)
    payload = Webhook(webhook_secret_of(record.tenant)).verify(call.body, call.headers)
    assert payload["type"] == "request.completed"
    assert call.headers["webhook-id"].startswith("msg_")
    data = payload["data"]
    assert data["request_id"] == record.request_id
    assert data["outputs"] == {"text_output": "the stored text"}
    # The record as MongoDB holds it (stored, with its expiry), not the results stream's copy.
    assert data["stored"] is True
    assert abs(datetime.fromisoformat(data["expires_at"]) - document["expires_at"]).total_seconds() < 1
    assert "webhook_status" not in data and "webhook_attempts" not in data


async def test_a_delivery_whose_record_is_not_stored_is_not_sent(sharded, receiver) -> None:
    path = _path("not-stored")
    request_id = new_request_id()  # never stored
    delivery_id = f"{request_id}:completed"
    queued = await enqueue_delivery(
        sharded.redis,
        shards=SHARDS,
        delivery_id=delivery_id,
        request_id=request_id,
        url=receiver.url(path),
        event="completed",
        payload="",  # a reference to the stored record
        webhook_id="msg_not_stored",
        tenant="default",
    )
    assert queued
    key = webhook_slot("default", SHARDS).delivery(delivery_id)
    deadline = time.monotonic() + 20
    while await sharded.redis.hget(key, "attempts") in (None, "0"):
        assert time.monotonic() < deadline, "no attempt was made"
        await asyncio.sleep(0.05)
    first = json.loads(await sharded.redis.hget(key, "log"))[0]
    assert first["error"] == f"no stored result {request_id} to send"
    assert receiver.to(path) == []


async def test_a_delivered_webhook_expires_from_redis(sharded, mongo, receiver) -> None:
    path = _path("expires")
    record = text_record(webhook=receiver.url(path))
    await publish(sharded.redis, [record])
    await _stored_webhook(mongo, sharded.database, record.request_id, {"delivered"})
    await _gone_from_redis(sharded.redis, record.request_id)  # WEBHOOK_KEEP_S=1
    assert len(receiver.to(path)) == 1


async def test_a_webhook_out_of_attempts_expires_from_redis(sharded, mongo, receiver) -> None:
    path = _path("dead")
    receiver.responses[path] = [(500, {})] * 10  # more than the schedule's attempts
    record = text_record(webhook=receiver.url(path))
    await publish(sharded.redis, [record])
    document = await _stored_webhook(mongo, sharded.database, record.request_id, {"failed"})
    await _gone_from_redis(sharded.redis, record.request_id)
    assert len(receiver.to(path)) == len(document["webhook_attempts"])


async def test_deliveries_spread_over_the_shards_and_the_senders_claim_from_each(sharded, mongo, receiver) -> None:
    path = _path("spread")
    receiver.holds[path] = asyncio.Event()
    records = [
        text_record(webhook=receiver.url(path)).model_copy(update={"tenant": tenant})
        for tenant in _a_tenant_per_shard(SHARDS)
    ]
    try:
        await publish(sharded.redis, records)
        keys = [await _delivery_key(sharded.redis, record.request_id) for record in records]
        await _calls(receiver, path, len(records), timeout=20)  # each shard's delivery claimed and sent
    finally:
        receiver.holds[path].set()
    assert sorted(key.split(":", 1)[0] for key in keys) == [f"{{s{shard}}}" for shard in range(SHARDS)]
    for record in records:
        await _stored_webhook(mongo, sharded.database, record.request_id, {"delivered"})
