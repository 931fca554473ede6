"""The SSE event hub (gateway/server/results/events.py) on a real Redis, through the real
scripts: past a few streams followed in a shard it waits on the shard's notices (the
scripts name a followed request there when they write its events) and reads only the
streams named, instead of naming every stream in each blocking read; a notice that never
comes delays an event and loses none. One behaviour per test.

What a client sees of the events (order, resuming, replay) is specified against the whole
stack in tests/test_gateway_sse.py and tests/test_event_ids.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio import Redis

from gateway.protocol import State, new_request_id
from gateway.protocol.redis_keys import Shard
from gateway.server.queue.jobs import Admission, Job, JobStore, NewRequest, TokenEvent
from gateway.server.results.events import COUNT, NAMED_MOST, EventHub
from tests.conftest import lone_redis

SHARD = Shard(0)
OPEN = Admission(max_backlog=10_000, max_batch_backlog=10_000, max_bytes=10**9, reserve=4)
# Long enough that only a notice (or a new follower) makes the hub read a stream.
NEVER_S = 3600.0


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with lone_redis(tmp_path_factory, "hub-redis") as url:
        yield url


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Redis]:
    client = aioredis.from_url(redis_url, decode_responses=True)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture
def store(client: Redis) -> JobStore:
    return JobStore(client, idempotency_ttl_s=60, lease_ms=10_000)


class ReadLog:
    """The stream keys each XREAD of the hub's readers named (the connections are real)."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.reads: list[set[str]] = []

    async def connect(self, shard: Shard) -> Redis:
        connection = Redis.from_url(self.redis_url, decode_responses=True, single_connection_client=True)
        xread = connection.xread

        async def logged(streams: dict[str, str], *args: Any, **kwargs: Any) -> Any:
            self.reads.append(set(streams))
            return await xread(streams, *args, **kwargs)

        connection.xread = logged  # type: ignore[method-assign]
        return connection


@pytest.fixture
async def hubs(client: Redis, store: JobStore, redis_url: str) -> AsyncIterator[Any]:
    made: list[EventHub] = []

    def make(*, named_most: int, full_read_every_s: float = NEVER_S, log: ReadLog | None = None) -> EventHub:
        async def record(request_id: str, entry: str) -> str:
            return await store.record_at(SHARD, entry) or "{}"

        hub = EventHub(
            client,
            (log or ReadLog(redis_url)).connect,
            record,
            store.follow,
            named_most=named_most,
            full_read_every_s=full_read_every_s,
        )
        made.append(hub)
        return hub

    yield make
    for hub in made:
        await hub.close()


async def submitted(store: JobStore, count: int = 1) -> list[str]:
    ids = []
    for _ in range(count):
        now = time.time()
        request_id = new_request_id(now)
        request = NewRequest(request_id, {"inputs": {}}, now, now + 60)
        await store.submit([request], model="m", tenant="t", band="normal", admission=OPEN)
        ids.append(request_id)
    return ids


async def taken(store: JobStore, count: int) -> dict[str, Job]:
    jobs = await store.take_many(SHARD, "m", "c1", most=count)
    assert isinstance(jobs, list)
    return {job.request_id: job for job in jobs}


class Follower:
    """A client following one request's events, from the start, in a task of its own."""

    def __init__(self, hub: EventHub, request_id: str) -> None:
        self.kinds: list[str] = []
        self.changed = asyncio.Event()
        self.task = asyncio.create_task(self._follow(hub, request_id))

    async def _follow(self, hub: EventHub, request_id: str) -> None:
        async for event in hub.follow(request_id, "0-0", tenant=None):
            self.kinds.append(event.kind)
            self.changed.set()

    async def has(self, count: int) -> list[str]:
        """Its first `count` events' kinds, once it has them (a 30 s guard)."""
        async with asyncio.timeout(30):
            while len(self.kinds) < count:
                self.changed.clear()
                await self.changed.wait()
        return self.kinds[:count]


async def notices(client: Redis) -> list[list[str]]:
    return [fields["ids"].split() for _, fields in await client.xrange(SHARD.notices)]


