"""Stored quotas are atomic: an upload is reserved against its tenant's file quota (beside
the files it keeps and every other upload being stored) before it is stored, and released
when it ends, however; so 20 concurrent uploads cannot all pass a quota that fits 5."""

from __future__ import annotations

import asyncio
import gzip
import json
import secrets
import time
import zlib
from collections.abc import Iterator

import httpx
import pytest

from tests.bounds import Watch
from tests.test_tenants import client_for, new_key

QUOTA = 5 * (1 << 20)
FILE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n' * 13_000  # ~1 MiB


@pytest.fixture(scope="module")
def small_quota_gateway(stack) -> Iterator[tuple[str, int]]:
    """The gateway's URL and pid (its loop's pauses and memory are read while the test sends)."""
    process, url = stack.start_gateway("gateway-upload-quota", TENANT_MAX_FILE_BYTES=str(QUOTA))
    assert process.pid is not None
    yield url, process.pid
    stack.stop(process)


@pytest.fixture(scope="module")
def small_quota(small_quota_gateway: tuple[str, int]) -> str:
    return small_quota_gateway[0]


async def upload(client: httpx.AsyncClient) -> httpx.Response:
    return await client.post("/v1/files", files={"file": ("in.jsonl", FILE)}, data={"purpose": "batch"})


async def test_twenty_concurrent_uploads_cannot_all_pass_a_small_quota(stack, small_quota_gateway) -> None:
    assert len(FILE) <= 1 << 20
    small_quota, pid = small_quota_gateway
    async with client_for(stack, await new_key(stack, "tenant-upload-race"), url=small_quota) as client:
        with Watch(small_quota, pid) as seen:
            answers = await asyncio.gather(*(upload(client) for _ in range(20)))
        assert seen.pauses == 0 and seen.grown < 100 << 20, seen
        stored = [a.json() for a in answers if a.status_code == 200]
        refused = [a for a in answers if a.status_code != 200]
        assert all(a.status_code == 403 for a in refused), [a.text for a in refused]
        assert {a.json()["error"]["code"] for a in refused} <= {"file_bytes_quota_exceeded"}
        assert sum(f["bytes"] for f in stored) <= QUOTA, f"{len(stored)} files stored"
        assert len(stored) == QUOTA // len(FILE)  # the reservations of refused ones were released
        for found in stored:
            await client.delete(f"/v1/files/{found['id']}")
        again = await upload(client)
    assert again.status_code == 200, again.text  # every reservation released


# ---- reserved before the body: raw connections, so a body can be held back ----------------

BOUNDARY = "quota-boundary"
# What the gateway takes an upload's framing to be when it reserves it (files.RESERVED_FRAMING).
RESERVED_FRAMING = 4096
# Long enough for a gateway to answer what it answers before a body, however loaded the machine.
ANSWER_WITHIN_S = 60.0


def form(content: bytes) -> bytes:
    """A multipart body as a client sends it: purpose batch, then the file."""
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    )
    return head.encode() + content + f"\r\n--{BOUNDARY}--\r\n".encode()


def lines_of(size: int) -> bytes:
    """JSONL of about size bytes that compresses about tenfold (under the ratio cap)."""
    line = b'{"custom_id": "%s", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    return b"".join(line % secrets.token_hex(6).encode() for _ in range(size // 90 + 1))


def past(compressed: bytes, size: int) -> int:
    """How many bytes of a gzip stream decode to more than size bytes (16 KiB at a time)."""
    decoder, decoded = zlib.decompressobj(wbits=31), 0
    for start in range(0, len(compressed), 1 << 14):
        decoded += len(decoder.decompress(compressed[start : start + (1 << 14)]))
        if decoded > size:
            return start + (1 << 14)
    raise AssertionError(f"the stream decodes to {decoded} bytes, not over {size}")


class RawUpload:
    """POST /v1/files on a connection of its own: the head sent first, the body (or parts
    of it) only when the test says, the answer read whenever it comes."""

    def __init__(self, url: str, key: str, *, length: int | None, encoding: str | None = None) -> None:
        self.port = int(url.rsplit(":", 1)[1])
        self.key, self.length, self.encoding = key, length, encoding
        self.reader: asyncio.StreamReader
        self.writer: asyncio.StreamWriter

    async def open(self) -> RawUpload:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        head = (
            f"POST /v1/files HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {self.key}\r\n"
            f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
        )
        head += f"Content-Length: {self.length}\r\n" if self.length is not None else "Transfer-Encoding: chunked\r\n"
        if self.encoding is not None:
            head += f"Content-Encoding: {self.encoding}\r\n"
        self.writer.write(head.encode() + b"\r\n")
        await self.writer.drain()
        return self

    async def send(self, data: bytes) -> None:
        self.writer.write(data if self.length is not None else b"%x\r\n%s\r\n" % (len(data), data))
        await self.writer.drain()

    async def end(self) -> None:
        if self.length is None:
            self.writer.write(b"0\r\n\r\n")
            await self.writer.drain()

    async def answer(self) -> tuple[int, dict]:
        status = int((await self.reader.readline()).split()[1])
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        return status, json.loads(await self.reader.readexactly(length))

    def close(self) -> None:
        self.writer.close()


async def answered(tasks: list[asyncio.Task], count: int) -> None:
    """Wait until count of the tasks are done (failing past ANSWER_WITHIN_S)."""
    deadline = asyncio.get_running_loop().time() + ANSWER_WITHIN_S
    while sum(task.done() for task in tasks) < count:
        left = deadline - asyncio.get_running_loop().time()
        assert left > 0, f"{sum(t.done() for t in tasks)} of {len(tasks)} answered, {count} expected"
        await asyncio.wait([t for t in tasks if not t.done()], timeout=left, return_when=asyncio.FIRST_COMPLETED)


