"""Admission by bytes has the shape of admission by count (SUBMIT's `admit`, on a real
Redis): the tenant's share binds only while others wait, its reserve admits it however full
the shard, and the bytes are the payload as stored, counted once."""

from __future__ import annotations

import math
import time

from gateway.protocol import new_request_id
from gateway.protocol.redis_keys import Shard
from gateway.server.queue.jobs import Admission, JobStore, NewRequest, inputs_delta, stored_inputs
from gateway.server.settings import GatewaySettings
from gateway.server.submission import admission
from gateway.server.tenants.caller import Caller

SHARD = Shard(0)
KB = 1024


def sized(nbytes: int) -> NewRequest:
    """A request whose stored payload is about nbytes."""
    now = time.time()
    return NewRequest(new_request_id(now), {"inputs": {"text": "x" * nbytes}}, now, now + 60)


async def submit(store: JobStore, tenant: str, requests: list[NewRequest], rules: Admission) -> str:
    return (await store.submit(requests, model="m", tenant=tenant, band="normal", admission=rules)).outcome


# Shard's cap 100 KB, a tenant's share 40 KB, its reserve 10 KB; counts never bind here.
BYTES = Admission(
    max_backlog=10_000, max_batch_backlog=10_000, max_bytes=100 * KB, tenant_bytes_share=40 * KB, bytes_reserve=10 * KB
)


async def test_alone_a_tenant_may_fill_the_shards_bytes_past_its_share(store: JobStore) -> None:
    assert await submit(store, "alone", [sized(30 * KB) for _ in range(3)], BYTES) == "accepted"


async def test_with_others_waiting_a_tenant_keeps_to_its_share_of_the_bytes(store: JobStore) -> None:
    assert await submit(store, "other", [sized(KB)], BYTES) == "accepted"
    assert await submit(store, "greedy", [sized(30 * KB)], BYTES) == "accepted"
    submitted = await store.submit([sized(30 * KB)], model="m", tenant="greedy", band="normal", admission=BYTES)
    assert (submitted.outcome, submitted.reason) == ("full", "tenant_bytes")


async def test_below_its_byte_reserve_a_tenant_is_admitted_when_the_shard_is_full(store: JobStore) -> None:
    wide = Admission(**{**BYTES.__dict__, "tenant_bytes_share": 0})
    assert await submit(store, "flood", [sized(33 * KB) for _ in range(3)], wide) == "accepted"
    full = await store.submit([sized(20 * KB)], model="m", tenant="someone", band="normal", admission=wide)
    assert (full.outcome, full.reason) == ("full", "bytes")
    assert await submit(store, "light", [sized(5 * KB)], wide) == "accepted"


async def test_bytes_are_freed_per_tenant_when_its_requests_start(store: JobStore) -> None:
    assert await submit(store, "other", [sized(KB)], BYTES) == "accepted"
    assert await submit(store, "t", [sized(35 * KB)], BYTES) == "accepted"
    assert await submit(store, "t", [sized(35 * KB)], BYTES) != "accepted"
    while await store.take(SHARD, "m", "c1") not in ("empty", "held"):
        pass
    assert await store.redis.hget(SHARD.backlog, "B:t") is None
    assert await submit(store, "t", [sized(35 * KB)], BYTES) == "accepted"


async def test_text_is_counted_as_its_utf8_bytes_not_as_escapes(store: JobStore) -> None:
    cjk = "漢" * 1000  # 3,000 bytes in UTF-8; 6,000 as \\u escapes
    now = time.time()
    request = NewRequest(new_request_id(now), {"inputs": {"text": cjk}}, now, now + 60)
    assert len(request.stored) < 3_100
    assert await submit(store, "cjk", [request], BYTES) == "accepted"
    assert int(await store.redis.hget(SHARD.backlog, "B:cjk")) == len(request.stored)


def test_the_record_keeps_the_inputs_once_in_the_payload() -> None:
    inputs = {"text_input": "a long prompt " * 100}
    stored = {"text_input": inputs["text_input"], "max_tokens": 16}
    delta = inputs_delta(inputs, stored)
    assert delta == {"set": {"max_tokens": 16}, "drop": []}
    assert stored_inputs({"inputs": inputs, "stored_delta": delta}) == stored
    image = {"image": {"sha256": "ab", "bytes": 3}}
    assert (
        stored_inputs({"inputs": {"image_b64": "AAAA"}, "stored_delta": inputs_delta({"image_b64": "AAAA"}, image)})
        == image
    )


def test_with_many_shards_a_tenant_is_admitted_its_whole_byte_share() -> None:
    settings = GatewaySettings()
    rules = admission(settings, Caller(tenant="t"), "normal", 64)
    share = math.floor(settings.max_backlog_bytes * settings.tenant_backlog_share)
    assert rules.max_bytes == share > math.ceil(settings.max_backlog_bytes / 64)
