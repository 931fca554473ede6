"""Tenants: every call needs a valid key; another tenant's objects read as unknown (404)
and do not change; an admin key manages its own tenant only, an operator key every tenant;
a tenant's settings change field by field; search stays inside a tenant and still returns k hits; per-tenant
limits answer 429 with OpenAI's rate-limit headers; usage is recorded; a flooding tenant
does not delay a light one, and still uses what it leaves."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from tests.conftest import AUTH
from tests.gateway_calls import submit, wait_result

ECHO = {"model": "llm_echo", "inputs": {"text_input": "hello tenant", "max_tokens": 50}}


async def new_key(stack, tenant: str, role: str = "user") -> str:
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH) as admin:
        response = await admin.post("/admin/keys", json={"tenant": tenant, "role": role, "name": "test"})
        assert response.status_code == 201, response.text
        return response.json()["key"]


def client_for(stack, key: str, url: str | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url or stack.gateway_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


async def set_tenant(stack, tenant: str, **settings) -> None:
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH) as admin:
        response = await admin.put(f"/admin/tenants/{tenant}", json=settings)
        assert response.status_code == 200, response.text


# A minute of tokens (one per 20 ms): with max_concurrent 1 its tenant's next requests queue.
HOLD = {"model": "llm_synthetic", "inputs": {"text_input": "hold the only slot", "max_tokens": 3000}, "stream": True}


@asynccontextmanager
async def slot_held(client: httpx.AsyncClient) -> AsyncIterator[str]:
    """A long generation of the client's tenant, running from entry until it is cancelled
    at exit: a tenant with max_concurrent 1 queues everything else meanwhile."""
    request_id = await submit(client, HOLD)
    try:
        deadline = time.monotonic() + 30
        while (await client.get(f"/results/{request_id}")).json()["status"] != "running":
            assert time.monotonic() < deadline, "the long generation never started"
            await asyncio.sleep(0.05)
        yield request_id
    finally:
        await client.post(f"/results/{request_id}/cancel")


async def waiting(redis: aioredis.Redis, tenant: str) -> int:
    """The tenant's requests waiting in the queue (its backlog counter, in every shard)."""
    count = 0
    async for backlog in redis.scan_iter(match="{s*}:backlog"):
        count += int(await redis.hget(backlog, f"t:{tenant}") or 0)
    return count


PROTECTED = [
    ("POST", "/infer"),
    ("GET", "/results/00D209GGVXB1THAC2XKHDBMWGMZ2R726H2C2"),
    ("GET", "/results/00D209GGVXB1THAC2XKHDBMWGMZ2R726H2C2/events"),
    ("POST", "/results/00D209GGVXB1THAC2XKHDBMWGMZ2R726H2C2/cancel"),
    ("POST", "/results/00D209GGVXB1THAC2XKHDBMWGMZ2R726H2C2/webhook/replay"),
    ("POST", "/search"),
    ("GET", "/models"),
    ("GET", "/usage"),
    ("GET", "/admin/keys"),
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/embeddings"),
    ("GET", "/v1/responses/resp_x"),
]


async def test_every_call_without_a_valid_key_is_401_and_health_stays_public(stack) -> None:
    revoked = await new_key(stack, "tenant-revoked")
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH) as admin:
        key_id = revoked.split("_")[1]
        assert (await admin.delete(f"/admin/keys/{key_id}")).status_code == 200
    await asyncio.sleep(0)  # (the revoking gateway drops its key cache at once)
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as anonymous:
        for headers in ({}, {"Authorization": "Bearer tgw_0000_wrong"}, {"Authorization": f"Bearer {revoked}"}):
            for method, path in PROTECTED:
                response = await anonymous.request(method, path, headers=headers, json={})
                assert response.status_code == 401, (method, path, headers, response.text)
                body = response.json()
                code = body["error"]["code"]
                assert code in ("missing_api_key", "invalid_api_key"), body
        for path in ("/healthz", "/readyz"):
            assert (await anonymous.get(path)).status_code == 200


async def test_a_user_key_cannot_manage_keys(stack) -> None:
    async with client_for(stack, await new_key(stack, "tenant-user")) as user:
        assert (await user.get("/admin/keys")).status_code == 403


# -- who manages which tenant: an admin its own, an operator every one ----------------------


