"""Admission as the server computes it, with several shards: a tenant's caps do not depend
on the shard count, its share of the backlog binds only while other tenants wait, and a
call that could never be admitted is refused as such, not with a 429 to retry for ever."""

from __future__ import annotations

import time
from datetime import datetime

import httpx

from gateway.protocol.redis_keys import shard_for_tenant
from tests.conftest import AUTH
from tests.gateway_calls import llm_body


def _tenant_key(url: str, tenant: str) -> dict[str, str]:
    created = httpx.post(f"{url}/admin/keys", headers=AUTH, json={"tenant": tenant}, timeout=30)
    assert created.status_code == 201, created.text
    return {"Authorization": f"Bearer {created.json()['key']}"}


def _two_tenants_of_one_shard(shards: int) -> tuple[str, str]:
    names = [f"adm-{time.time_ns()}-{i}" for i in range(64)]
    first = names[0]
    second = next(n for n in names[1:] if shard_for_tenant(n, shards) == shard_for_tenant(first, shards))
    return first, second


def test_an_idle_tenants_64_input_embeddings_call_is_answered_with_64_shards(stack) -> None:
    gateway, url = stack.start_gateway("gateway-64-shards", REDIS_URL=stack.redis_db_url(14), REDIS_SHARDS="64")
    try:
        body = {"model": "text_embed", "input": [f"sentence {i}" for i in range(64)]}
        response = httpx.post(f"{url}/v1/embeddings", headers=AUTH, json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert len(response.json()["data"]) == 64
    finally:
        stack.stop(gateway)


def test_a_tenant_alone_may_use_the_whole_backlog_and_keeps_to_its_share_while_others_wait(stack) -> None:
    gateway, url = stack.start_gateway(
        "gateway-share",
        ready_path="/healthz",
        REDIS_URL=stack.redis_db_url(15),
        REDIS_SHARDS="1",  # (with several, a tenant's shard admits at least its share)
        TRITON_GRPC_URLS="127.0.0.1:9",  # nothing runs: everything admitted waits
        MAX_BACKLOG="8",
        TENANT_BACKLOG_SHARE="0.25",  # two of eight
        TENANT_BACKLOG_RESERVE="0",
    )
    try:
        first, second = _two_tenants_of_one_shard(1)
        alone, other = _tenant_key(url, first), _tenant_key(url, second)
        with httpx.Client(base_url=url, timeout=30) as client:
            statuses = [
                client.post("/infer", headers=alone, json=llm_body(f"alone {i}", 4)).status_code for i in range(6)
            ]
            assert statuses == [202] * 6  # beyond its share of two: nobody else waits
            assert client.post("/infer", headers=other, json=llm_body("me too", 4)).status_code == 202
            refused = client.post("/infer", headers=alone, json=llm_body("one more", 4))
            assert refused.status_code == 429, refused.text
            assert "of your requests are waiting" in refused.json()["error"]["message"]
    finally:
        stack.stop(gateway)


def test_a_call_that_could_never_be_admitted_is_refused_naming_the_limit(stack) -> None:
    gateway, url = stack.start_gateway(
        "gateway-never-fits",
        ready_path="/healthz",
        REDIS_URL=stack.redis_db_url(16),
        TRITON_GRPC_URLS="127.0.0.1:9",
        MAX_BACKLOG="8",
    )
    try:
        body = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "n": 9, "max_tokens": 1}
        response = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "too_many_requests_in_call"
        assert "at most 8" in response.json()["error"]["message"]
        # An embeddings call is one request whatever its inputs: 9 of them fit where 8 may wait.
        many = {"model": "text_embed", "inputs": {"text": [f"sentence {i}" for i in range(9)]}}
        assert httpx.post(f"{url}/infer", headers=AUTH, json=many, timeout=30).status_code == 202
    finally:
        stack.stop(gateway)


def _when(record: dict, name: str) -> float:
    return datetime.fromisoformat(record[name]).timestamp()


def test_an_embedding_beside_a_flood_of_llm_requests_on_one_replica_does_not_wait_for_the_flood(stack) -> None:
    gateway, url = stack.start_gateway("gateway-two-models", REDIS_URL=stack.redis_db_url(17), REPLICA_MAX_INFLIGHT="4")
    try:
        flood = _tenant_key(url, f"flood-{time.time_ns()}")
        with httpx.Client(base_url=url, timeout=60) as client:
            body = {"model": "llm_synthetic", "inputs": {"text_input": "go on", "max_tokens": 96}}
            flooded = [client.post("/infer", headers=flood, json=body).json()["request_id"] for _ in range(12)]
            embedded = client.post(
                "/infer",
                headers={**AUTH, "Prefer": "wait=60"},
                json={"model": "text_embed", "inputs": {"text": "beside the flood"}},
            ).json()
            assert embedded["status"] == "succeeded", embedded
            first = [client.get(f"/results/{rid}", headers=flood, params={"wait": 60}).json() for rid in flooded[:4]]
        # The llm model's four slots were all taken (each run two seconds): the embedding
        # started before any of them ended, on its own model's slots.
        assert all(r["status"] == "succeeded" for r in first), first
        assert _when(embedded, "started_at") < min(_when(r, "finished_at") for r in first)
    finally:
        stack.stop(gateway)