# -- the scripts' notices ------------------------------------------------------------------


async def test_the_scripts_name_a_followed_request_in_the_notices_as_they_write_its_events(
    client: Redis, store: JobStore
) -> None:
    (rid,) = await submitted(store)
    assert await store.follow(rid)
    job = (await taken(store, 1))[rid]
    await store.emit(rid, job.run, 0, "a", 1, [])
    assert isinstance(await store.finish(job.record(State.SUCCEEDED), run=job.run), str)
    assert await notices(client) == [[rid], [rid], [rid]]  # TAKE's `running`, EMIT's token, FINISH's end


async def test_one_call_for_several_followed_requests_writes_one_notice_naming_them(
    client: Redis, store: JobStore
) -> None:
    ids = await submitted(store, 3)
    for rid in ids[:2]:
        await store.follow(rid)
    jobs = await taken(store, 3)
    await client.delete(SHARD.notices)
    await store.emit_many(SHARD, [TokenEvent(rid, jobs[rid].run, 0, "a", 1, []) for rid in ids])
    assert await notices(client) == [ids[:2]]


async def test_a_request_nobody_follows_costs_no_notice(client: Redis, store: JobStore) -> None:
    (rid,) = await submitted(store)
    job = (await taken(store, 1))[rid]
    await store.emit(rid, job.run, 0, "a", 1, [])
    await store.finish(job.record(State.SUCCEEDED), run=job.run)
    assert not await client.exists(SHARD.notices)


async def test_following_a_request_that_is_gone_creates_nothing(client: Redis, store: JobStore) -> None:
    rid = new_request_id(time.time())
    assert not await store.follow(rid)
    assert not await client.exists(SHARD.request(rid))


# -- the hub reading by notices ------------------------------------------------------------


async def test_by_notices_each_follower_gets_every_event_as_it_is_written(store: JobStore, hubs: Any) -> None:
    hub = hubs(named_most=0)
    ids = await submitted(store, 3)
    followers = {rid: Follower(hub, rid) for rid in ids}
    for follower in followers.values():
        assert await follower.has(1) == ["queued"]
    jobs = await taken(store, 3)
    for rid in ids:
        await store.emit(rid, jobs[rid].run, 0, "a", 1, [])
        await store.emit(rid, jobs[rid].run, 1, "b", 1, [])
        await store.finish(jobs[rid].record(State.SUCCEEDED), run=jobs[rid].run)
    for follower in followers.values():
        assert await follower.has(5) == ["queued", "running", "token", "token", "completed"]


async def test_by_notices_a_read_names_only_the_streams_written(store: JobStore, hubs: Any, redis_url: str) -> None:
    log = ReadLog(redis_url)
    hub = hubs(named_most=0, log=log)
    ids = await submitted(store, 3)
    followers = [Follower(hub, rid) for rid in ids]
    for follower in followers:
        await follower.has(1)
    jobs = await taken(store, 3)
    for follower in followers:
        await follower.has(2)
    log.reads.clear()
    first = ids[0]
    await store.emit(first, jobs[first].run, 0, "a", 1, [])
    assert await followers[0].has(3) == ["queued", "running", "token"]
    named = set().union(*log.reads)
    assert named == {SHARD.notices, SHARD.events(first)}


async def test_an_event_no_notice_names_reaches_its_follower_by_the_periodic_full_read(
    client: Redis, store: JobStore, hubs: Any
) -> None:
    hub = hubs(named_most=0, full_read_every_s=0.5)
    (rid,) = await submitted(store)
    follower = Follower(hub, rid)
    await follower.has(1)
    await client.xadd(SHARD.events(rid), {"event": "running", "data": "{}"})  # written without a notice
    assert await follower.has(2) == ["queued", "running"]


async def test_a_stream_read_up_to_the_count_is_read_on_without_a_notice(
    client: Redis, store: JobStore, hubs: Any
) -> None:
    hub = hubs(named_most=0)
    (rid,) = await submitted(store)
    async with client.pipeline(transaction=False) as pipe:  # more than one read takes, before anyone follows
        for index in range(COUNT + 10):
            pipe.xadd(SHARD.events(rid), {"event": "token", "data": "{}", "i": index, "n": 1})
        pipe.xadd(SHARD.events(rid), {"event": "completed", "data": "{}"})
        await pipe.execute()
    follower = Follower(hub, rid)
    kinds = await follower.has(COUNT + 12)
    assert kinds == ["queued", *["token"] * (COUNT + 10), "completed"]