def _key_id(key: str) -> str:
    return key.split("_")[1]  # tgw_<key id>_<secret>


async def test_an_admin_cannot_create_keys_for_another_tenant(stack) -> None:
    async with client_for(stack, await new_key(stack, "tenant-acme-1", "admin")) as acme:
        response = await acme.post("/admin/keys", json={"tenant": "tenant-beta-1", "role": "admin"})
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "not_found"
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH) as operator:
        listed = (await operator.get("/admin/keys", params={"tenant": "tenant-beta-1"})).json()["keys"]
    assert listed == []  # nothing was made


async def test_an_admin_reads_another_tenants_settings_and_usage_as_unknown(stack) -> None:
    await set_tenant(stack, "tenant-beta-2", limits={"requests_per_minute": 7})
    async with client_for(stack, await new_key(stack, "tenant-acme-2", "admin")) as acme:
        for path in ("/admin/tenants/tenant-beta-2", "/admin/tenants/tenant-beta-2/usage"):
            response = await acme.get(path)
            assert response.status_code == 404, (path, response.text)
        assert (await acme.get("/admin/tenants/tenant-acme-2")).status_code == 200  # its own


async def test_an_admin_cannot_replace_another_tenants_webhook_secrets(stack) -> None:
    await set_tenant(stack, "tenant-beta-3", webhook_secrets=[WEBHOOK_SECRET_A])
    async with client_for(stack, await new_key(stack, "tenant-acme-3", "admin")) as acme:
        response = await acme.put("/admin/tenants/tenant-beta-3", json={"webhook_secrets": [WEBHOOK_SECRET_B]})
    assert response.status_code == 404, response.text
    assert await _signing_secrets(stack, "tenant-beta-3") == [WEBHOOK_SECRET_A]


async def test_an_admin_lists_and_revokes_only_its_own_tenants_keys(stack) -> None:
    beta = await new_key(stack, "tenant-beta-4")
    mine = await new_key(stack, "tenant-acme-4")
    async with client_for(stack, await new_key(stack, "tenant-acme-4", "admin")) as acme:
        listed = (await acme.get("/admin/keys")).json()["keys"]
        other = await acme.get("/admin/keys", params={"tenant": "tenant-beta-4"})
        revoke_beta = await acme.delete(f"/admin/keys/{_key_id(beta)}")
        revoke_mine = await acme.delete(f"/admin/keys/{_key_id(mine)}")
    assert {k["tenant"] for k in listed} == {"tenant-acme-4"}
    assert other.status_code == 404 and revoke_beta.status_code == 404, (other.text, revoke_beta.text)
    assert revoke_mine.status_code == 200, revoke_mine.text
    async with client_for(stack, beta) as still:
        assert (await still.get("/usage")).status_code == 200  # beta's key still works


async def test_only_an_operator_makes_operator_keys(stack) -> None:
    async with client_for(stack, await new_key(stack, "tenant-acme-5", "admin")) as acme:
        response = await acme.post("/admin/keys", json={"tenant": "tenant-acme-5", "role": "operator"})
        replicas = await acme.get("/admin/replicas")  # the deployment's, not a tenant's
    assert response.status_code == 403 and response.json()["error"]["code"] == "operator_only", response.text
    assert replicas.status_code == 403 and replicas.json()["error"]["code"] == "operator_only", replicas.text


async def test_the_local_stacks_own_key_is_an_operator(stack) -> None:
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH) as operator:
        keys = (await operator.get("/admin/keys", params={"tenant": "local"})).json()["keys"]
    (own,) = [k for k in keys if k["id"] == _key_id(stack.api_key)]
    assert own["role"] == "operator"


