"""A tenant's share of every shared pool: the event hub's followers and long polls, the
webhook sender's slots (and the backoff of a tenant whose receiver keeps stalling), and
searches. A tenant over its share gets 429 tenant_share_exceeded naming the pool; another
tenant notices nothing.

Low limits live in processes of their own (a gateway, a binder, each on a Redis database
of its own), never in the shared stack's settings."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx
import pytest
import redis.asyncio as aioredis

from binder.webhooks.queue import Allowance, WebhookQueue
from binder.webhooks.sender import TenantShare, TenantSlots
from gateway.protocol import ResultRecord
from gateway.protocol.http import SearchRequest
from gateway.protocol.redis_keys import webhook_slot
from gateway.server.errors import Busy, Unavailable
from gateway.server.search.service import SearchService
from gateway.server.tenants.config import TenantConfig
from gateway.server.tenants.shares import SharedPool, ShareExceeded, share_of
from gateway.server.tenants.usage import UsageLedger
from tests.conftest import AUTH, lone_redis
from tests.gateway_calls import llm_body, submit
from tests.records import publish, text_record

# Redis databases of the processes these tests start (the stack's own is 0).
_databases = itertools.count(30)


# -- the pools' arithmetic ---------------------------------------------------------------------


def test_a_tenants_share_is_the_fraction_of_the_pool_at_least_the_floor_at_most_the_pool() -> None:
    assert share_of(10_000, 0.25, 16) == 2500
    assert share_of(40, 0.25, 16) == 16  # the floor
    assert share_of(8, 0.25, 16) == 8  # never more than the pool
    assert share_of(4, 0.5, 1) == 2


def test_a_tenant_at_its_share_is_refused_and_another_tenant_is_not() -> None:
    pool = SharedPool("event streams", total=4, share=2)
    with pool.hold("a"), pool.hold("a"):
        with pytest.raises(ShareExceeded) as refused:
            pool.check("a")
        assert refused.value.code == "tenant_share_exceeded"
        assert refused.value.details == {"pool": "event streams", "share": 2}
        assert isinstance(refused.value, Busy) and refused.value.headers["Retry-After"] == "1"
        with pool.hold("b"), pool.hold("b"), pytest.raises(Unavailable):  # the whole pool: nobody's share
            pool.check("c")
    pool.check("a")  # the holds ended with their blocks
    assert pool.held == 0 and not pool.by_tenant


def test_a_hold_ends_when_its_block_raises() -> None:
    pool = SharedPool("searches", total=None, share=1)
    with pytest.raises(RuntimeError), pool.hold("a"):
        raise RuntimeError("the search failed")
    with pool.hold("a"):
        pass


def _slots() -> TenantSlots:
    share = TenantShare(fraction=0.5, floor=1, slow_s=2.0, backoff_after=2, backoff_s=30.0)
    return TenantSlots(4, share, timeout_s=10.0)


def test_a_tenant_at_its_share_of_the_webhook_slots_gets_none_more_and_others_get_theirs() -> None:
    slots = _slots()
    assert slots.share == 2
    slots.started("a")
    slots.started("a")
    allowance = slots.allowance(now=1000.0)
    assert allowance.left == {"a": 0} and allowance.default == 2
    assert 1000.0 < allowance.until["a"] <= 1010.0  # deferred about until one of its attempts ends
    slots.ended("a", took_s=0.1, stalled=False, now=1001.0)
    assert slots.allowance(now=1001.0).left == {"a": 1}


def test_a_tenant_whose_attempts_keep_stalling_is_backed_off_then_probed_one_at_a_time() -> None:
    slots = _slots()
    for _ in range(2):
        slots.started("a")
    slots.ended("a", took_s=10.0, stalled=True, now=1000.0)
    assert slots.allowance(now=1000.0).left == {"a": 1}  # one stall: not yet
    slots.ended("a", took_s=10.0, stalled=True, now=1000.0)
    allowance = slots.allowance(now=1000.0)
    assert allowance.left == {"a": 0} and allowance.until["a"] == 1030.0  # backed off 30 s
    # After the backoff: one attempt at a time; it stalls again, the backoff doubles.
    assert slots.allowance(now=1031.0).left == {"a": 1}
    slots.started("a")
    assert slots.allowance(now=1031.0).left == {"a": 0}
    slots.ended("a", took_s=10.0, stalled=True, now=1041.0)
    assert slots.allowance(now=1041.0).until["a"] == 1101.0
    # A quick attempt ends the backoff: its whole share again.
    slots.started("a")
    slots.ended("a", took_s=0.2, stalled=False, now=1102.0)
    assert "a" not in slots.allowance(now=1102.0).left


def test_attempts_that_began_before_a_backoff_do_not_lengthen_it() -> None:
    slots = _slots()
    for _ in range(4):
        slots.started("a")
    for _ in range(4):  # the share's attempts all stall at once
        slots.ended("a", took_s=10.0, stalled=True, now=1000.0)
    assert slots.allowance(now=1000.0).until["a"] == 1030.0


# -- the claim, against a real Redis ------------------------------------------------------------


@pytest.fixture(scope="module")
def lone_redis_url(tmp_path_factory: pytest.TempPathFactory):
    with lone_redis(tmp_path_factory, "shared-pools-redis") as url:
        yield url


def _hook_records(tenant: str, count: int, url: str = "http://127.0.0.1:9/hook") -> list[ResultRecord]:
    return [text_record(webhook=url).model_copy(update={"tenant": tenant}) for _ in range(count)]


async def test_a_claim_leases_each_tenant_up_to_its_allowance_and_defers_the_rest_behind_the_others(
    lone_redis_url: str,
) -> None:
    redis = aioredis.from_url(lone_redis_url, decode_responses=True)
    await redis.flushdb()
    try:
        queue = WebhookQueue(redis, lease_s=60)
        a, b = _hook_records("pool-a", 6), _hook_records("pool-b", 2)
        await queue.enqueue(a)
        await queue.enqueue(b)  # due after all of a's
        now = time.time()
        claimed = await queue.claim(8, Allowance(default=2, left={"pool-a": 1}))
        assert sorted(d.tenant for d in claimed) == ["pool-a", "pool-b", "pool-b"]
        due = await redis.zrange(webhook_slot("pool-a", 1).due, 0, -1, withscores=True)
        deferred = [score for member, score in due if member.startswith(tuple(r.request_id for r in a))]
        # The five of a not leased: deferred by defer_s (behind b's), the one leased: to its lease's end.
        assert sum(1 for score in deferred if now < score <= now + 5) == 5
        # A tenant backed off: its due deliveries move to when the backoff ends.
        later = time.time() + 100
        await redis.zadd(webhook_slot("pool-a", 1).due, {f"{r.request_id}:completed": 0 for r in a[1:]})
        assert await queue.claim(8, Allowance(default=2, left={"pool-a": 0}, until={"pool-a": later})) == []
        scores = [await redis.zscore(webhook_slot("pool-a", 1).due, f"{r.request_id}:completed") for r in a[1:]]
        assert all(score == pytest.approx(later) for score in scores)
    finally:
        await redis.aclose()


# -- the event hub's followers and long polls, through a gateway of their own -------------------


async def _tenant_client(stack, base_url: str, name: str, **limits: int) -> httpx.AsyncClient:
    """A new tenant (with these limits) and a client of it on base_url."""
    tenant = f"{name}-{time.time_ns()}"
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH, timeout=30) as admin:
        response = await admin.post("/admin/keys", json={"tenant": tenant, "name": "shared pools test"})
        assert response.status_code == 201, response.text
        key = response.json()["key"]
        if limits:
            response = await admin.put(f"/admin/tenants/{tenant}", json={"limits": limits})
            assert response.status_code == 200, response.text
    return httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


async def _open_stream(exits: AsyncExitStack, client: httpx.AsyncClient, request_id: str) -> None:
    """An SSE stream of the request, held open (until exits closes) once its first event came."""
    response = await exits.enter_async_context(client.stream("GET", f"/results/{request_id}/events"))
    assert response.status_code == 200, await response.aread()
    # Kept until exits closes: an iterator of the body dropped would close the connection.
    lines = response.aiter_lines()
    exits.push_async_callback(lines.aclose)
    async for line in lines:
        if line.startswith("event:"):
            return
    raise AssertionError("the stream ended before its first event")


@pytest.fixture
async def small_gateway(stack) -> AsyncIterator[str]:
    """A gateway of its own with room for 4 followers, 2 a tenant, on a Redis database of
    its own (its requests run on the stack's Triton)."""
    process, url = stack.start_gateway(
        "gateway-shared-pools",
        REDIS_URL=stack.redis_db_url(next(_databases)),
        MAX_FOLLOWERS="4",
        TENANT_FOLLOWER_SHARE="0.5",
        TENANT_FOLLOWER_FLOOR="1",
        DRAIN_S="0",
    )
    try:
        yield url
    finally:
        stack.stop(process)


def _long() -> dict[str, object]:
    """A request that runs for a minute (llm_synthetic: 20 ms a token): its stream stays open."""
    return llm_body(max_tokens=3000, model="llm_synthetic")


async def _stream_status(client: httpx.AsyncClient, request_id: str) -> httpx.Response:
    """The answer to an SSE request, read whole unless it is a stream (then closed at once)."""
    async with client.stream("GET", f"/results/{request_id}/events") as response:
        if response.status_code != 200:
            await response.aread()
        return response


async def test_a_tenant_holding_its_share_of_streams_gets_429_and_another_tenants_streams_are_unaffected(
    stack, small_gateway: str
) -> None:
    a = await _tenant_client(stack, small_gateway, "streams-a")
    b = await _tenant_client(stack, small_gateway, "streams-b")
    async with a, b, AsyncExitStack() as exits:
        held = [await submit(a, _long()) for _ in range(3)]
        for request_id in held[:2]:
            await _open_stream(exits, a, request_id)
        # Its third stream, and a long poll: refused at once, the pool named.
        refused = await _stream_status(a, held[2])
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "tenant_share_exceeded"
        assert refused.json()["error"]["details"]["pool"] == "event streams and long polls"
        assert "retry-after" in refused.headers
        polled = await a.get(f"/results/{held[2]}", params={"wait": 30})
        assert polled.status_code == 429 and polled.json()["error"]["code"] == "tenant_share_exceeded"
        # A plain poll is no follower: answered.
        assert (await a.get(f"/results/{held[2]}")).status_code == 200
        # Prefer: wait over the share: the request is accepted all the same, answered at once.
        accepted = await a.post("/infer", json=_long(), headers={"Prefer": "wait=30"})
        assert accepted.status_code == 202, accepted.text
        # The other tenant: its streams and long polls as ever.
        mine = [await submit(b, _long()) for _ in range(2)]
        await _open_stream(exits, b, mine[0])
        live = await b.get(f"/results/{mine[1]}", params={"wait": 0.2})
        assert live.status_code == 200 and live.json()["status"] in ("queued", "running")


async def test_a_tenants_stream_that_ends_gives_its_place_back(stack, small_gateway: str) -> None:
    a = await _tenant_client(stack, small_gateway, "streams-back")
    async with a:
        ids = [await submit(a, _long()) for _ in range(3)]
        async with AsyncExitStack() as first:
            await _open_stream(first, a, ids[0])
            async with AsyncExitStack() as second:
                await _open_stream(second, a, ids[1])
                assert (await _stream_status(a, ids[2])).status_code == 429
        # The gateway releases a place once it sees the client gone: wait for that.
        deadline = time.monotonic() + 30
        while (await _stream_status(a, ids[2])).status_code != 200:
            assert time.monotonic() < deadline, "the ended streams' places never came back"
            await asyncio.sleep(0.1)


# -- searches -----------------------------------------------------------------------------------


async def test_a_tenants_searches_count_against_its_requests_per_minute_and_in_its_usage(stack) -> None:
    client = await _tenant_client(stack, stack.gateway_url, "search-rpm", requests_per_minute=2)
    async with client:
        for _ in range(2):
            found = await client.post("/search", json={"text": "a cat", "k": 1})
            assert found.status_code == 200, found.text
            assert found.headers["x-ratelimit-limit-requests"] == "2"
        refused = await client.post("/search", json={"text": "a cat", "k": 1})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited"
        assert int(refused.headers["retry-after"]) >= 1
        deadline = time.monotonic() + 30  # usage is written every half second
        while (await client.get("/usage")).json()["totals"].get("searches") != 2:
            assert time.monotonic() < deadline, (await client.get("/usage")).json()
            await asyncio.sleep(0.2)


class _Registry:
    def embedder(self, space: str, kind: str) -> object:
        return object()


class _Quotas:
    def __init__(self) -> None:
        self.charged: list[str] = []

    async def admit(self, config: TenantConfig, prompt_tokens: int) -> dict[str, str]:
        self.charged.append(config.tenant)
        return {"x-ratelimit-limit-requests": "100"}


class _HeldSearch(SearchService):
    """Searches whose embedding waits for `go` (a slow Triton)."""

    def __init__(self, quotas: _Quotas, usage: UsageLedger) -> None:
        binders = SimpleNamespace(nearest=_nothing)
        results = SimpleNamespace(get_many=_no_records)
        super().__init__(_Registry(), None, results, binders, quotas=quotas, usage=usage, tenant_concurrency=1)  # type: ignore[arg-type]
        self.go = asyncio.Event()
        self.embedding: list[str] = []

    async def embed(self, adapter: object, raw_inputs: dict[str, str | None], tenant: str | None) -> list[float]:
        self.embedding.append(str(raw_inputs["text"]))
        await self.go.wait()
        return [0.0]


async def _nothing(*args: object) -> list[dict[str, object]]:
    return []


async def _no_records(*args: object) -> dict[str, object]:
    return {}


async def test_a_tenant_running_its_share_of_searches_gets_429_uncharged_and_another_tenant_searches() -> None:
    quotas, usage = _Quotas(), UsageLedger(None)  # type: ignore[arg-type]
    search = _HeldSearch(quotas, usage)
    a, b = TenantConfig(tenant="search-a"), TenantConfig(tenant="search-b")
    first = asyncio.create_task(search.search(SearchRequest(text="held"), a.tenant, a))
    while search.embedding != ["held"]:
        await asyncio.sleep(0)
    with pytest.raises(ShareExceeded) as refused:
        await search.search(SearchRequest(text="second"), a.tenant, a)
    assert refused.value.details == {"pool": "searches", "share": 1}
    other = asyncio.create_task(search.search(SearchRequest(text="mine"), b.tenant, b))
    while search.embedding != ["held", "mine"]:  # b's search runs beside a's
        await asyncio.sleep(0)
    search.go.set()
    (found, headers), _ = await asyncio.gather(first, other)
    assert found.hits == [] and headers == {"x-ratelimit-limit-requests": "100"}
    assert quotas.charged == ["search-a", "search-b"]  # the refused search charged nothing
    assert {key.split(":")[1]: dict(counts) for key, counts in usage._pending.items()} == {
        "search-a": {"searches": 1},
        "search-b": {"searches": 1},
    }
    await search.search(SearchRequest(text="again"), a.tenant, a)  # its place came back


# -- webhooks: a tarpit receiver of one tenant, another tenant's receiver -------------------------


@dataclass
class Receivers:
    """A tarpit (reads each request and never answers) and a receiver that answers 200 at
    once, recording when each request came and when each tarpit connection closed."""

    tarpit_port: int = 0
    quick_port: int = 0
    tarpit: list[tuple[float, float | None]] = field(default_factory=list)  # (opened, closed)
    quick: list[float] = field(default_factory=list)

    async def hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = len(self.tarpit)
        self.tarpit.append((time.monotonic(), None))
        try:
            await reader.read()  # b"" once the sender gives up and closes
        except ConnectionError:
            pass
        finally:
            self.tarpit[number] = (self.tarpit[number][0], time.monotonic())
            writer.close()

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            self.quick.append(time.monotonic())
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
        finally:
            writer.close()

    def closed(self) -> list[float]:
        return [closed for _, closed in self.tarpit if closed is not None]

    def most_open_at_once(self) -> int:
        edges = sorted([(opened, 1) for opened, _ in self.tarpit] + [(c, -1) for c in self.closed()])
        return max(itertools.accumulate(step for _, step in edges), default=0)


@pytest.fixture
async def receivers() -> AsyncIterator[Receivers]:
    found = Receivers()
    tarpit = await asyncio.start_server(found.hold, "127.0.0.1", 0)
    quick = await asyncio.start_server(found.answer, "127.0.0.1", 0)
    found.tarpit_port = tarpit.sockets[0].getsockname()[1]
    found.quick_port = quick.sockets[0].getsockname()[1]
    yield found
    for server in (tarpit, quick):
        server.close()


def _binder_env(stack, **env: str) -> dict[str, str]:
    return {
        "REDIS_URL": stack.redis_db_url(next(_databases)),
        "MONGO_DB": f"shared_pools_{time.time_ns()}",
        "WEBHOOK_CONCURRENCY": "4",
        "WEBHOOK_TENANT_SHARE": "0.5",
        "WEBHOOK_TENANT_FLOOR": "1",
        "WEBHOOK_RETRY_SCHEDULE": "0",
        **env,
    }


async def test_a_tenants_tarpit_receiver_holds_its_share_of_slots_and_another_tenants_webhooks_arrive_meanwhile(
    stack, receivers: Receivers
) -> None:
    env = _binder_env(stack, WEBHOOK_TIMEOUT_S="20", WEBHOOK_LEASE_S="30", WEBHOOK_TENANT_BACKOFF_AFTER="100")
    process, _ = stack.start_binder("binder-shared-pools", **env)
    redis = aioredis.from_url(env["REDIS_URL"], decode_responses=True)
    try:
        tarpit = _hook_records("tarpit-a", 8, f"http://127.0.0.1:{receivers.tarpit_port}/hook")
        quick = _hook_records("quick-b", 3, f"http://127.0.0.1:{receivers.quick_port}/hook")
        await publish(redis, tarpit + quick)  # a's first: due before b's
        deadline = time.monotonic() + 60
        while len(receivers.quick) < len(quick):
            assert time.monotonic() < deadline, f"{len(receivers.quick)} of b's webhooks came"
            await asyncio.sleep(0.05)
        # b's came while a's first attempts were still held (none had timed out yet) ...
        assert receivers.tarpit and not receivers.closed()
        # ... and a never held more than its share of the 4 slots.
        assert receivers.most_open_at_once() <= 2
    finally:
        stack.stop(process)
        await redis.aclose()


async def test_a_tenant_whose_receiver_keeps_timing_out_is_backed_off(stack, receivers: Receivers) -> None:
    env = _binder_env(
        stack,
        WEBHOOK_TIMEOUT_S="1",
        WEBHOOK_LEASE_S="5",
        WEBHOOK_TENANT_SHARE="0.25",  # one slot: its attempts one after the other
        WEBHOOK_TENANT_BACKOFF_AFTER="2",
        WEBHOOK_TENANT_BACKOFF_S="120",
    )
    process, _ = stack.start_binder("binder-shared-pools-backoff", **env)
    redis = aioredis.from_url(env["REDIS_URL"], decode_responses=True)
    try:
        tarpit = _hook_records("backoff-a", 6, f"http://127.0.0.1:{receivers.tarpit_port}/hook")
        await publish(redis, tarpit)
        slot = webhook_slot("backoff-a", 1)
        left = [f"{r.request_id}:completed" for r in tarpit]
        deadline = time.monotonic() + 60
        while True:  # until a's two first attempts timed out and its other deliveries were deferred
            ended = len(receivers.closed())
            scores = [await redis.zscore(slot.due, member) for member in left]
            waiting = [s for s in scores if s is not None]
            if ended >= 2 and len(waiting) == 4 and min(waiting) > time.time() + 60:
                break
            assert time.monotonic() < deadline, f"{ended} attempts ended; due {waiting}"
            await asyncio.sleep(0.1)
        # Backed off after two stalls: the others were never attempted.
        assert len(receivers.tarpit) == 2
    finally:
        stack.stop(process)
        await redis.aclose()


async def test_v1_and_anthropic_streams_count_against_the_same_share_as_sse_streams(stack, small_gateway: str) -> None:
    a = await _tenant_client(stack, small_gateway, "streams-v1")
    async with a, AsyncExitStack() as exits:
        held = [await submit(a, _long()) for _ in range(2)]
        for request_id in held:
            await _open_stream(exits, a, request_id)
        chat = {"model": "llm_echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        refused = await a.post("/v1/chat/completions", json={**chat, "stream": True})
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "tenant_share_exceeded"
        message = {"model": "llm_echo", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        refused = await a.post("/v1/messages", json={**message, "stream": True})
        assert refused.status_code == 429, refused.text
        answered = await a.post("/v1/chat/completions", json=chat)  # not a stream: answered
        assert answered.status_code == 200, answered.text


async def _open_chat_stream(exits: AsyncExitStack, client: httpx.AsyncClient) -> None:
    """A /v1 chat stream of a long request, held open (until exits closes) once its first chunk came."""
    body = {"model": "llm_synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000}
    response = await exits.enter_async_context(
        client.stream("POST", "/v1/chat/completions", json={**body, "stream": True})
    )
    assert response.status_code == 200, await response.aread()
    lines = response.aiter_lines()
    exits.push_async_callback(lines.aclose)
    async for line in lines:
        if line.startswith("data:"):
            return
    raise AssertionError("the stream ended before its first chunk")


async def test_open_v1_streams_hold_their_tenants_share_not_only_the_total(stack, small_gateway: str) -> None:
    a = await _tenant_client(stack, small_gateway, "v1-streams-a")
    b = await _tenant_client(stack, small_gateway, "v1-streams-b")
    async with a, b, AsyncExitStack() as exits:
        for _ in range(2):
            await _open_chat_stream(exits, a)
        # Its share (2) held by its /v1 streams: its SSE stream is refused, another tenant's is not.
        refused = await _stream_status(a, await submit(a, _long()))
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "tenant_share_exceeded"
        await _open_stream(exits, b, await submit(b, _long()))