async def test_a_hub_that_passes_named_most_streams_goes_on_by_notices_losing_nothing(
    store: JobStore, hubs: Any, redis_url: str
) -> None:
    log = ReadLog(redis_url)
    hub = hubs(named_most=1, log=log)
    first, second = await submitted(store, 2)
    one = Follower(hub, first)
    assert await one.has(1) == ["queued"]
    assert log.reads[-1] == {SHARD.events(first)}  # one stream: named, no notices read
    jobs = await taken(store, 2)
    two = Follower(hub, second)
    assert await two.has(2) == ["queued", "running"]
    for rid in (first, second):
        await store.emit(rid, jobs[rid].run, 0, "a", 1, [])
    assert await one.has(3) == ["queued", "running", "token"]
    assert await two.has(3) == ["queued", "running", "token"]
    assert {SHARD.notices} in log.reads


async def test_a_stream_that_ended_does_not_hold_another_streams_token_while_its_record_is_read(
    store: JobStore, hubs: Any
) -> None:
    """One read returns an ended stream (its terminal event names its record, read from the
    results stream) and another stream's token: the token goes out without waiting for that
    record."""
    hub = hubs(named_most=100)
    ended, streaming = await submitted(store, 2)
    jobs = await taken(store, 2)
    await store.emit(streaming, jobs[streaming].run, 0, "a", 1, [])
    await store.emit(ended, jobs[ended].run, 0, "a", 1, [])
    await store.finish(jobs[ended].record(State.SUCCEEDED), run=jobs[ended].run)
    record_read = asyncio.Event()
    read = hub.records

    async def held(request_id: str, entry: str) -> str:
        await record_read.wait()
        return await read(request_id, entry)

    hub.records = held
    first, second = Follower(hub, ended), Follower(hub, streaming)  # together: one read names both
    assert await second.has(3) == ["queued", "running", "token"]
    assert first.kinds == []  # (its events wait for its record)
    record_read.set()
    assert await first.has(4) == ["queued", "running", "token", "completed"]


class HeldReads(ReadLog):
    """As ReadLog, and while `holding`, a read's reply with entries waits for `release`
    before the hub gets it (`held` says one does): a read in flight, held there."""

    def __init__(self, redis_url: str) -> None:
        super().__init__(redis_url)
        self.holding = False
        self.held, self.release = asyncio.Event(), asyncio.Event()

    async def connect(self, shard: Shard) -> Redis:
        connection = await super().connect(shard)
        xread = connection.xread

        async def gated(streams: dict[str, str], *args: Any, **kwargs: Any) -> Any:
            reply = await xread(streams, *args, **kwargs)
            if self.holding and reply:
                self.held.set()
                await self.release.wait()
            return reply

        connection.xread = gated  # type: ignore[method-assign]
        return connection


async def test_a_follower_joining_while_a_read_is_in_flight_gets_every_event_in_order(
    store: JobStore, hubs: Any, redis_url: str
) -> None:
    """A second client follows a stream from its start while the reader's read of newer
    entries is on its way back: it gets the older entries too, first (not the newer ones
    alone, with those before them lost)."""
    reads = HeldReads(redis_url)
    hub = hubs(named_most=NAMED_MOST, log=reads)
    (rid,) = await submitted(store)
    first = Follower(hub, rid)
    assert await first.has(1) == ["queued"]
    reads.holding = True
    job = (await taken(store, 1))[rid]
    await store.emit(rid, job.run, 0, "a", 1, [])
    async with asyncio.timeout(30):
        await reads.held.wait()  # the read of `running` and the token is in flight
    reader = hub._readers[SHARD.index]
    second = Follower(hub, rid)  # from the start
    async with asyncio.timeout(30):
        while reader.positions[SHARD.events(rid)] != "0-0":  # it has set the reader back
            await asyncio.sleep(0.01)
    reads.holding = False
    reads.release.set()
    assert await second.has(3) == ["queued", "running", "token"]
    assert await first.has(3) == ["queued", "running", "token"]
    assert first.kinds == second.kinds == ["queued", "running", "token"]  # each once


