"""OpenAI's Files and Batch APIs with the official `openai` package: files live in
MongoDB (GridFS), batches run as ordinary durable requests in the batch band, invalid
lines go to the error file without failing the batch, a cancel ends a batch cancelled,
and a batch whose gateway is killed is finished by another, each line exactly once."""

from __future__ import annotations

import asyncio
import io
import json
import time
import tracemalloc
from types import SimpleNamespace

import httpx
import openai
import pytest

from gateway.common.result_store import RESULTS_COLLECTION
from gateway.server.openai.files import batch_runner
from gateway.server.openai.files.batch_runner import BatchRunner
from gateway.server.openai.files.batch_store import BatchStore
from gateway.server.openai.files.store import FileStore
from gateway.server.settings import GatewaySettings
from tests.conftest import AUTH, kill_by_pid
from tests.test_tenants import ECHO, client_for, new_key, set_tenant

MONGO_DB = "triton_gateway"  # the stack's database (gateway.common.settings default)


def chat_line(custom_id: str, text: str, model: str = "llm_echo", max_tokens: int = 200) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines: list) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def upload(client: openai.OpenAI, lines: list) -> str:
    return client.files.create(file=("input.jsonl", io.BytesIO(jsonl(lines))), purpose="batch").id


def run_batch(client: openai.OpenAI, lines: list, endpoint: str = "/v1/chat/completions"):
    return client.batches.create(input_file_id=upload(client, lines), endpoint=endpoint, completion_window="24h")


def wait_for(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)


def read_lines(client: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    lines = [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
    return {line["custom_id"]: line for line in lines}


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=stack.api_key, max_retries=0, timeout=60)


def test_a_batch_with_invalid_lines_completes_and_outputs_match_by_custom_id(client) -> None:
    valid = [chat_line(f"req-{i}", f"question number {i}") for i in range(55)]
    invalid = [
        b"{not json",
        {**chat_line("wrong-url", "x"), "url": "/v1/embeddings"},
        chat_line("no-such-model", "x", model="no-such-model"),
        chat_line("req-0", "the same custom_id again"),
        {"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"},
    ]
    file_id = upload(client, valid[:30] + invalid + valid[30:])
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"job": "nightly"}
    )
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = wait_for(client, batch.id, {"completed", "failed"})
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (60, 55, 5)
    outputs = read_lines(client, done.output_file_id)
    assert set(outputs) == {f"req-{i}" for i in range(55)}
    for i in range(55):
        response = outputs[f"req-{i}"]["response"]
        assert response["status_code"] == 200
        assert f"question number {i}<|im_end|>" in response["body"]["choices"][0]["message"]["content"]
        assert response["body"]["usage"]["completion_tokens"] > 0
    errors = [json.loads(line) for line in client.files.content(done.error_file_id).text.splitlines()]
    codes = sorted(line["error"]["code"] for line in errors)
    assert codes == ["duplicate_custom_id", "invalid_json", "invalid_request", "invalid_url", "model_not_found"]


def test_a_batch_of_embeddings_returns_vectors_per_line(client) -> None:
    lines = [
        {"custom_id": "one", "method": "POST", "url": "/v1/embeddings", "body": {"model": "text_embed", "input": "a"}},
        {
            "custom_id": "two",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "text_embed", "input": ["b", "c"]},
        },
    ]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/embeddings", completion_window="24h"
    )
    done = wait_for(client, batch.id, {"completed", "failed"})
    outputs = read_lines(client, done.output_file_id)
    assert [len(outputs[c]["response"]["body"]["data"]) for c in ("one", "two")] == [1, 2]
    assert len(outputs["two"]["response"]["body"]["data"][1]["embedding"]) == 384
    assert done.error_file_id is None


