"""Reads that read what they answer: a status read of a queued request (a poll, a long
poll's wake-up, an SSE follower's tick) takes the fields it answers with from Redis, never
the request's payload. One key polling its own queued ~8 MB request moves < 4 KB of Redis
output a poll (Redis's own count: INFO stats total_net_output_bytes)."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import time
import zlib
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as aioredis
from PIL import Image

from gateway.server.api.events import QUEUE_EVERY_S
from tests.gateway_calls import submit
from tests.test_tenants import client_for, new_key, set_tenant, slot_held

POLL_BUDGET_BYTES = 4096
POLLS = 20


def png_with_private_chunk(size: int) -> bytes:
    """A 1×1 PNG carrying `size` bytes in an ancillary private chunk: it passes the image
    checks (its header says 1×1) and makes the request's payload megabytes."""
    out = io.BytesIO()
    Image.new("RGB", (1, 1)).save(out, "PNG")
    data = out.getvalue()
    chunk = b"prVt" + b"\0" * size
    private = struct.pack(">I", size) + chunk + struct.pack(">I", zlib.crc32(chunk))
    return data[:33] + private + data[33:]  # after the signature (8) and IHDR (25)


class RedisOutput:
    """Redis's count of the bytes it has sent (INFO stats total_net_output_bytes), less
    what it sent to this probe itself: each INFO reply is read raw and its length counted."""

    def __init__(self, url: str) -> None:
        self.redis = aioredis.from_url(url)
        self.own = 0

    async def info(self, section: str) -> dict[str, str]:
        connection = await self.redis.connection_pool.get_connection("INFO")
        try:
            await connection.send_command("INFO", section)
            raw: bytes = await connection.read_response()
        finally:
            await self.redis.connection_pool.release(connection)
        self.own += len(raw) + len(f"${len(raw)}\r\n") + 2  # a bulk string's frame
        return dict(line.split(":", 1) for line in raw.decode().splitlines() if ":" in line)

    async def sent(self) -> int:
        """Bytes sent to others so far (this probe's own INFO replies left out)."""
        total = int((await self.info("stats"))["total_net_output_bytes"])
        return total - self.own


@pytest.fixture
async def output(stack) -> AsyncIterator[RedisOutput]:
    probe = RedisOutput(stack.redis_url)
    yield probe
    await probe.redis.aclose()


@pytest.fixture
async def queued_big(stack) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """A key of its own tenant (max_concurrent 1, its one slot held by a long generation)
    and its queued clip_image request of ~7.9 MB."""
    tenant = "tenant-bounded-reads"
    await set_tenant(stack, tenant, limits={"max_concurrent": 1})
    image = base64.b64encode(png_with_private_chunk(5_900_000)).decode()
    async with client_for(stack, await new_key(stack, tenant)) as client, slot_held(client):
        request_id = await submit(client, {"model": "clip_image", "inputs": {"image": image}})
        try:
            first = (await client.get(f"/results/{request_id}")).json()
            assert first["status"] == "queued", first
            yield client, request_id
        finally:
            await client.post(f"/results/{request_id}/cancel")


async def test_polling_ones_own_queued_8mb_request_moves_under_4kb_of_redis_output_a_poll(output, queued_big) -> None:
    client, request_id = queued_big
    before = await output.sent()
    for _ in range(POLLS):
        answer = await client.get(f"/results/{request_id}")
        assert answer.status_code == 200 and answer.json()["status"] == "queued", answer.text
        assert answer.json()["queue"] is not None
    moved = await output.sent() - before
    assert moved / POLLS < POLL_BUDGET_BYTES, f"{moved / POLLS:.0f} bytes of Redis output a poll"


async def test_a_long_polls_wake_ups_of_a_queued_8mb_request_move_under_4kb_each(output, queued_big) -> None:
    client, request_id = queued_big
    before = await output.sent()
    for _ in range(3):  # each reads it when it starts and again when its wait runs out
        answer = await client.get(f"/results/{request_id}", params={"wait": 0.5})
        assert answer.status_code == 200 and answer.json()["status"] == "queued", answer.text
    moved = await output.sent() - before
    assert moved / 6 < POLL_BUDGET_BYTES, f"{moved / 6:.0f} bytes of Redis output a read"


async def test_an_sse_followers_ticks_on_a_queued_8mb_request_move_under_4kb_each(output, queued_big) -> None:
    client, request_id = queued_big
    async with client.stream("GET", f"/results/{request_id}/events") as response:
        assert response.status_code == 200
        lines = response.aiter_lines()
        while await anext(lines) != "event: queue":  # the follower's first tick is done
            pass
        before, started = await output.sent(), time.monotonic()
        # The window to measure is a span of ticks (one a second: events.QUEUE_EVERY_S), so
        # time is what it waits for here; the bound allows a tick for every second of it.
        while (elapsed := time.monotonic() - started) < 3 * QUEUE_EVERY_S:
            await asyncio.sleep(0.5)
        moved = await output.sent() - before
    ticks_at_most = elapsed / QUEUE_EVERY_S + 1
    assert moved / ticks_at_most < POLL_BUDGET_BYTES, f"{moved} bytes of Redis output in {elapsed:.1f} s"
