"""Per-tenant quotas for what is stored: files (how many, their bytes), batches not ended
(and their lines together), API keys; each refusal names its quota. MongoDB indexes for
the batch queries of hot paths; a batch line over the storage limit is a failed line; a
batch whose validation never ends fails; runners take batches round robin by tenant, so
one tenant's many batches leave another tenant's batch unaffected."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from gateway.server.openai.files import batch_runner
from gateway.server.openai.files.batch_runner import BatchRunner
from gateway.server.openai.files.batch_store import BatchStore
from gateway.server.openai.files.store import FileStore
from gateway.server.settings import GatewaySettings
from tests.conftest import AUTH
from tests.test_openai_batches import chat_line, jsonl
from tests.test_tenants import new_key

QUOTAS = {
    "TENANT_MAX_FILES": "2",
    "TENANT_MAX_FILE_BYTES": "3000",
    "TENANT_MAX_ACTIVE_BATCHES": "1",
    "TENANT_MAX_KEYS": "2",
}


@pytest.fixture(scope="module")
def small(stack) -> Iterator[str]:
    """A gateway of the stack with small quotas (the stack's own keeps the defaults)."""
    process, url = stack.start_gateway("gateway-small-quotas", **QUOTAS)
    try:
        yield url
    finally:
        stack.stop(process)


def _client(url: str, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


async def _upload(client: httpx.AsyncClient, content: bytes) -> httpx.Response:
    return await client.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})