def test_an_idle_tenants_256_input_call_of_long_cjk_text_is_answered_with_64_shards(stack) -> None:
    # 256 inputs of 3,000 CJK characters: 2.3 MB as stored (UTF-8, once); counted escaped
    # and twice it was 9.2 MB, over a 64th of MAX_BACKLOG_BYTES, refused with a 429 forever.
    gateway, url = stack.start_gateway("gateway-64-shards-cjk", REDIS_URL=stack.redis_db_url(13), REDIS_SHARDS="64")
    try:
        body = {"model": "text_embed", "input": [f"{i} " + "漢字文" * 1000 for i in range(256)]}
        response = httpx.post(f"{url}/v1/embeddings", headers=AUTH, json=body, timeout=300)
        assert response.status_code == 200, response.text[:500]
        assert len(response.json()["data"]) == 256
    finally:
        stack.stop(gateway)


def test_a_call_whose_bytes_could_never_be_admitted_is_refused_naming_the_limit(stack) -> None:
    gateway, url = stack.start_gateway(
        "gateway-never-fits-bytes",
        ready_path="/healthz",
        REDIS_URL=stack.redis_db_url(12),
        TRITON_GRPC_URLS="127.0.0.1:9",
        MAX_BACKLOG_BYTES="200000",
        TENANT_BACKLOG_RESERVE_BYTES="0",
    )
    try:
        body = {"model": "text_embed", "input": ["words " * 5000 for _ in range(8)]}  # ~240 KB
        response = httpx.post(f"{url}/v1/embeddings", headers=AUTH, json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "call_too_large"
        assert "200000 bytes" in response.json()["error"]["message"]
    finally:
        stack.stop(gateway)


def test_one_tenants_waiting_bytes_do_not_lock_out_another_tenant_of_its_shard(stack) -> None:
    gateway, url = stack.start_gateway(
        "gateway-bytes-share",
        ready_path="/healthz",
        REDIS_URL=stack.redis_db_url(11),
        REDIS_SHARDS="1",
        TRITON_GRPC_URLS="127.0.0.1:9",  # nothing runs: everything admitted waits
        MAX_BACKLOG_BYTES="400000",
        TENANT_BACKLOG_RESERVE_BYTES="100000",
    )
    try:
        first, second = _two_tenants_of_one_shard(1)
        flood, light = _tenant_key(url, first), _tenant_key(url, second)
        with httpx.Client(base_url=url, timeout=30) as client:
            big = {"model": "text_embed", "inputs": {"text": "words " * 10_000}}  # ~60 KB as stored
            statuses = [client.post("/infer", headers=flood, json=big).status_code for _ in range(8)]
            assert statuses[:6] == [202] * 6 and statuses[-1] == 429  # alone: the whole 400 KB
            # As large as the flood's, it no longer fits the shard's bytes, but fits its reserve.
            assert client.post("/infer", headers=light, json=big).status_code == 202
    finally:
        stack.stop(gateway)


def test_a_call_refused_by_a_full_backlog_costs_no_quota(stack) -> None:
    gateway, url = stack.start_gateway(
        "gateway-refund",
        ready_path="/healthz",
        REDIS_URL=stack.redis_db_url(10),
        REDIS_SHARDS="1",
        TRITON_GRPC_URLS="127.0.0.1:9",  # nothing runs: everything admitted waits
        MAX_BACKLOG="2",
        TENANT_BACKLOG_SHARE="1",
        TENANT_BACKLOG_RESERVE="0",
    )
    try:
        tenant = f"adm-refund-{time.time_ns()}"
        settings = {"limits": {"requests_per_minute": 10}}
        assert httpx.put(f"{url}/admin/tenants/{tenant}", headers=AUTH, json=settings, timeout=30).status_code == 200
        key = _tenant_key(url, tenant)
        with httpx.Client(base_url=url, timeout=30) as client:
            accepted = [client.post("/infer", headers=key, json=llm_body(f"in {i}", 4)) for i in range(2)]
            assert [r.status_code for r in accepted] == [202, 202]
            refused = [client.post("/infer", headers=key, json=llm_body(f"out {i}", 4)) for i in range(6)]
        assert {r.json()["error"]["code"] for r in refused} == {"backlog_full"}
        # Each refusal was charged, then given back: the last saw 10 - 2 accepted - itself.
        assert refused[-1].headers["x-ratelimit-remaining-requests"] == "7"
    finally:
        stack.stop(gateway)
