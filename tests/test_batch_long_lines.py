"""Streams, not joins: a batch line longer than BATCH_MAX_LINE_BYTES is refused while it is
read (counted and skipped to the next newline, never joined nor decoded), and a file with
such a line is refused at upload (purpose batch) by a streaming scan."""

from __future__ import annotations

import io
import time
import tracemalloc
from types import SimpleNamespace

import httpx
import pytest

from gateway.server.openai.files import batch_runner
from gateway.server.openai.files.batch_runner import BatchRunner
from gateway.server.openai.files.batch_store import BatchStore
from gateway.server.openai.files.store import FileStore
from gateway.server.settings import GatewaySettings
from tests.conftest import AUTH
from tests.test_openai_batches import chat_line, jsonl

LIMIT = 1 << 20


@pytest.mark.parametrize(
    ("content", "found"),
    [
        (b"a" * LIMIT + b"\nb\n", None),  # at the limit
        (b"a" * LIMIT + b"\r\nb\n", None),  # a \r before its \n is not the line's
        (b"a" * LIMIT + b"\r", None),  # nor at the end of the file
        (b"ok\n" + b"a" * (LIMIT + 1) + b"\nb\n", (2, LIMIT + 1)),
        (b"ok\n" * 3 + b"a" * (LIMIT + 1), (4, LIMIT + 1)),  # the last line, without its \n
        (b"x" * (LIMIT - 2) + b"\n" + b"a" * (5 * LIMIT), (2, None)),  # over several chunks: stops early
    ],
)
def test_the_scan_finds_the_first_line_over_the_limit(content: bytes, found: tuple[int, int | None] | None) -> None:
    from gateway.server.openai.files.store import long_line  # (here: a module without it still runs the others)

    got = long_line(io.BytesIO(content), LIMIT)
    if found is None:
        assert got is None
    else:
        assert got is not None and got[0] == found[0] and got[1] > LIMIT
        if found[1] is not None:
            assert got[1] == found[1]


async def test_a_long_lines_file_is_refused_at_upload_with_its_line(stack) -> None:
    content = jsonl([chat_line("a", "hi")]) + b'{"custom_id": "' + b"x" * (9 << 20) + b'"}\n'
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH, timeout=120) as client:
        response = await client.post("/v1/files", files={"file": ("big.jsonl", content)}, data={"purpose": "batch"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "line_too_large" and error["message"].startswith("line 2 "), error


async def test_validation_counts_a_long_line_without_holding_it(stack, mongo, monkeypatch) -> None:
    database = f"batch_long_line_{time.time_ns()}"
    files = FileStore(mongo, database)
    settings = GatewaySettings(batch_max_line_bytes=LIMIT)
    runner = BatchRunner(SimpleNamespace(settings=settings, files=files), BatchStore(mongo, database))  # type: ignore[arg-type]
    monkeypatch.setattr(batch_runner, "native_requests", lambda *args, **kwargs: [])
    size = 24 << 20
    # Stored as it might have been before the upload scan, or written by other means.
    long_text = b'{"custom_id": "' + b"x" * size + b'"}'
    content = jsonl([chat_line("a", "hi"), long_text, chat_line("b", "hi")])
    stored = await files.put("tenant-l", "long.jsonl", "batch", content)
    line_size = len(long_text)
    del content, long_text
    batch = {"_id": f"batch_{time.time_ns()}", "tenant": "tenant-l", "endpoint": "/v1/chat/completions"}
    batch |= {"input_file_id": stored["id"], "status": "validating", "lease_owner": runner.name, "lease_until": 0.0}
    await runner.store.batches.insert_one(batch)
    tracemalloc.start()
    try:
        validated = await runner.validate(batch)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    try:
        assert validated["status"] == "in_progress", validated
        assert validated["request_counts"]["total"] == 3
        long = await runner.store.lines.find_one({"batch": batch["_id"], "line": 2})
        assert long["outcome"] == batch_runner.FAILED and long["error"]["code"] == "line_too_large"
        assert f"the line has {line_size} bytes" in long["error"]["message"]
        # Joined it would be the line (24 MiB) and its text again; streamed, chunks of 255 KiB.
        assert peak < 4 * LIMIT, f"validation held {peak} bytes for a {size}-byte line"
    finally:
        await mongo.drop_database(database)