def test_the_cli_makes_an_operator_key_that_manages_every_tenant(stack) -> None:
    gateway = str(Path(sys.executable).parent / "gateway")
    env = {**os.environ, "MONGO_URL": stack.mongo_url}
    made = subprocess.run(
        [gateway, "keys", "create", "--tenant", "tenant-ops", "--operator"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    key = json.loads(made.stdout)
    assert key["role"] == "operator"
    headers = {"Authorization": f"Bearer {key['key']}"}
    created = httpx.post(
        f"{stack.gateway_url}/admin/keys", headers=headers, json={"tenant": "tenant-ops-managed"}, timeout=30
    )
    assert created.status_code == 201, created.text


# -- PUT /admin/tenants/<t>: what the body leaves out is kept ------------------------------

WEBHOOK_SECRET_A = "whsec_" + "QUFB" * 8  # base64 of 24 bytes
WEBHOOK_SECRET_B = "whsec_" + "QkJC" * 8


async def _signing_secrets(stack, tenant: str) -> list[str]:
    """The secrets the binder signs the tenant's webhooks with (its document in MongoDB)."""
    from pymongo import AsyncMongoClient

    client: AsyncMongoClient = AsyncMongoClient(stack.mongo_url)
    try:
        database = os.environ.get("MONGO_DB", "triton_gateway")
        document = await client[database]["tenants"].find_one({"_id": tenant})
    finally:
        await client.close()
    return (document or {}).get("webhook_secrets") or []


async def test_a_put_of_limits_alone_keeps_the_tenants_webhook_secrets_and_endpoint(stack) -> None:
    endpoint = "http://127.0.0.1:9/openai-events"
    await set_tenant(stack, "tenant-keep", webhook_secrets=[WEBHOOK_SECRET_A], openai_webhook_url=endpoint)
    await set_tenant(stack, "tenant-keep", limits={"requests_per_minute": 5})
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH) as operator:
        settings = (await operator.get("/admin/tenants/tenant-keep")).json()
    assert settings["openai_webhook_url"] == endpoint
    assert settings["limits"]["requests_per_minute"] == 5
    assert await _signing_secrets(stack, "tenant-keep") == [WEBHOOK_SECRET_A]


async def test_a_put_of_one_limit_keeps_the_other_limits_and_the_weight(stack) -> None:
    await set_tenant(stack, "tenant-keep-limits", weight=3.0, limits={"requests_per_minute": 5, "max_concurrent": 2})
    await set_tenant(stack, "tenant-keep-limits", limits={"max_concurrent": 4})
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH) as operator:
        settings = (await operator.get("/admin/tenants/tenant-keep-limits")).json()
    assert settings["weight"] == 3.0
    assert settings["limits"]["requests_per_minute"] == 5 and settings["limits"]["max_concurrent"] == 4


async def test_another_tenants_request_reads_as_unknown_and_does_not_change(stack) -> None:
    async with (
        client_for(stack, await new_key(stack, "tenant-a")) as a,
        client_for(stack, await new_key(stack, "tenant-b")) as b,
    ):
        body = {
            "model": "llm_synthetic",
            "inputs": {"text_input": "mine", "max_tokens": 100},
            "stream": True,
            "webhook": {"url": "http://127.0.0.1:9/hook"},
        }
        request_id = await submit(a, body)
        for method, path in (
            ("GET", f"/results/{request_id}"),
            ("GET", f"/results/{request_id}/events"),
            ("POST", f"/results/{request_id}/cancel"),
            ("POST", f"/results/{request_id}/webhook/replay"),
            ("GET", f"/v1/responses/resp_{request_id}"),
        ):
            response = await b.request(method, path)
            assert response.status_code == 404, (path, response.text)
        record = await wait_result(a, request_id)
        assert record["status"] == "succeeded"  # B's cancel did nothing
        assert record["tenant"] == "tenant-a"


async def test_idempotency_keys_are_per_tenant(stack) -> None:
    async with (
        client_for(stack, await new_key(stack, "tenant-idem-a")) as a,
        client_for(stack, await new_key(stack, "tenant-idem-b")) as b,
    ):
        first = await submit(a, ECHO, **{"Idempotency-Key": "same-key"})
        other = await submit(b, ECHO, **{"Idempotency-Key": "same-key"})
        assert first != other


