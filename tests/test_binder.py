"""The binder against real Redis, the MongoDB-wire server and FAISS: one document and
at most one vector per request, however often and however concurrently a result is
delivered, and through crashes."""

from __future__ import annotations

import asyncio
import time
from itertools import count

import httpx
import pytest
import redis.asyncio as aioredis
from pymongo import AsyncMongoClient
from pymongo.errors import BulkWriteError

from binder.archive import Archiver, StoreUnavailable
from binder.settings import BinderSettings
from binder.webhooks import WebhookQueue
from gateway.common.result_store import DUPLICATE_KEY, RESULTS_COLLECTION, ResultStore
from gateway.common.streams import Entry
from gateway.protocol.redis_keys import BINDER_GROUP, Shard
from gateway.stack.process import free_port
from gateway.stack.services import binder_spec
from tests.conftest import AUTH, kill_by_pid
from tests.records import mixed_records, publish, text_record

RESULTS_STREAM = Shard(0).results
RESULTS_DEAD_LETTERS = Shard(0).results_dead

_databases = count(20)


@pytest.fixture
def isolated(stack):
    """A Redis database and a MongoDB database of this test's own."""
    number = next(_databases)
    return {"REDIS_URL": stack.redis_db_url(number), "MONGO_DB": f"binder_test_{number}_{time.time_ns()}"}


async def _documents(mongo: AsyncMongoClient, database: str) -> int:
    return await mongo[database][RESULTS_COLLECTION].count_documents({})


async def _pending(redis_url: str) -> int:
    client = aioredis.from_url(redis_url, decode_responses=True)
    try:
        return (await client.xpending(RESULTS_STREAM, BINDER_GROUP))["pending"]
    finally:
        await client.aclose()