def _refusal(response: httpx.Response, status: int, code: str, quota: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    assert quota in error["message"]


async def test_an_upload_past_the_tenants_file_count_quota_is_403_naming_it(stack, small) -> None:
    async with _client(small, await new_key(stack, f"quota-files-{time.time_ns()}")) as client:
        first = await _upload(client, b"{}\n")
        assert first.status_code == 200, first.text
        assert (await _upload(client, b"{}\n")).status_code == 200
        _refusal(await _upload(client, b"{}\n"), 403, "file_count_quota_exceeded", "TENANT_MAX_FILES")
        assert (await client.delete(f"/v1/files/{first.json()['id']}")).status_code == 200
        assert (await _upload(client, b"{}\n")).status_code == 200  # room again


async def test_an_upload_past_the_tenants_file_bytes_quota_is_403_naming_it(stack, small) -> None:
    async with _client(small, await new_key(stack, f"quota-bytes-{time.time_ns()}")) as client:
        assert (await _upload(client, b"x" * 2000)).status_code == 200
        _refusal(await _upload(client, b"x" * 1500), 403, "file_bytes_quota_exceeded", "TENANT_MAX_FILE_BYTES")
        assert (await _upload(client, b"x" * 900)).status_code == 200  # within what is left


async def test_a_batch_past_the_tenants_active_batches_quota_is_429_until_one_ends(stack, small) -> None:
    # One long line (a minute of tokens): the first batch stays in progress.
    line = {"custom_id": "long", "method": "POST", "url": "/v1/completions"}
    line["body"] = {"model": "llm_synthetic", "prompt": "go on", "max_tokens": 3000}
    async with _client(small, await new_key(stack, f"quota-batches-{time.time_ns()}")) as client:
        file_id = (await _upload(client, jsonl([line]))).json()["id"]
        body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
        first = await client.post("/v1/batches", json=body)
        assert first.status_code == 200, first.text
        over = await client.post("/v1/batches", json=body)
        _refusal(over, 429, "active_batches_quota_exceeded", "TENANT_MAX_ACTIVE_BATCHES")
        assert int(over.headers["retry-after"]) > 0
        assert (await client.post(f"/v1/batches/{first.json()['id']}/cancel")).status_code == 200
        deadline = time.monotonic() + 60
        while (await client.get(f"/v1/batches/{first.json()['id']}")).json()["status"] != "cancelled":
            assert time.monotonic() < deadline, "the batch was not cancelled"
            await asyncio.sleep(0.2)
        again = await client.post("/v1/batches", json=body)
        assert again.status_code == 200, again.text
        await client.post(f"/v1/batches/{again.json()['id']}/cancel")


async def test_an_admin_minting_keys_past_the_tenants_key_quota_gets_403_naming_it(stack, small) -> None:
    tenant = f"quota-keys-{time.time_ns()}"
    async with httpx.AsyncClient(base_url=small, headers=AUTH, timeout=60) as operator:
        made = [await operator.post("/admin/keys", json={"tenant": tenant}) for _ in range(2)]
        assert [r.status_code for r in made] == [201, 201], [r.text for r in made]
        _refusal(
            await operator.post("/admin/keys", json={"tenant": tenant}), 403, "key_quota_exceeded", "TENANT_MAX_KEYS"
        )
        assert (await operator.delete(f"/admin/keys/{made[0].json()['id']}")).status_code == 200
        assert (await operator.post("/admin/keys", json={"tenant": tenant})).status_code == 201  # revoked: room


# ---- the runner, on its own database -------------------------------------------------------


async def _runner(mongo, monkeypatch, **settings: Any) -> tuple[BatchRunner, FileStore, str]:
    database = f"stored_quotas_{time.time_ns()}"
    files = FileStore(mongo, database)
    svc = SimpleNamespace(settings=GatewaySettings(**settings), files=files)
    runner = BatchRunner(svc, BatchStore(mongo, database))  # type: ignore[arg-type]
    # What each line's body becomes is not what these measure (no registry here).
    monkeypatch.setattr(batch_runner, "native_requests", lambda *args, **kwargs: [])

    async def announce(batch: dict[str, Any], ending: str) -> None:
        pass

    monkeypatch.setattr(runner, "_announce", announce)
    return runner, files, database


async def _validating(runner: BatchRunner, files: FileStore, tenant: str, content: bytes, **fields: Any) -> dict:
    stored = await files.put(tenant, "in.jsonl", "batch", content)
    batch = {"_id": f"batch_{time.time_ns()}", "tenant": tenant, "endpoint": "/v1/chat/completions"}
    batch |= {"input_file_id": stored["id"], "status": "validating", "lease_owner": runner.name, "lease_until": 0.0}
    batch |= fields
    await runner.store.batches.insert_one(batch)
    return batch


async def test_a_batch_line_over_the_storage_limit_is_a_failed_line_and_its_body_is_not_stored(
    stack, mongo, monkeypatch
) -> None:
    runner, files, database = await _runner(mongo, monkeypatch, batch_max_line_bytes=1000)
    try:
        content = jsonl([chat_line("small", "hi"), chat_line("big", "y" * 2000)])
        batch = await _validating(runner, files, "tenant-l", content)
        validated = await runner.validate(batch)
        assert validated["status"] == "in_progress", validated
        assert validated["request_counts"]["total"] == 2
        big = await runner.store.lines.find_one({"batch": batch["_id"], "line": 2})
        assert big is not None and big["outcome"] == "failed", big
        assert big["error"]["code"] == "line_too_large"
        assert "body" not in big
        small = await runner.store.lines.find_one({"batch": batch["_id"], "line": 1})
        assert small is not None and small["outcome"] == "pending"
    finally:
        await mongo.drop_database(database)


async def test_a_batch_whose_validation_was_started_too_often_fails_validation_failed(
    stack, mongo, monkeypatch
) -> None:
    runner, files, database = await _runner(mongo, monkeypatch, batch_max_validations=3)
    try:
        batch = await _validating(runner, files, "tenant-v", jsonl([chat_line("a", "hi")]), validations=3)
        failed = await runner.validate(batch)
        assert failed["status"] == "failed", failed
        assert failed["errors"]["data"][0]["code"] == "validation_failed"
        assert await runner.store.lines.find_one({"batch": batch["_id"]}) is None
        # Below the limit, each start is counted.
        fresh = await _validating(runner, files, "tenant-v", jsonl([chat_line("a", "hi")]))
        assert (await runner.validate(fresh))["validations"] == 1
    finally:
        await mongo.drop_database(database)


async def test_a_batch_past_the_tenants_lines_quota_fails_naming_it(stack, mongo, monkeypatch) -> None:
    runner, files, database = await _runner(mongo, monkeypatch, tenant_max_batch_lines=5)
    try:
        held = {"_id": "batch_held", "tenant": "tenant-q", "status": "in_progress", "lease_until": 0.0}
        await runner.store.batches.insert_one(held | {"request_counts": {"total": 4, "completed": 0, "failed": 0}})
        batch = await _validating(runner, files, "tenant-q", jsonl([chat_line(f"c{i}", "hi") for i in range(2)]))
        failed = await runner.validate(batch)
        assert failed["status"] == "failed", failed
        error = failed["errors"]["data"][0]
        assert error["code"] == "batch_lines_quota_exceeded" and "TENANT_MAX_BATCH_LINES" in error["message"]
        assert await runner.store.lines.find_one({"batch": batch["_id"]}) is None
        # Another tenant's batch of the same lines is within its own quota.
        other = await _validating(runner, files, "tenant-r", jsonl([chat_line(f"c{i}", "hi") for i in range(2)]))
        assert (await runner.validate(other))["status"] == "in_progress"
    finally:
        await mongo.drop_database(database)


async def test_the_batch_collections_have_indexes_for_the_claim_the_lists_and_the_lines(stack, mongo) -> None:
    database = f"stored_quotas_{time.time_ns()}"
    store = BatchStore(mongo, database)
    try:
        await store.prepare()
        # Field names only: the local MongoDB-wire server reports every direction as 1.
        batches = [[k for k, _ in i["key"]] for i in (await store.batches.index_information()).values()]
        lines = [[k for k, _ in i["key"]] for i in (await store.lines.index_information()).values()]
        assert ["status", "tenant", "created_at"] in batches  # the claim, a tenant's active count
        assert ["tenant", "created_at"] in batches  # a tenant's list
        assert ["batch", "outcome", "line"] in lines  # a batch's lines by outcome, in order
        assert ["batch", "line"] in lines  # all of a batch's lines, in order
    finally:
        await mongo.drop_database(database)


async def test_runners_claim_batches_round_robin_by_tenant_oldest_first(stack, mongo) -> None:
    database = f"stored_quotas_{time.time_ns()}"
    store = BatchStore(mongo, database)
    runners = [
        BatchRunner(SimpleNamespace(settings=GatewaySettings()), store)  # type: ignore[arg-type]
        for _ in range(3)
    ]
    for n, runner in enumerate(runners):
        runner.name = f"runner-{n}"
    try:
        base = time.time_ns()
        # The busy tenant's ten batches come first, the other tenant's one last.
        for n in range(10):
            await store.batches.insert_one(
                {"_id": f"batch_{base + n:024d}", "tenant": "busy", "status": "in_progress", "lease_until": 0.0}
                | {"created_at": 1000 + n}
            )
        await store.batches.insert_one(
            {"_id": f"batch_{base + 99:024d}", "tenant": "quiet", "status": "in_progress", "lease_until": 0.0}
            | {"created_at": 2000}
        )
        claimed = []
        for runner in runners:
            batch = await runner._claim()
            assert batch is not None
            claimed.append((batch["tenant"], batch["_id"]))
        tenants = [tenant for tenant, _ in claimed]
        assert tenants.count("quiet") == 1, claimed  # served among the first two claims, not after ten
        assert "quiet" in tenants[:2], claimed
        busy = [batch_id for tenant, batch_id in claimed if tenant == "busy"]
        assert busy == sorted(busy) and busy[0] == f"batch_{base:024d}", claimed  # its oldest first
    finally:
        await mongo.drop_database(database)


# ---- one tenant's whole share does not hold another's batch ------------------------------


async def test_a_tenant_holding_every_runner_leaves_another_tenants_batch_unaffected(stack) -> None:
    """Busy fills more than every runner of the stack with batches of a line that runs for a
    minute; quiet's one short batch still completes within a few turns (BATCH_TURN_S)."""
    long_line = {"custom_id": "long", "method": "POST", "url": "/v1/completions"}
    long_line["body"] = {"model": "llm_synthetic", "prompt": "go on", "max_tokens": 3000}
    short_line = {"custom_id": "short", "method": "POST", "url": "/v1/completions"}
    short_line["body"] = {"model": "llm_echo", "prompt": "hello", "max_tokens": 4}
    settings = GatewaySettings()
    busy_batches: list[str] = []
    async with (
        _client(stack.gateway_url, await new_key(stack, f"busy-{time.time_ns()}")) as busy,
        _client(stack.gateway_url, await new_key(stack, f"quiet-{time.time_ns()}")) as quiet,
    ):
        try:
            file_id = (await _upload(busy, jsonl([long_line]))).json()["id"]
            body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
            for _ in range(settings.batch_concurrency * 3):  # more than every runner, the small gateway's too
                created = await busy.post("/v1/batches", json=body)
                assert created.status_code == 200, created.text
                busy_batches.append(created.json()["id"])
            # Every runner holds one of busy's batches (in progress: their lines running).
            deadline = time.monotonic() + 60
            while True:
                statuses = [(await busy.get(f"/v1/batches/{b}")).json()["status"] for b in busy_batches]
                if statuses.count("in_progress") >= settings.batch_concurrency:
                    break
                assert time.monotonic() < deadline, statuses
                await asyncio.sleep(0.2)
            quiet_file = (await _upload(quiet, jsonl([short_line]))).json()["id"]
            started = time.monotonic()
            created = await quiet.post("/v1/batches", json={**body, "input_file_id": quiet_file})
            assert created.status_code == 200, created.text
            # Without turns it would wait for one of busy's minute-long lines to end.
            while (status := (await quiet.get(f"/v1/batches/{created.json()['id']}")).json()["status"]) != "completed":
                assert status in ("validating", "in_progress", "finalizing"), status
                assert time.monotonic() - started < 40, f"quiet's batch still {status}"
                await asyncio.sleep(0.2)
            statuses = [(await busy.get(f"/v1/batches/{b}")).json()["status"] for b in busy_batches]
            assert "in_progress" in statuses, statuses  # busy still held its share meanwhile
        finally:
            for batch_id in busy_batches:
                await busy.post(f"/v1/batches/{batch_id}/cancel")