async def test_a_batch_runs_to_its_end_under_a_per_minute_limit_and_spends_none_of_it(stack) -> None:
    await set_tenant(stack, "tenant-batch-rpm", limits={"requests_per_minute": 3})
    key = await new_key(stack, "tenant-batch-rpm")
    batcher = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=key, max_retries=0, timeout=30)
    # More lines than the minute allows calls, and more inputs in each line than that.
    lines = [
        {
            "custom_id": f"line-{n}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "text_embed", "input": [f"line {n} input {i}" for i in range(5)]},
        }
        for n in range(4)
    ]
    batch = run_batch(batcher, lines, "/v1/embeddings")
    done = wait_for(batcher, batch.id, {"completed", "failed"}, timeout_s=60)
    assert done.status == "completed" and done.request_counts.completed == 4
    outputs = read_lines(batcher, done.output_file_id)
    for n in range(4):
        vectors = outputs[f"line-{n}"]["response"]["body"]["data"]
        assert [len(v["embedding"]) for v in vectors] == [384] * 5
    async with client_for(stack, key) as client:  # the tenant's own calls still have the whole minute
        for _ in range(3):
            assert (await client.post("/infer", json=ECHO)).status_code == 202
        refused = await client.post("/infer", json=ECHO)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited"


def test_a_cancelled_batch_ends_cancelled_with_what_finished(client) -> None:
    lines = [chat_line(f"slow-{i}", "tell me more", model="llm_synthetic", max_tokens=60) for i in range(300)]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for(client, batch.id, {"in_progress"}, timeout_s=30)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_for(client, batch.id, {"cancelled"}, timeout_s=60)
    assert done.request_counts.total == 300  # the batch's lines, run or not
    assert done.request_counts.completed < 300
    assert len(read_lines(client, done.output_file_id)) == done.request_counts.completed
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: nothing changes


def test_a_finished_batch_cannot_be_cancelled(client) -> None:
    file_id = upload(client, [chat_line("quick", "hi")])
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(client, batch.id, {"completed"})
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


async def test_a_batch_whose_gateway_is_killed_is_finished_by_another_exactly_once(stack, mongo) -> None:
    process, url = stack.start_gateway("gateway-batches", BATCH_LEASE_S="2", BATCH_WINDOW="4")
    count = 24
    lines = [chat_line(f"line-{i}", f"count {i}", model="llm_synthetic", max_tokens=30) for i in range(count)]
    dying = openai.OpenAI(base_url=f"{url}/v1", api_key=stack.api_key, max_retries=0, timeout=30)
    try:
        batch = dying.batches.create(
            input_file_id=upload(dying, lines), endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 60
        while dying.batches.retrieve(batch.id).request_counts.completed < 4:  # mid-way, requests running
            assert time.monotonic() < deadline, "the batch made no progress"
            time.sleep(0.1)
    finally:
        kill_by_pid(process)
    survivor = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=stack.api_key, max_retries=0, timeout=30)
    done = wait_for(survivor, batch.id, {"completed", "failed"})
    assert done.status == "completed" and done.request_counts.completed == count
    outputs = read_lines(survivor, done.output_file_id)
    assert set(outputs) == {f"line-{i}" for i in range(count)}
    request_ids = {line["response"]["request_id"] for line in outputs.values()}
    assert len(request_ids) == count
    # Exactly one request per line ran and was stored, though two gateways drove the batch.
    results = mongo[MONGO_DB][RESULTS_COLLECTION]
    deadline = time.monotonic() + 20
    while (stored := await results.count_documents({"metadata.batch_id": batch.id})) < count:
        assert time.monotonic() < deadline, f"{stored} of {count} stored"
        time.sleep(0.1)
    assert stored == count