def counted_unblocks(client: Redis) -> list[int]:
    """The CLIENT UNBLOCKs sent through `client` (the hub's: they interrupt its readers)."""
    unblocked: list[int] = []
    unblock = client.client_unblock

    async def counted(client_id: int, *args: Any, **kwargs: Any) -> Any:
        unblocked.append(client_id)
        return await unblock(client_id, *args, **kwargs)

    client.client_unblock = counted  # type: ignore[method-assign]
    return unblocked


async def test_a_burst_of_followers_interrupts_the_blocked_reader_once(
    client: Redis, store: JobStore, hubs: Any
) -> None:
    """Followers that come before the reader's next read are all in that read: one CLIENT
    UNBLOCK for them, not one each (a round trip each, and a read each)."""
    unblocked = counted_unblocks(client)
    hub = hubs(named_most=100)
    first, *burst = await submitted(store, 11)
    assert await Follower(hub, first).has(1) == ["queued"]  # the reader now blocks on its stream
    before = len(unblocked)
    followers = [Follower(hub, rid) for rid in burst]
    for follower in followers:
        assert await follower.has(1) == ["queued"]
    assert len(unblocked) - before == 1


def counted_marks(hub: EventHub) -> list[str]:
    """The requests the hub marks followed (FOLLOW), in order, from now on."""
    marks: list[str] = []
    follow = hub.mark_followed

    async def counted(request_id: str, notice: bool = False) -> bool:
        marks.append(request_id)
        return await follow(request_id, notice)

    hub.mark_followed = counted
    return marks


async def test_a_burst_of_32_stream_starts_is_read_by_naming_its_streams(
    store: JobStore, hubs: Any, redis_url: str
) -> None:
    """The hub as the gateway makes it keeps a burst of 32 followers of a shard on named
    reads: no FOLLOW for any of them (by notices each would cost one before its stream is
    read, and each of its events a second read), all in the reads that name them."""
    log = ReadLog(redis_url)
    hub = hubs(named_most=NAMED_MOST, log=log)
    marks = counted_marks(hub)
    ids = await submitted(store, 32)
    followers = [Follower(hub, rid) for rid in ids]
    for follower in followers:
        assert await follower.has(1) == ["queued"]
    assert marks == []
    assert SHARD.notices not in set().union(*log.reads)


async def test_switching_to_notices_marks_again_only_the_requests_not_marked_yet(store: JobStore, hubs: Any) -> None:
    """The followers past named_most mark their requests themselves; the reader, switching
    to notices, marks only those followed before (each request once)."""
    hub = hubs(named_most=2)
    marks = counted_marks(hub)
    ids = await submitted(store, 7)
    for rid in ids[:2]:  # named: not marked
        assert await Follower(hub, rid).has(1) == ["queued"]
    followers = [Follower(hub, rid) for rid in ids[2:]]  # past named_most, at once
    for follower in followers:
        assert await follower.has(1) == ["queued"]
    assert sorted(marks) == sorted(ids)


async def test_by_notices_a_new_follower_is_read_without_interrupting_the_reader(
    client: Redis, store: JobStore, hubs: Any
) -> None:
    """FOLLOW names a new follower's request in the notices, which wakes the reader blocked
    on them: no CLIENT UNBLOCK a follower."""
    unblocked = counted_unblocks(client)
    hub = hubs(named_most=1)
    first, second, third = await submitted(store, 3)
    for rid in (first, second):  # the second passes named_most: the reader goes by notices
        assert await Follower(hub, rid).has(1) == ["queued"]
    interrupts = len(unblocked)
    assert await Follower(hub, third).has(1) == ["queued"]  # (no periodic full read: NEVER_S)
    assert len(unblocked) == interrupts
    assert [third] in await notices(client)  # FOLLOW's: no script wrote an event of it since