async def test_search_stays_inside_the_tenant_and_still_returns_k_hits(stack) -> None:
    async with (
        client_for(stack, await new_key(stack, "tenant-sa")) as a,
        client_for(stack, await new_key(stack, "tenant-sb")) as b,
    ):
        a_ids = [
            await submit(a, {"model": "text_embed", "inputs": {"text": f"a cat sits on mat {i}"}}) for i in range(6)
        ]
        b_ids = [
            await submit(b, {"model": "text_embed", "inputs": {"text": f"stock markets fell {i}"}}) for i in range(4)
        ]
        await asyncio.gather(*(wait_result(a, rid) for rid in a_ids), *(wait_result(b, rid) for rid in b_ids))
        deadline = time.monotonic() + 10
        while True:
            found = (await b.post("/search", json={"text": "a cat sits on the mat", "k": 4})).json()
            if len(found["hits"]) == 4 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert {h["request_id"] for h in found["hits"]} == set(b_ids)  # B's own four, never A's cats
        assert all(h["record"]["tenant"] == "tenant-sb" for h in found["hits"])


async def test_requests_per_minute_over_the_limit_are_429_with_openais_headers(stack) -> None:
    await set_tenant(stack, "tenant-rpm", limits={"requests_per_minute": 3})
    async with client_for(stack, await new_key(stack, "tenant-rpm")) as client:
        for _ in range(3):
            response = await client.post("/infer", json=ECHO)
            assert response.status_code == 202
            assert response.headers["x-ratelimit-limit-requests"] == "3"
        refused = await client.post("/infer", json=ECHO)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limited"
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s")


async def test_tokens_per_minute_count_real_usage(stack) -> None:
    await set_tenant(stack, "tenant-tpm", limits={"tokens_per_minute": 60})
    async with client_for(stack, await new_key(stack, "tenant-tpm")) as client:
        used = 0
        for _ in range(6):
            response = await client.post("/infer", json=ECHO, headers={"Prefer": "wait=30"})
            if response.status_code == 429:
                break
            record = response.json()
            used += record["usage"]["prompt_tokens"] + record["usage"]["completion_tokens"]
            await _until_usage_reaches(client, used)  # counted once the request has ended
        assert response.status_code == 429, "tokens per minute never refused"
        assert response.json()["error"]["code"] == "token_rate_limited"
        assert response.headers["x-ratelimit-limit-tokens"] == "60"
        assert used >= 60 - 30  # refused only once real usage had (nearly) spent the budget
        assert await _used_tokens(client) == used


async def _used_tokens(client: httpx.AsyncClient) -> int:
    totals = (await client.get("/usage", params={"days": 1})).json()["totals"]
    return totals.get("prompt_tokens", 0) + totals.get("completion_tokens", 0)  # none before the first flush