async def test_files_and_batches_of_another_tenant_are_404(stack, client) -> None:
    file_id = upload(client, [chat_line("mine", "hi")])
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    other = openai.OpenAI(
        base_url=f"{stack.gateway_url}/v1", api_key=await new_key(stack, "tenant-files"), max_retries=0, timeout=30
    )
    for call in (
        lambda: other.files.retrieve(file_id),
        lambda: other.files.content(file_id),
        lambda: other.files.delete(file_id),
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in {b.id for b in other.batches.list()}
    with pytest.raises(openai.NotFoundError):  # nor can it run a batch on someone else's file
        other.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert client.files.retrieve(file_id).bytes > 0


def test_a_file_round_trips_and_is_deleted(client) -> None:
    content = jsonl([chat_line("a", "hello"), chat_line("b", "world")])
    created = client.files.create(file=("two.jsonl", io.BytesIO(content)), purpose="batch")
    assert (created.bytes, created.filename, created.purpose) == (len(content), "two.jsonl", "batch")
    assert client.files.content(created.id).content == content
    assert created.id in {f.id for f in client.files.list(purpose="batch")}
    assert client.files.delete(created.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)


def test_an_uploaded_files_name_is_kept_without_path_parts_or_control_characters(client, stack) -> None:
    name = "../../etc/\x1bpasswd\x7f"  # (httpx sends ESC and DEL as they are; \x01 it would send as %01)
    upload = {"file": (name, jsonl([chat_line("a", "hello")]))}
    with httpx.Client(base_url=f"{stack.gateway_url}/v1", headers=AUTH) as raw:
        assert b'filename="../../etc/\x1bpasswd\x7f"' in raw.build_request("POST", "/files", files=upload).read()
        created = raw.post("/files", files=upload, data={"purpose": "batch"})
    assert created.status_code == 200, created.text
    assert created.json()["filename"] == "passwd"
    listed = {f.id: f.filename for f in client.files.list(purpose="batch")}
    assert listed[created.json()["id"]] == "passwd"


def test_batches_are_listed_newest_first_with_after_and_limit(client) -> None:
    file_id = upload(client, [chat_line("x", "list me")])
    made = [
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h").id
        for _ in range(3)
    ]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    after = client.batches.list(limit=2, after=first.data[-1].id)
    assert after.data[0].id == made[0]


def test_bad_requests_get_openai_errors(client, stack) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert refused.value.code == "invalid_purpose"
    file_id = upload(client, [chat_line("x", "y")])
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=file_id, endpoint="/v1/responses", completion_window="24h")
    assert refused.value.code == "invalid_endpoint"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")


def test_a_file_over_the_limit_is_413(stack) -> None:
    process, url = stack.start_gateway("gateway-small-files", MAX_FILE_BYTES="1000")
    try:
        response = httpx.post(
            f"{url}/v1/files",
            headers={"Authorization": f"Bearer {stack.api_key}"},
            files={"file": ("big.jsonl", b"x" * 5000)},
            data={"purpose": "batch"},
        )
        assert response.status_code == 413
        assert response.json()["error"]["code"] in ("file_too_large", "payload_too_large")
    finally:
        stack.stop(process)


# ---- expiry ----------------------------------------------------------------------------