async def _until(check, timeout: float = 60, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(interval)


async def _indexed(binder_url: str, space: str = "minilm") -> int:
    async with httpx.AsyncClient(headers=AUTH) as client:
        return (await client.get(f"{binder_url}/healthz")).json()["index"].get(space, 0)


async def test_n_results_make_exactly_n_documents_and_n_vectors(stack, mongo, isolated) -> None:
    process, url = stack.start_binder("binder-count", **isolated)
    try:
        records = mixed_records(200)
        vectors = sum(1 for r in records if r.embedding)
        redis = aioredis.from_url(isolated["REDIS_URL"], decode_responses=True)
        await publish(redis, records)
        await _until(lambda: _is(mongo, isolated["MONGO_DB"], len(records)))
        await _until(lambda: _indexed_is(url, vectors))
        assert await _pending(isolated["REDIS_URL"]) == 0
        stored = await mongo[isolated["MONGO_DB"]][RESULTS_COLLECTION].find_one({"_id": records[1].request_id})
        assert stored["stored"] is True and stored["expires_at"] > stored["finished_at"]
        await redis.aclose()
    finally:
        stack.stop(process)


async def _is(mongo, database: str, expected: int) -> bool:
    return await _documents(mongo, database) == expected


async def _indexed_is(url: str, expected: int) -> bool:
    return await _indexed(url) == expected


async def test_results_delivered_again_three_times_concurrently_stay_n(stack, mongo, isolated) -> None:
    first, first_url = stack.start_binder("binder-a", **isolated)
    second, second_url = stack.start_binder("binder-b", **isolated)
    try:
        records = mixed_records(120, seed=1)
        vectors = sum(1 for r in records if r.embedding)
        redis = aioredis.from_url(isolated["REDIS_URL"], decode_responses=True)
        await asyncio.gather(*(publish(redis, records) for _ in range(3)))
        await publish(redis, records)
        await _until(lambda: _is(mongo, isolated["MONGO_DB"], len(records)))
        await _until(lambda: _all_acknowledged(isolated["REDIS_URL"], redis, 4 * len(records)))
        for url in (first_url, second_url):  # each binder holds the whole index
            await _until(lambda url=url: _indexed_is(url, vectors))
        assert await _documents(mongo, isolated["MONGO_DB"]) == len(records)
        assert await redis.xlen(RESULTS_DEAD_LETTERS) == 0
        await redis.aclose()
    finally:
        stack.stop(first)
        stack.stop(second)


async def _all_acknowledged(redis_url: str, redis, delivered: int) -> bool:
    groups = await redis.xinfo_groups(RESULTS_STREAM)
    group = next(g for g in groups if g["name"] == BINDER_GROUP)
    return (
        group["pending"] == 0
        and group["last-delivered-id"] == (await redis.xinfo_stream(RESULTS_STREAM))["last-generated-id"]
    )


async def test_binder_killed_mid_batch_and_restarted_stores_all_and_leaves_nothing_pending(
    stack, mongo, isolated
) -> None:
    process, _ = stack.start_binder("binder-crash", BATCH_SIZE="50", **isolated)
    records = mixed_records(3000, seed=2)
    redis = aioredis.from_url(isolated["REDIS_URL"], decode_responses=True)
    await publish(redis, records)
    await _until(lambda: _some_stored(mongo, isolated["MONGO_DB"]), interval=0.01)
    kill_by_pid(process)
    stack.extra.remove(process)
    assert await _documents(mongo, isolated["MONGO_DB"]) < len(records), "the binder finished before the kill"
    restarted, _ = stack.start_binder("binder-crash", BATCH_SIZE="50", **isolated)  # same consumer name
    try:
        await _until(lambda: _is(mongo, isolated["MONGO_DB"], len(records)), timeout=120)
        await _until(lambda: _no_pending(isolated["REDIS_URL"]))
    finally:
        stack.stop(restarted)
        await redis.aclose()


async def _some_stored(mongo, database: str) -> bool:
    return await _documents(mongo, database) > 0


async def _no_pending(redis_url: str) -> bool:
    return await _pending(redis_url) == 0


def _settings(isolated: dict[str, str], stack, name: str, **extra) -> BinderSettings:
    return BinderSettings(
        redis_url=isolated["REDIS_URL"],
        mongo_url=stack.mongo_url,
        mongo_db=isolated["MONGO_DB"],
        binder_name=name,
        **extra,
    )


class CrashBeforeAck(Exception):
    pass


async def test_killed_between_the_mongodb_write_and_the_ack_stores_no_duplicate(stack, mongo, isolated) -> None:
    redis = aioredis.from_url(isolated["REDIS_URL"], decode_responses=True)
    store = ResultStore(mongo, isolated["MONGO_DB"], retention_s=3600)
    await store.prepare()
    records = mixed_records(40, seed=3)
    await publish(redis, records)

    crashing = Archiver(redis, store, WebhookQueue(redis), _settings(isolated, stack, "crashing", claim_idle_ms=200))
    await crashing.prepare()

    async def crash(*args, **kwargs):
        raise CrashBeforeAck  # the process dies right after MongoDB acknowledged the write

    crashing.consumers[0].redis = _FailingAck(redis, crash)
    read = (await redis.xreadgroup(BINDER_GROUP, "crashing", {RESULTS_STREAM: ">"}, count=100))[0][1]
    entries = [Entry(RESULTS_STREAM, entry_id, fields) for entry_id, fields in read]
    with pytest.raises(CrashBeforeAck):
        await crashing.process(entries)
    assert await _documents(mongo, isolated["MONGO_DB"]) == len(records)
    assert await _pending(isolated["REDIS_URL"]) == len(records)

    await asyncio.sleep(0.3)
    heir = Archiver(redis, store, WebhookQueue(redis), _settings(isolated, stack, "heir", claim_idle_ms=200))
    # XAUTOCLAIM the dead consumer's entries and store them again
    await heir.process(await heir.consumers[0].reclaim(RESULTS_STREAM, 100))
    assert await _documents(mongo, isolated["MONGO_DB"]) == len(records)
    assert await _pending(isolated["REDIS_URL"]) == 0
    await redis.aclose()


class _FailingAck:
    """The Redis client, except that XACK fails."""

    def __init__(self, redis, xack) -> None:
        self._redis, self.xack = redis, xack

    def __getattr__(self, name):
        return getattr(self._redis, name)


async def test_a_poison_entry_is_dead_lettered_after_n_attempts_while_the_rest_complete(stack, mongo, isolated) -> None:
    process, _ = stack.start_binder("binder-poison", MAX_DELIVERIES="2", CLAIM_IDLE_MS="300", **isolated)
    redis = aioredis.from_url(isolated["REDIS_URL"], decode_responses=True)
    try:
        records = mixed_records(30, seed=4)
        await publish(redis, records[:15])
        await redis.xadd(RESULTS_STREAM, {"id": "poison", "record": "{not json"})
        await publish(redis, records[15:])
        await _until(lambda: _is(mongo, isolated["MONGO_DB"], len(records)))
        await _until(lambda: _dead_letters(redis, 1), timeout=30)
        dead = (await redis.xrange(RESULTS_DEAD_LETTERS))[0][1]
        assert "not a result record" in dead["error"]
        assert int(dead["deliveries"]) > 2
        await _until(lambda: _no_pending(isolated["REDIS_URL"]))
    finally:
        stack.stop(process)
        await redis.aclose()


async def _dead_letters(redis, expected: int) -> bool:
    return await redis.xlen(RESULTS_DEAD_LETTERS) == expected


async def test_healthz_answers_503_naming_the_failing_loop_while_mongodb_is_unreachable(stack, isolated) -> None:
    port, nobody = free_port(), free_port()  # nothing listens on `nobody`
    env = {
        **stack.launcher.service_env,
        **isolated,
        "MONGO_URL": f"mongodb://127.0.0.1:{nobody}",
        "MONGO_TIMEOUT_S": "0.3",
    }
    spec = binder_spec(data_dir=stack.data_dir, host="127.0.0.1", port=port, env=env, name="binder-no-mongo")
    url = f"http://127.0.0.1:{port}"
    spec.ready = lambda: httpx.get(f"{url}/healthz", timeout=2).status_code in (200, 503)  # up, however healthy
    process = stack.start(spec)
    try:
        async with httpx.AsyncClient(headers=AUTH, base_url=url, timeout=5) as client:
            deadline = time.monotonic() + 15
            while "archiver" not in (response := await client.get("/healthz")).json()["failing"]:
                assert time.monotonic() < deadline, response.text
                await asyncio.sleep(0.1)
        assert response.status_code == 503
        body = response.json()
        assert body["status"] == "failing"
        assert body["failing"]["archiver"].startswith("ServerSelectionTimeoutError")
    finally:
        stack.stop(process)


async def test_dead_lettered_results_are_stored_once_replayed(stack, mongo, isolated) -> None:
    redis = aioredis.from_url(isolated["REDIS_URL"], decode_responses=True)
    # A binder whose MongoDB is out of reach: its entries are dead-lettered on redelivery.
    unreachable: AsyncMongoClient = AsyncMongoClient(f"mongodb://127.0.0.1:{free_port()}", serverSelectionTimeoutMS=200)
    settings = _settings(isolated, stack, "doomed", claim_idle_ms=100, max_deliveries=1)
    doomed = Archiver(redis, ResultStore(unreachable, isolated["MONGO_DB"], 3600), WebhookQueue(redis), settings)
    await doomed.consumers[0].ensure_group(RESULTS_STREAM)
    records = mixed_records(12, seed=5)
    await publish(redis, records)
    with pytest.raises(StoreUnavailable):
        await doomed.process(await doomed.consumers[0].read({RESULTS_STREAM: 100}, block_ms=None))
    await _until(lambda: _dead_lettered_after_reclaim(doomed, len(records)), timeout=10, interval=0.15)
    await unreachable.close()

    process, url = stack.start_binder("binder-replay", **isolated)
    try:
        async with httpx.AsyncClient(headers=AUTH, base_url=url) as client:
            response = await client.post("/dead-letters/replay")
        assert response.status_code == 200 and response.json() == {"requeued": len(records)}
        await _until(lambda: _is(mongo, isolated["MONGO_DB"], len(records)), timeout=20)
        await _until(lambda: _indexed_is(url, sum(1 for r in records if r.embedding)), timeout=20)
        assert await redis.xlen(RESULTS_DEAD_LETTERS) == 0
    finally:
        stack.stop(process)
        await redis.aclose()


async def _dead_lettered_after_reclaim(archiver: Archiver, expected: int) -> bool:
    await archiver.consumers[0].reclaim(RESULTS_STREAM, 100)
    return await archiver.redis.xlen(RESULTS_DEAD_LETTERS) == expected


class _UnsatisfiedWriteConcern:
    """A collection whose insert_many answers as a replica set does when the writes were
    applied on the primary but not replicated in time (nx-27017, the only MongoDB-wire
    server here, accepts any write concern and cannot produce this)."""

    def __init__(self, duplicate_index: int | None = None) -> None:
        self.duplicate_index = duplicate_index

    async def insert_many(self, documents, ordered: bool) -> None:
        write_errors = []
        if self.duplicate_index is not None:
            write_errors.append(
                {"index": self.duplicate_index, "code": DUPLICATE_KEY, "errmsg": "E11000 duplicate key"}
            )
        raise BulkWriteError(
            {
                "writeErrors": write_errors,
                "writeConcernErrors": [{"code": 64, "errmsg": "waiting for replication timed out"}],
                "nInserted": len(documents) - len(write_errors),
            }
        )


@pytest.mark.parametrize("duplicate_index", [None, 0])
async def test_a_write_concern_error_counts_no_record_as_stored(mongo, duplicate_index: int | None) -> None:
    store = ResultStore(mongo, "unused", retention_s=3600)
    store.collection = _UnsatisfiedWriteConcern(duplicate_index)
    records = [text_record(f"text {i}") for i in range(3)]
    outcome = await store.insert(records)
    assert outcome.stored == []
    assert set(outcome.failed) == {r.request_id for r in records}
    assert all("waiting for replication timed out" in error for error in outcome.failed.values())
    assert not outcome.unavailable


async def test_results_mongodb_cannot_store_are_dead_lettered_with_their_reason_and_later_ones_stored(
    stack, mongo, isolated
) -> None:
    process, url = stack.start_binder("binder-unstorable", **isolated)
    redis = aioredis.from_url(isolated["REDIS_URL"], decode_responses=True)
    try:
        huge_int = text_record("an integer BSON cannot encode")
        huge_int.outputs = {"text_output": "counted", "count": 2**70}
        too_large = text_record("x" * (17 * 1024 * 1024))  # over MongoDB's 16 MiB document limit
        normal = text_record("stored after them")
        await publish(redis, [huge_int, too_large, normal])
        await _until(lambda: _stored(mongo, isolated["MONGO_DB"], normal.request_id), timeout=30)
        await _until(lambda: _dead_letters(redis, 2), timeout=10)
        await _until(lambda: _no_pending(isolated["REDIS_URL"]), timeout=10)
        # Each unstorable one is stored as failed in its place (result_unstorable).
        await _until(lambda: _is(mongo, isolated["MONGO_DB"], 3), timeout=10)
        failed = await mongo[isolated["MONGO_DB"]][RESULTS_COLLECTION].find_one({"_id": huge_int.request_id})
        assert failed["status"] == "failed" and failed["error"]["code"] == "result_unstorable"
        async with httpx.AsyncClient(headers=AUTH, base_url=url, timeout=30) as client:
            listed = (await client.get("/dead-letters")).json()["dead_letters"]
            metrics = (await client.get("/metrics")).text
        reasons = {dead["request_id"]: (dead["error"], dead["deliveries"]) for dead in listed}
        assert set(reasons) == {huge_int.request_id, too_large.request_id}
        error, deliveries = reasons[huge_int.request_id]
        assert "(unencodable)" in error and "OverflowError" in error and deliveries == 1  # at once, no retries
        error, deliveries = reasons[too_large.request_id]
        assert "(too_large)" in error and deliveries == 1
        assert 'binder_results_dead_lettered_total{reason="unencodable"} 1.0' in metrics
        assert 'binder_results_dead_lettered_total{reason="too_large"} 1.0' in metrics
        assert "binder_results_dead_letters 2.0" in metrics
    finally:
        stack.stop(process)
        await redis.aclose()


async def test_a_result_that_cannot_be_stored_leaves_its_live_state_to_expire_once_failed(
    stack, mongo, isolated
) -> None:
    process, _ = stack.start_binder("binder-live-state", LIVE_STATE_TTL_S="600", **isolated)
    redis = aioredis.from_url(isolated["REDIS_URL"], decode_responses=True)
    try:
        unstorable = text_record("x" * (17 * 1024 * 1024))  # over MongoDB's 16 MiB document limit
        normal = text_record("stored")
        shard = Shard(0)
        for record in (unstorable, normal):  # their live state as FINISH leaves it: no expiry
            await redis.hset(shard.request(record.request_id), mapping={"state": "succeeded"})
            await redis.xadd(shard.events(record.request_id), {"event": "completed"})
        await publish(redis, [unstorable, normal])
        await _until(lambda: _dead_letters(redis, 1), timeout=30)
        await _until(lambda: _stored(mongo, isolated["MONGO_DB"], normal.request_id), timeout=30)
        for key in (shard.request(unstorable.request_id), shard.events(unstorable.request_id)):
            # Its failed record is stored in its place: RESULTS_KEEP_S after, as any other.
            await _until(lambda key=key: _has_ttl(redis, key), timeout=10)
            assert 0 < await redis.ttl(key) <= 600
        assert await redis.hget(shard.request(unstorable.request_id), "state") == "failed"
        await _until(lambda: _has_ttl(redis, shard.request(normal.request_id)), timeout=10)
        for key in (shard.request(normal.request_id), shard.events(normal.request_id)):
            assert 0 < await redis.ttl(key) <= 30  # RESULTS_KEEP_S after it was stored
    finally:
        stack.stop(process)
        await redis.aclose()


async def _has_ttl(redis, key: str) -> bool:
    return await redis.ttl(key) > 0


async def _stored(mongo, database: str, request_id: str) -> bool:
    return await mongo[database][RESULTS_COLLECTION].find_one({"_id": request_id}, {"_id": 1}) is not None


class _ReadFails:
    """The Redis client, except that XREADGROUP fails (one shard's Redis gone wrong)."""

    def __init__(self, redis) -> None:
        self._redis = redis

    async def xreadgroup(self, *args, **kwargs):
        raise ConnectionError("this shard's reads fail")

    def __getattr__(self, name):
        return getattr(self._redis, name)


class _ReadBreaks(_ReadFails):
    """The Redis client, except that XREADGROUP raises what is no outage (a defect)."""

    async def xreadgroup(self, *args, **kwargs):
        raise RuntimeError("this shard's loop has a defect")


def _shard_loops() -> list[asyncio.Task]:
    return [
        task
        for task in asyncio.all_tasks()
        if not task.done() and getattr(task.get_coro(), "__qualname__", "") == "Archiver._run_shard"
    ]


async def test_a_shard_whose_redis_is_away_waits_alone_while_the_other_shards_store(stack, mongo, isolated) -> None:
    redis = aioredis.from_url(isolated["REDIS_URL"], decode_responses=True)
    store = ResultStore(mongo, isolated["MONGO_DB"], retention_s=3600)
    await store.prepare()
    archiver = Archiver(redis, store, WebhookQueue(redis), _settings(isolated, stack, "two-shards", redis_shards=2))
    await archiver.prepare()
    records = mixed_records(6, seed=5)
    async with redis.pipeline(transaction=False) as pipe:  # every record in shard 0's stream
        for record in records:
            pipe.xadd(archiver.shards[0].results, {"id": record.request_id, "record": record.model_dump_json()})
        await pipe.execute()
    archiver.consumers[1].redis = _ReadFails(redis)  # shard 1's Redis is away
    running = asyncio.create_task(archiver.run())
    try:
        await _until(lambda: _counted(mongo, isolated["MONGO_DB"], len(records)))
        assert not running.done()  # nothing failed the run: shard 1 waits for its Redis alone
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await redis.aclose()
    assert _shard_loops() == []


async def _counted(mongo, database: str, count: int) -> bool:
    return await _documents(mongo, database) >= count


async def test_a_failing_archiver_run_leaves_no_shard_loop_behind(stack, mongo, isolated) -> None:
    redis = aioredis.from_url(isolated["REDIS_URL"], decode_responses=True)
    store = ResultStore(mongo, isolated["MONGO_DB"], retention_s=3600)
    archiver = Archiver(redis, store, WebhookQueue(redis), _settings(isolated, stack, "two-shards-bug", redis_shards=2))
    archiver.consumers[1].redis = _ReadBreaks(redis)
    try:
        with pytest.raises(RuntimeError):
            await archiver.run()  # the supervisor would start it again now
        assert _shard_loops() == []  # no loop of the failed run goes on beside the next one
    finally:
        for task in _shard_loops():
            task.cancel()
        await redis.aclose()