async def live_reservations(redis, tenant: str) -> int:
    """The tenant's uploads reserved now (not released), as the gateway keeps them."""
    held = await redis.hgetall(f"uploads:reserved:{{{tenant}}}")
    return sum(not value.startswith("R") for value in held.values())


async def test_concurrent_uploads_past_the_quota_are_refused_before_their_bodies_are_sent(stack, small_quota) -> None:
    # Before: the check before the body reserved nothing, so all 20 passed it and waited
    # for their bodies (reserved only once spooled, 15 refused after their 1 MiB each).
    key = await new_key(stack, f"tenant-upload-held-{time.time_ns()}")
    body = form(FILE)
    uploads = [await RawUpload(small_quota, key, length=len(body)).open() for _ in range(20)]
    try:
        answers = [asyncio.create_task(u.answer()) for u in uploads]
        fits = QUOTA // len(FILE)
        refused = 20 - fits
        await answered(answers, refused)
        early = [task.result() for task in answers if task.done()]
        assert len(early) == refused and all(status == 403 for status, _ in early), early
        assert {answer["error"]["code"] for _, answer in early} == {"file_bytes_quota_exceeded"}
        held = [u for u, task in zip(uploads, answers, strict=True) if not task.done()]
        for upload in held:  # the reserved ones, their bodies sent only now
            await upload.send(body)
        await answered(answers, 20)
        stored = [task.result() for task in answers if task.result()[0] != 403]
        assert [status for status, _ in stored] == [200] * fits, stored
    finally:
        for upload in uploads:
            upload.close()
    async with client_for(stack, key, url=small_quota) as client:
        for _, found in stored:
            assert (await client.delete(f"/v1/files/{found['id']}")).status_code == 200


async def test_an_upload_reserved_before_its_body_is_released_when_its_client_goes_away(
    stack, small_quota, redis
) -> None:
    tenant = f"tenant-upload-gone-{time.time_ns()}"
    key = await new_key(stack, tenant)
    whole = await RawUpload(small_quota, key, length=QUOTA + RESERVED_FRAMING).open()  # the whole quota, declared
    try:
        deadline = time.monotonic() + ANSWER_WITHIN_S
        while await live_reservations(redis, tenant) == 0:  # Before: never reserved
            assert time.monotonic() < deadline, "the declared upload was not reserved before its body"
            await asyncio.sleep(0.05)
        async with client_for(stack, key, url=small_quota) as client:
            refused = await upload(client)
            assert refused.status_code == 403, refused.text  # the quota is held
            whole.close()  # gone without a byte of its body
            while await live_reservations(redis, tenant) > 0:
                assert time.monotonic() < deadline, "the abandoned upload's reservation was not released"
                await asyncio.sleep(0.05)
            again = await upload(client)
            assert again.status_code == 200, again.text
            await client.delete(f"/v1/files/{again.json()['id']}")
    finally:
        whole.close()


async def test_a_gzip_upload_is_refused_once_what_it_decodes_to_passes_the_quota(stack, small_quota) -> None:
    # Declared small (its compressed size); decoded past the quota while it streams, it is
    # refused before the rest of it is sent. Before: spooled whole, refused after.
    key = await new_key(stack, f"tenant-upload-gzip-{time.time_ns()}")
    compressed = gzip.compress(form(lines_of(QUOTA + QUOTA // 2)))
    assert len(compressed) < QUOTA // 4
    cut = past(compressed, QUOTA + (1 << 16))  # what is sent decodes to just past the quota
    zipped = await RawUpload(small_quota, key, length=len(compressed), encoding="gzip").open()
    try:
        await zipped.send(compressed[:cut])
        status, answer = await asyncio.wait_for(zipped.answer(), ANSWER_WITHIN_S)
    finally:
        zipped.close()
    assert status == 403 and answer["error"]["code"] == "file_bytes_quota_exceeded", (status, answer)
    async with client_for(stack, key, url=small_quota) as client:
        again = await upload(client)  # the reservation it grew to was released
        assert again.status_code == 200, again.text
        await client.delete(f"/v1/files/{again.json()['id']}")


async def test_a_chunked_upload_is_reserved_as_it_streams_and_refused_past_the_quota(stack, small_quota) -> None:
    # No Content-Length: reserved as its bytes arrive, refused before the rest is sent.
    # Before: spooled whole (up to MAX_FILE_BYTES), refused after.
    key = await new_key(stack, f"tenant-upload-chunked-{time.time_ns()}")
    body = form(lines_of(QUOTA + QUOTA // 2))
    chunked = await RawUpload(small_quota, key, length=None).open()
    try:
        for start in range(0, QUOTA + (1 << 17), 1 << 16):  # just past the quota
            await chunked.send(body[start : start + (1 << 16)])
        status, answer = await asyncio.wait_for(chunked.answer(), ANSWER_WITHIN_S)
    finally:
        chunked.close()
    assert status == 403 and answer["error"]["code"] == "file_bytes_quota_exceeded", (status, answer)
    small = await RawUpload(small_quota, key, length=None).open()  # one that fits is stored
    try:
        await small.send(form(FILE))
        await small.end()
        status, answer = await asyncio.wait_for(small.answer(), ANSWER_WITHIN_S)
    finally:
        small.close()
    assert status == 200 and answer["bytes"] == len(FILE), (status, answer)