def test_an_uploaded_file_expires_after_the_retention_or_its_own_expires_after(client) -> None:
    kept = client.files.create(file=("kept.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    assert kept.expires_at == kept.created_at + 30 * 24 * 3600  # FILE_RETENTION_S
    assert client.files.retrieve(kept.id).expires_at == kept.expires_at
    short = client.files.create(
        file=("short.jsonl", io.BytesIO(b"{}\n")),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 7200},
    )
    assert short.expires_at == short.created_at + 7200
    for wrong in ({"anchor": "created_at", "seconds": 60}, {"anchor": "last_active_at", "seconds": 7200}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="batch", expires_after=wrong)  # type: ignore[arg-type]
        assert refused.value.code == "invalid_expires_after"


async def test_an_expired_file_is_404_at_once_and_swept_out_of_gridfs(stack, mongo) -> None:
    process, url = stack.start_gateway("gateway-file-sweep", FILE_SWEEP_INTERVAL_S="0.2")
    try:
        async with httpx.AsyncClient(base_url=f"{url}/v1", headers=AUTH, timeout=30) as client:
            content = b"x" * (600 * 1024)  # several GridFS chunks (255 KiB each)
            ids = []
            for name in ("expiring.jsonl", "lasting.jsonl"):
                created = await client.post("/files", files={"file": (name, content)}, data={"purpose": "batch"})
                assert created.status_code == 200, created.text
                ids.append(created.json()["id"])
            expiring, lasting = ids
            db = mongo[MONGO_DB]
            # Its expiry reached (a test cannot wait out the shortest expires_after, an hour).
            # The whole metadata is set: nx-27017 sets no dotted field in GridFS's documents.
            stored = await db["files.files"].find_one({"_id": expiring})
            metadata = {**stored["metadata"], "expires_at": int(time.time()) - 1}
            assert (
                await db["files.files"].update_one({"_id": expiring}, {"$set": {"metadata": metadata}})
            ).modified_count
            assert (await client.get(f"/files/{expiring}")).status_code == 404
            assert (await client.get(f"/files/{expiring}/content")).status_code == 404
            assert expiring not in {f["id"] for f in (await client.get("/files")).json()["data"]}

            async def chunks(file_id: str) -> int:
                return len([c async for c in db["files.chunks"].find({"files_id": file_id}, {"_id": 1})])

            deadline = time.monotonic() + 30
            while await db["files.files"].find_one({"_id": expiring}) is not None or await chunks(expiring):
                assert time.monotonic() < deadline, "the expired file is still in GridFS"
                await asyncio.sleep(0.1)
            assert await chunks(lasting) == 3
            assert (await client.get(f"/files/{lasting}/content")).content == content
            await client.delete(f"/files/{lasting}")
    finally:
        stack.stop(process)


# ---- validation streams the input file -------------------------------------------------


async def test_validation_reads_the_input_file_line_by_line_not_whole(stack, mongo, monkeypatch) -> None:
    database = f"batch_validation_{time.time_ns()}"
    files = FileStore(mongo, database)
    svc = SimpleNamespace(settings=GatewaySettings(), files=files)
    runner = BatchRunner(svc, BatchStore(mongo, database))  # type: ignore[arg-type]
    # What each line's body becomes is not what this measures (no registry here).
    monkeypatch.setattr(batch_runner, "native_requests", lambda *args, **kwargs: [])
    line = chat_line("x", "y" * 4000)
    content = jsonl([{**line, "custom_id": f"line-{i}"} for i in range(1500)])  # ~6 MiB
    stored = await files.put("tenant-v", "big.jsonl", "batch", content)
    batch = {
        "_id": f"batch_{time.time_ns()}",
        "tenant": "tenant-v",
        "endpoint": "/v1/chat/completions",
        "input_file_id": stored["id"],
        "status": "validating",
        "lease_owner": runner.name,
        "lease_until": time.time() + 60,
    }
    await runner.store.batches.insert_one(batch)
    tracemalloc.start()
    try:
        validated = await runner.validate(batch)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    try:
        assert validated["status"] == "in_progress", validated
        assert validated["request_counts"]["total"] == 1500
        # Held whole (bytes, text, lines) it would be three times the file; streamed, it is a
        # chunk, a line and one bulk write of lines.
        assert peak < len(content) / 2, f"validation held {peak} bytes for a {len(content)}-byte file"
    finally:
        await mongo.drop_database(database)


async def test_a_file_that_is_not_utf8_fails_its_batch_and_leaves_no_lines(stack, mongo, monkeypatch) -> None:
    database = f"batch_validation_{time.time_ns()}"
    files = FileStore(mongo, database)
    runner = BatchRunner(SimpleNamespace(settings=GatewaySettings(), files=files), BatchStore(mongo, database))  # type: ignore[arg-type]
    monkeypatch.setattr(batch_runner, "native_requests", lambda *args, **kwargs: [])
    announced = []

    async def announce(batch, ending: str) -> None:
        announced.append(ending)

    monkeypatch.setattr(runner, "_announce", announce)
    good = jsonl([{**chat_line(f"c{i}", "hi"), "custom_id": f"c{i}"} for i in range(600)])
    stored = await files.put("tenant-v", "bad.jsonl", "batch", good + b'{"custom_id": "\xff"}\n')
    batch = {"_id": f"batch_{time.time_ns()}", "tenant": "tenant-v", "endpoint": "/v1/chat/completions"}
    batch |= {"input_file_id": stored["id"], "status": "validating", "lease_owner": runner.name, "lease_until": 0.0}
    await runner.store.batches.insert_one(batch)
    try:
        failed = await runner.validate(batch)
        assert failed["status"] == "failed" and failed["errors"]["data"][0]["code"] == "invalid_file"
        assert announced == ["failed"]
        assert await runner.store.lines.find_one({"batch": batch["_id"]}) is None
    finally:
        await mongo.drop_database(database)