async def _until_usage_reaches(client: httpx.AsyncClient, tokens: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while await _used_tokens(client) < tokens:
        assert time.monotonic() < deadline, f"usage never reached {tokens} tokens"
        await asyncio.sleep(0.05)


async def test_keys_are_never_logged(stack) -> None:
    key = await new_key(stack, "tenant-secret")
    async with client_for(stack, key) as client:
        await client.post("/infer", json=ECHO, headers={"Prefer": "wait=30"})
        await client.get("/results/00D209GGVXB1THAC2XKHDBMWGMZ2R726H2C2")
    secret = key.split("_", 2)[2]  # tgw_<id>_<secret>; the secret may hold "_" itself
    for log in (stack.data_dir / "logs").glob("*.log"):
        text = log.read_text(errors="replace")
        assert secret not in text, f"{log.name} holds an API key"
        assert AUTH["Authorization"].split("_", 2)[2] not in text


# -- fairness ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_gateway(stack):
    """A gateway with four slots on the synthetic LLM, on its own Redis database."""
    process, url = stack.start_gateway("gateway-fair", REDIS_URL=stack.redis_db_url(62), REPLICA_MAX_INFLIGHT="4")
    yield url
    stack.stop(process)


SHORT = {"model": "llm_synthetic", "inputs": {"text_input": "fair share", "max_tokens": 20}}  # ~0.4 s
SLOTS = 4  # small_gateway's REPLICA_MAX_INFLIGHT


async def _steady(client: httpx.AsyncClient, count: int, every_s: float) -> list[dict]:
    """The records of `count` requests sent one every `every_s`, all succeeded."""
    ids = []
    for _ in range(count):
        ids.append(await submit(client, SHORT))
        await asyncio.sleep(every_s)
    records = await asyncio.gather(*(wait_result(client, rid, timeout=120) for rid in ids))
    assert [r["status"] for r in records] == ["succeeded"] * count
    return records


def _at(record: dict, key: str) -> float:
    return datetime.fromisoformat(record[key]).timestamp()


def _passed_by(light: list[dict], heavy: list[dict]) -> list[tuple[int, int]]:
    """For each light request, in order: how many heavy requests were waiting when it could
    start (submitted, and its tenant's previous request ended: a light tenant runs one at a
    time), and how many of those started before it did."""
    standings = []
    for previous, record in zip([None, *light], light, strict=False):
        ready = max(_at(record, "created_at"), _at(previous, "finished_at") if previous else 0.0)
        waiting = [h for h in heavy if _at(h, "created_at") < ready < _at(h, "started_at")]
        standings.append((len(waiting), sum(1 for h in waiting if _at(h, "started_at") < _at(record, "started_at"))))
    return standings


def _most_at_once(records: list[dict], until: float) -> int:
    """The most of these requests running at once at any start up to `until`. A run's slot
    is freed just before its record is stamped finished (no await between), so a start that
    took that slot is stamped after: the count is exact, however loaded the machine."""
    starts = [_at(r, "started_at") for r in records if _at(r, "started_at") <= until]
    return max(sum(1 for r in records if _at(r, "started_at") <= s < _at(r, "finished_at")) for s in starts)


async def test_a_flooding_tenant_neither_delays_a_light_one_nor_wastes_capacity(stack, small_gateway) -> None:
    async with (
        client_for(stack, await new_key(stack, "tenant-flood"), small_gateway) as a,
        client_for(stack, await new_key(stack, "tenant-light"), small_gateway) as b,
    ):
        alone = await _steady(b, 16, 0.5)
        flood_ids = [await submit(a, SHORT) for _ in range(60)]  # ~6 s of work for four slots
        beside = await _steady(b, 16, 0.5)
        flood = await asyncio.gather(*(wait_result(a, rid, timeout=120) for rid in flood_ids))
    assert [r["status"] for r in flood] == ["succeeded"] * len(flood)
    alone_ms, beside_ms = (statistics.median(r["timings"]["queue_ms"] for r in phase) for phase in (alone, beside))
    standings = _passed_by(beside, flood)
    print(f"light tenant queue wait: alone p50 {alone_ms:.1f} ms, beside the flood p50 {beside_ms:.1f} ms")
    print(f"flood requests waiting / started first, per light request: {standings}")
    # The flood had a backlog when the light tenant came back (else this tests nothing) ...
    assert standings[0][0] >= 10, standings
    # ... and the light tenant never waited behind it: each of its requests started ahead of
    # the flood's waiting ones (a FIFO queue would start all of them first), but for starts
    # already under way when it could start (one per slot at most). Counted in starts, not
    # milliseconds, so a loaded machine changes nothing.
    assert all(passed <= SLOTS for _, passed in standings), standings
    # Headroom, not waste: while the light tenant was about, the flood ran on every slot but
    # the one kept for it (three at once, never four), so a light request never waited for one
    # of the flood's runs to end, and the flood used what the light tenant left.
    assert _most_at_once(flood, until=_at(beside[-1], "started_at")) == SLOTS - 1


@pytest.fixture
def engine_gateway(stack):
    """A gateway with the default 32 slots a model, on its own Redis database: more than
    the local LLM engine runs at once (8 on a CPU)."""
    process, url = stack.start_gateway("gateway-engine-fair", REDIS_URL=stack.redis_db_url(45))
    yield url
    stack.stop(process)


def engine_capacity(stack, model: str) -> int:
    """What the engine reports it runs at once (TensorRT-LLM's request_type="max")."""
    text = httpx.get(f"http://127.0.0.1:{stack.s.triton_metrics_port}/metrics", timeout=10).text
    for line in text.splitlines():
        labels = ('request_type="max"', f'model="{model}"')
        if line.startswith("nv_trt_llm_request_metrics{") and all(label in line for label in labels):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError(f"{model} reports no capacity")


async def test_a_light_tenants_llm_request_waits_behind_at_most_what_the_engine_runs(stack, engine_gateway) -> None:
    capacity = engine_capacity(stack, "llm_engine")
    assert capacity < 32  # the gateway's own slots would let a flood fill the engine's queue
    body = {"model": "llm", "inputs": {"text_input": "a flood of work", "max_tokens": 256}}
    short = {"model": "llm", "inputs": {"text_input": "a light request", "max_tokens": 16}}
    queue = aioredis.Redis.from_url(stack.redis_db_url(45), decode_responses=True)
    async with (
        client_for(stack, await new_key(stack, "tenant-engine-flood"), engine_gateway) as a,
        client_for(stack, await new_key(stack, "tenant-engine-light"), engine_gateway) as b,
    ):
        flood = await asyncio.gather(*(submit(a, body) for _ in range(8 * capacity)))
        deadline = time.monotonic() + 60
        while await waiting(queue, "tenant-engine-flood") < 2 * capacity:  # a backlog waits
            assert time.monotonic() < deadline, "the flood never queued"
            await asyncio.sleep(0.02)
        light = await wait_result(b, await submit(b, short), timeout=300)
        records = await asyncio.gather(*(wait_result(a, rid, timeout=300) for rid in flood))
    await queue.aclose()
    assert light["status"] == "succeeded" and {r["status"] for r in records} == {"succeeded"}
    ahead = sum(1 for r in records if r["finished_at"] < light["finished_at"])
    # The gateway keeps no more in the engine than it runs, so the light request is next when
    # one of them ends and shares the engine with the rest: about `capacity` end before it.
    # (With the engine's queue filled to the gateway's 32 slots, ~32 did, in FIFO order.)
    assert ahead <= 2 * capacity, f"{ahead} of the flood's requests ended before the light tenant's"


# -- admission and quotas -----------------------------------------------------------------------


async def test_an_idempotent_replay_uses_none_of_the_quota(stack) -> None:
    await set_tenant(stack, "tenant-replay", limits={"requests_per_minute": 3})
    async with client_for(stack, await new_key(stack, "tenant-replay")) as client:
        replays = []
        for _ in range(5):  # a replay answers like the first call: 202, or 200 once it has ended
            response = await client.post("/infer", json=ECHO, headers={"Idempotency-Key": "the-same-call"})
            assert response.status_code in (200, 202), response.text
            replays.append(response.json()["request_id"])
        assert len(set(replays)) == 1
        for _ in range(2):  # the first call used one of three
            assert (await client.post("/infer", json=ECHO)).status_code == 202
        refused = await client.post("/infer", json=ECHO)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited"


def embeddings(count: int) -> dict:
    return {"model": "text_embed", "input": [f"input number {n}" for n in range(count)]}


async def test_a_many_input_embeddings_call_is_one_waiting_request_against_the_tenants_queue_cap(stack, redis) -> None:
    await set_tenant(stack, "tenant-embed-cap", limits={"max_concurrent": 1, "max_queued": 3})
    async with client_for(stack, await new_key(stack, "tenant-embed-cap")) as client:
        async with slot_held(client):  # whatever is admitted now stays queued, countable
            # Three calls of five inputs each: three waiting requests, not fifteen.
            fitting = [asyncio.create_task(client.post("/v1/embeddings", json=embeddings(5))) for _ in range(3)]
            deadline = time.monotonic() + 10
            while await waiting(redis, "tenant-embed-cap") < 3:
                assert time.monotonic() < deadline and not any(f.done() for f in fitting), "the calls were not queued"
                await asyncio.sleep(0.05)
            # A fourth call waits for nothing: 429, and nothing of it is queued.
            refused = await client.post("/v1/embeddings", json=embeddings(2))
            assert refused.status_code == 429, refused.text
            assert (refused.json()["error"]["type"], refused.json()["error"]["code"]) == (
                "rate_limit_error",
                "backlog_full",
            )
            assert await waiting(redis, "tenant-embed-cap") == 3
        answered = [await call for call in fitting]  # the slot was freed: they ran
    assert [a.status_code for a in answered] == [200, 200, 200]
    assert [item["index"] for item in answered[0].json()["data"]] == [0, 1, 2, 3, 4]


async def usage_totals(client: httpx.AsyncClient) -> dict[str, int]:
    return (await client.get("/usage", params={"days": 2})).json()["totals"]  # (today and, near midnight, yesterday)


async def test_a_request_cancelled_while_queued_is_counted_once_in_the_usage(stack) -> None:
    await set_tenant(stack, "tenant-cancel-queued", limits={"max_concurrent": 1})
    async with client_for(stack, await new_key(stack, "tenant-cancel-queued")) as client:
        async with slot_held(client) as running:
            queued = await submit(client, ECHO)
            assert (await client.get(f"/results/{queued}")).json()["status"] == "queued"
            cancelled = await client.post(f"/results/{queued}/cancel")
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "canceled", cancelled.text
        records = [await wait_result(client, rid) for rid in (queued, running)]
        # One more, that succeeds: once it is counted, what ended before it is counted too.
        after = await client.post("/infer", json=ECHO, headers={"Prefer": "wait=30"})
        records.append(after.json())
        deadline = time.monotonic() + 10
        while (usage := await usage_totals(client)).get("requests_succeeded", 0) < 1:
            assert time.monotonic() < deadline, f"the last request was never counted: {usage}"
            await asyncio.sleep(0.1)
    assert [r["status"] for r in records] == ["canceled", "canceled", "succeeded"]
    assert (usage["requests"], usage["requests_canceled"], usage["requests_succeeded"]) == (3, 2, 1)
    # The queued one reports the prompt it was admitted with, and no completion.
    assert records[0]["usage"]["prompt_tokens"] > 0 and records[0]["usage"]["completion_tokens"] == 0
    assert usage["prompt_tokens"] == sum(r["usage"]["prompt_tokens"] for r in records)


async def test_tokens_per_minute_charge_the_prompt_at_admission(stack) -> None:
    long_prompt = {"model": "llm_echo", "inputs": {"text_input": "tokens " * 60, "max_tokens": 1}}
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH, timeout=60) as measure:
        response = await measure.post("/infer", json=long_prompt, headers={"Prefer": "wait=30"})
        prompt_tokens = response.json()["usage"]["prompt_tokens"]
    # Room for one prompt and a half: the second fits only if the first's prompt was not charged.
    await set_tenant(stack, "tenant-tpm-prompt", limits={"tokens_per_minute": prompt_tokens * 3 // 2})
    async with client_for(stack, await new_key(stack, "tenant-tpm-prompt")) as client:
        assert (await client.post("/infer", json=long_prompt)).status_code == 202
        # The first one's ~180 prompt tokens are spent already, whether or not it has ended.
        refused = await client.post("/infer", json=long_prompt)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "token_rate_limited"


async def test_a_prompt_over_the_whole_tokens_per_minute_is_refused_for_good_not_told_to_retry(stack) -> None:
    # A 429 with Retry-After would have the caller retry a request no wait lets in.
    await set_tenant(stack, "tenant-tpm-tiny", limits={"tokens_per_minute": 5})
    key = await new_key(stack, "tenant-tpm-tiny")
    body = {"model": "llm_echo", "inputs": {"text_input": "tokens " * 60, "max_tokens": 1}}
    async with client_for(stack, key) as client:
        refused = await client.post("/infer", json=body)
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["code"] == "prompt_over_token_limit" and "retry-after" not in refused.headers
    openai_client = openai.AsyncOpenAI(base_url=f"{stack.gateway_url}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as too_large:
        await openai_client.chat.completions.create(
            model="llm_echo", messages=[{"role": "user", "content": "tokens " * 60}], max_tokens=1
        )
    assert too_large.value.code == "prompt_over_token_limit"
    await openai_client.close()


async def test_a_batch_does_not_fill_the_interactive_backlog(stack, tmp_path) -> None:
    from tests.test_openai_batches import chat_line, run_batch

    process, url = stack.start_gateway(
        "gateway-small-backlog", REDIS_URL=stack.redis_db_url(63), MAX_BACKLOG="20", REPLICA_MAX_INFLIGHT="2"
    )
    try:
        batcher = openai.OpenAI(base_url=f"{url}/v1", api_key=await new_key(stack, "tenant-batcher"), max_retries=0)
        lines = [chat_line(f"line-{i}", "go on", model="llm_synthetic", max_tokens=40) for i in range(40)]
        batch = await asyncio.to_thread(run_batch, batcher, lines)
        await set_tenant(stack, "tenant-urgent", priority="high")  # the high band is granted
        async with client_for(stack, await new_key(stack, "tenant-urgent"), url) as urgent:
            deadline = time.monotonic() + 60
            while (await asyncio.to_thread(batcher.batches.retrieve, batch.id)).status != "in_progress":
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
            response = await urgent.post("/infer", json={**SHORT, "priority": 10})
        assert response.status_code == 202, response.text
    finally:
        stack.stop(process)


# -- revocation --------------------------------------------------------------------------------


async def test_a_revoked_key_stops_working_on_every_gateway_at_once(stack) -> None:
    other, other_url = stack.start_gateway("gateway-revocation")
    try:
        key = await new_key(stack, "tenant-revoked-everywhere")
        async with client_for(stack, key, other_url) as client:
            assert (await client.get("/models")).status_code == 200  # now cached there
            async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH) as admin:
                assert (await admin.delete(f"/admin/keys/{key.split('_')[1]}")).status_code == 200
            revoked_at = time.monotonic()
            # Announced, the revocation drops the key there at once; missed, the key would still
            # pass until its cached verification (just made) is KEY_CACHE_S (10 s) old. Half of
            # that tells the two apart with room for a loaded machine.
            while (await client.get("/models")).status_code != 401:
                assert time.monotonic() - revoked_at < 10 / 2, "the other gateway still accepts the revoked key"
                await asyncio.sleep(0.02)
    finally:
        stack.stop(other)


# -- fairness across models and bands ----------------------------------------------------------


async def test_a_model_with_free_slots_starts_however_many_tenants_are_busy_on_others(stack, small_gateway) -> None:
    clients = [client_for(stack, await new_key(stack, f"tenant-embedder-{n}"), small_gateway) for n in range(40)]
    try:
        embeds = [
            await submit(c, {"model": "text_embed", "inputs": {"text": f"busy tenant {n}"}})
            for n, c in enumerate(clients)
        ]
        async with client_for(stack, await new_key(stack, "tenant-writer"), small_gateway) as writer:
            record = await wait_result(writer, await submit(writer, ECHO), timeout=60)
        await asyncio.gather(*(wait_result(c, rid) for c, rid in zip(clients, embeds, strict=True)))
    finally:
        for c in clients:
            await c.aclose()
    assert record["status"] == "succeeded"
    assert record["timings"]["queue_ms"] < 1000


async def test_a_light_tenant_beside_a_flood_and_four_batches_waits_as_if_alone(stack, small_gateway) -> None:
    from tests.test_openai_batches import chat_line, run_batch

    batcher = openai.OpenAI(
        base_url=f"{small_gateway}/v1", api_key=await new_key(stack, "tenant-four-batches"), max_retries=0
    )
    async with (
        client_for(stack, await new_key(stack, "tenant-flood-b"), small_gateway) as flood_client,
        client_for(stack, await new_key(stack, "tenant-light-b"), small_gateway) as light,
    ):
        alone = await _steady(light, 12, 0.5)
        lines = [chat_line(f"l{i}", "go on", model="llm_synthetic", max_tokens=20) for i in range(40)]
        batches = [await asyncio.to_thread(run_batch, batcher, lines) for _ in range(4)]
        flood_ids = [await submit(flood_client, SHORT) for _ in range(40)]
        beside = await _steady(light, 12, 0.5)  # every one accepted (submit checks the 202)
        flood = await asyncio.gather(*(wait_result(flood_client, rid, timeout=120) for rid in flood_ids))
    for batch in batches:  # (what is left of them: nothing else needs them)
        if (await asyncio.to_thread(batcher.batches.retrieve, batch.id)).status in ("validating", "in_progress"):
            await asyncio.to_thread(batcher.batches.cancel, batch.id)
    assert [r["status"] for r in flood] == ["succeeded"] * len(flood)
    alone_ms, beside_ms = (statistics.median(r["timings"]["queue_ms"] for r in phase) for phase in (alone, beside))
    print(f"light tenant queue wait: alone p50 {alone_ms:.1f} ms; beside a flood and 4 batches {beside_ms:.1f} ms")
    # As if alone: no light request waited behind the flood's backlog (counted in starts, see
    # _passed_by; the batches' lines are in the batch band, below both).
    standings = _passed_by(beside, flood)
    assert standings[0][0] >= 10, standings  # the flood had a backlog when the light tenant came back
    assert all(passed <= SLOTS for _, passed in standings), standings
