"""The FAISS index: snapshots (atomic; a replay from the last applied entry reaches the
same index after a crash mid-snapshot; written without holding up indexing, searches
or the binder's event loop), tenants (a search sees only its tenant's vectors) and
expiry (the index forgets what MongoDB's TTL forgets)."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import faiss
import httpx
import pytest
import redis.asyncio as aioredis
from pymongo import AsyncMongoClient

from binder.index.follower import IndexFollower
from binder.index.vectors import NEVER, Item, VectorIndex
from gateway.common.result_store import RESULTS_COLLECTION, ResultStore
from gateway.protocol.records import DEFAULT_TENANT
from gateway.protocol.redis_keys import Shard
from tests.conftest import AUTH
from tests.records import embedding_record, publish, unit_vectors

CHILD = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    import redis.asyncio as aioredis
    from pymongo import AsyncMongoClient
    import binder.index.vectors as vectors
    from binder.index.follower import IndexFollower
    from gateway.common.result_store import ResultStore
    from gateway.protocol.redis_keys import Shard

    redis_url, mongo_url, database, directory = sys.argv[1:5]
    snapshots = 0
    original_snapshot = vectors.VectorIndex.snapshot

    def snapshot_then_die_in_the_second(self):
        global snapshots
        snapshots += 1
        if snapshots == 2:  # the second snapshot is killed after its first file reached disk
            vectors._fsync = lambda path: os.kill(os.getpid(), signal.SIGKILL)
        return original_snapshot(self)

    vectors.VectorIndex.snapshot = snapshot_then_die_in_the_second

    async def main():
        redis = aioredis.from_url(redis_url, decode_responses=True)
        store = ResultStore(AsyncMongoClient(mongo_url, tz_aware=True), database, 3600)
        index = vectors.VectorIndex(vectors.Path(directory))
        follower = IndexFollower(redis, index, store, shards=[Shard(0)], snapshot_interval_s=0, batch=100)
        await follower.prepare()
        await follower.run()

    asyncio.run(main())
    """
)


async def test_kill_during_a_snapshot_keeps_the_previous_one_and_replay_reaches_the_same_ntotal(
    stack, tmp_path
) -> None:
    redis_url, database = stack.redis_db_url(30), "snapshot_test"
    redis = aioredis.from_url(redis_url, decode_responses=True)
    vectors = unit_vectors(150, 384, seed=9)
    await publish(redis, [embedding_record(v.tolist()) for v in vectors])
    directory = tmp_path / "faiss"

    child = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", CHILD, redis_url, stack.mongo_url, database, str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert any(p.name.endswith(".partial") for p in directory.iterdir()), "the kill did not hit a snapshot write"

    restored = VectorIndex(directory)
    assert restored.load()
    # The first, complete snapshot: everything up to its positions (the first 100), and
    # whatever the follower added while the shard was copied (copies no longer stop indexing).
    assert 100 <= restored.ntotal("minilm") <= 150

    mongo: AsyncMongoClient = AsyncMongoClient(stack.mongo_url, tz_aware=True)
    follower = IndexFollower(
        redis, restored, ResultStore(mongo, database, 3600), shards=[Shard(0)], snapshot_interval_s=3600
    )
    await follower.prepare()
    replay = asyncio.create_task(follower.run())
    await asyncio.wait_for(follower.caught_up.wait(), timeout=30)
    replay.cancel()
    await asyncio.gather(replay, return_exceptions=True)
    assert restored.ntotal("minilm") == 150
    hits = restored.search("minilm", vectors[120].tolist(), 1)
    assert hits[0][1] > 0.999
    await mongo.close()
    await redis.aclose()


class GatedReader:
    """A follower's reader whose reads wait while the gate is closed (`waiting` is set once
    a read waits there: no read is under way then)."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self.gate, self.waiting = asyncio.Event(), asyncio.Event()
        self.gate.set()

    async def xread(self, *args, **kwargs):
        if not self.gate.is_set():
            self.waiting.set()
            await self.gate.wait()
        return await self.redis.xread(*args, **kwargs)

    async def aclose(self) -> None:
        pass


async def test_a_running_follower_that_was_trimmed_past_rebuilds_from_mongodb(stack, tmp_path) -> None:
    redis = aioredis.from_url(stack.redis_db_url(38), decode_responses=True)
    await redis.flushdb()
    mongo: AsyncMongoClient = AsyncMongoClient(stack.mongo_url, tz_aware=True)
    store = ResultStore(mongo, f"gap_test_{time.time_ns()}", 3600)
    index = VectorIndex(tmp_path, use_gpu=False)
    reader = GatedReader(redis)

    async def gated(_shard: Shard) -> GatedReader:
        return reader

    follower = IndexFollower(
        redis,
        index,
        store,
        shards=[Shard(0)],
        reader=gated,
        snapshot_interval_s=3600,
        gap_check_s=0.1,  # type: ignore[arg-type]
    )
    first, missed, last = (embedding_record(v.tolist()) for v in unit_vectors(3, 384, seed=21))
    running = asyncio.create_task(follower.run())
    try:
        await publish(redis, [first])
        deadline = time.monotonic() + 20
        while index.ntotal("minilm") < 1:
            assert time.monotonic() < deadline, "the first result was not indexed"
            await asyncio.sleep(0.05)
        reader.gate.clear()
        await asyncio.wait_for(reader.waiting.wait(), 10)
        # While it does not read: `missed` is stored and trimmed from the stream (as the
        # archiver does with a follower it no longer waits for), `last` comes after it.
        assert not (await store.insert([missed])).failed
        await publish(redis, [missed, last])
        newest = (await redis.xrevrange(Shard(0).results, count=1))[0][0]
        await redis.xtrim(Shard(0).results, minid=newest, approximate=False)
        deadline = time.monotonic() + 20
        while not index.search("minilm", missed.outputs["embedding"], 1) or (
            index.search("minilm", missed.outputs["embedding"], 1)[0][0] != missed.request_id
        ):
            assert time.monotonic() < deadline, "the trimmed result never reached the index"
            assert not running.done(), running
            await asyncio.sleep(0.05)
        reader.gate.set()
        while index.ntotal("minilm") < 3:
            assert time.monotonic() < deadline, "the result after the gap was not indexed"
            await asyncio.sleep(0.05)
    finally:
        reader.gate.set()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await redis.flushdb()
        await redis.aclose()
        await mongo.close()


def _items(vectors, prefix: str = "id", tenant: str = DEFAULT_TENANT, expires_at: float = NEVER) -> list[Item]:
    return [Item("space", tenant, f"{prefix}-{i}", v.tolist(), expires_at) for i, v in enumerate(vectors)]


def test_adding_a_request_id_again_adds_no_vector(tmp_path) -> None:
    index = VectorIndex(tmp_path, use_gpu=False)
    vector = unit_vectors(1, 8)[0].tolist()
    item = Item("space", DEFAULT_TENANT, "id-1", vector)
    assert index.add([item]) == 1
    assert index.add([item, item]) == 0
    assert index.ntotal("space") == 1


def test_a_snapshot_round_trips_with_tenants_and_expiry(tmp_path) -> None:
    index = VectorIndex(tmp_path, use_gpu=False)
    vectors = unit_vectors(30, 16)
    index.add(_items(vectors[:20], "a", "tenant-a", expires_at=2000.0), position=("results", "42-0"), now=1000.0)
    index.add(_items(vectors[20:], "b", "tenant-b"), now=1000.0)
    index.snapshot()
    loaded = VectorIndex(tmp_path, use_gpu=False)
    assert loaded.load()
    assert loaded.positions == {"results": "42-0"}
    assert (loaded.ntotal("space", "tenant-a"), loaded.ntotal("space", "tenant-b")) == (20, 10)
    assert loaded.search("space", vectors[7].tolist(), 1, "tenant-a", now=1500.0)[0][0] == "a-7"
    assert loaded.search("space", vectors[7].tolist(), 1, "tenant-b", now=1500.0)[0][0].startswith("b-")
    assert loaded.search("space", vectors[7].tolist(), 1, "tenant-a", now=2000.0) == []  # expiry kept
    # ids go on from the snapshot's: a new vector does not take an existing one's id
    assert loaded.add([Item("space", "tenant-b", "b-new", vectors[3].tolist())]) == 1
    assert loaded.search("space", vectors[3].tolist(), 1, "tenant-b")[0][0] == "b-new"


def _shard_files(snapshot, tenant: str) -> tuple[int, int]:
    """The inodes of a tenant's shard files in a snapshot (its vectors, its metadata)."""
    meta = json.loads((snapshot / "meta.json").read_text())
    info = next(shard for shard in meta["shards"] if shard["tenant"] == tenant)
    return (snapshot / info["file"]).stat().st_ino, (snapshot / info["meta"]).stat().st_ino


def test_a_snapshot_writes_only_the_shards_that_changed_since_the_last(tmp_path) -> None:
    index = VectorIndex(tmp_path, use_gpu=False)
    vectors = unit_vectors(30, 16)
    index.add(_items(vectors[:10], "a", "tenant-a") + _items(vectors[10:20], "b", "tenant-b"))
    first = index.snapshot()
    a_before, b_before = _shard_files(first, "tenant-a"), _shard_files(first, "tenant-b")
    index.add(_items(vectors[20:], "a2", "tenant-a"))
    second = index.snapshot()
    assert _shard_files(second, "tenant-b") == b_before  # unchanged: the same files, linked
    assert _shard_files(second, "tenant-a") != a_before  # changed: written again
    loaded = VectorIndex(tmp_path, use_gpu=False)
    assert loaded.load() and (loaded.ntotal("space", "tenant-a"), loaded.ntotal("space", "tenant-b")) == (20, 10)
    third = loaded.snapshot()  # after a load, unchanged shards are linked too
    assert _shard_files(third, "tenant-b") == b_before


def test_a_shard_whose_vectors_all_expired_is_dropped_from_memory_and_snapshots(tmp_path) -> None:
    index = VectorIndex(tmp_path, use_gpu=False)
    vectors = unit_vectors(6, 16)
    index.add(_items(vectors[:3], "gone", "tenant-gone", expires_at=1100.0), now=1000.0)
    index.add(_items(vectors[3:], "kept", "tenant-kept"), now=1000.0)
    assert index.forget_expired(now=1200.0) == 3
    assert index.tenants("space") == ["tenant-kept"]
    meta = json.loads((index.snapshot() / "meta.json").read_text())
    assert [shard["tenant"] for shard in meta["shards"]] == ["tenant-kept"]


def test_a_snapshot_without_tenants_is_not_loaded_so_the_index_is_rebuilt(tmp_path) -> None:
    (tmp_path / "snapshot-1-0").mkdir()
    (tmp_path / "snapshot-1-0" / "meta.json").write_text(json.dumps({"last_id": "1-0", "spaces": {}}))
    (tmp_path / "CURRENT").write_text("snapshot-1-0")
    assert not VectorIndex(tmp_path, use_gpu=False).load()


def test_a_tenants_search_returns_its_k_nearest_though_another_tenant_holds_closer_ones(tmp_path) -> None:
    index = VectorIndex(tmp_path, use_gpu=False)
    query = unit_vectors(1, 16, seed=1)[0]
    near = query + 0.05 * unit_vectors(50, 16, seed=2)  # tenant a: the 50 nearest of all
    index.add(_items(near, "a", "tenant-a") + _items(unit_vectors(7, 16, seed=3), "b", "tenant-b"))
    hits = index.search("space", query.tolist(), 5, "tenant-b")
    assert len(hits) == 5 and all(rid.startswith("b-") for rid, _ in hits)
    assert all(rid.startswith("a-") for rid, _ in index.search("space", query.tolist(), 5, "tenant-a"))
    assert index.search("space", query.tolist(), 5, "tenant-c") == []
    assert len(index.search("space", query.tolist(), 100)) == 57  # no tenant: every tenant's


def test_an_expired_vector_is_never_returned_and_a_sweep_removes_it_from_faiss(tmp_path) -> None:
    index = VectorIndex(tmp_path, use_gpu=False)
    vectors = unit_vectors(10, 16)
    index.add(_items(vectors[:4], "old", expires_at=1100.0) + _items(vectors[4:], "new", expires_at=1200.0), now=1000)
    assert len(index.search("space", vectors[0].tolist(), 10, now=1099.0)) == 10
    hits = index.search("space", vectors[0].tolist(), 6, now=1100.0)
    assert len(hits) == 6 and all(rid.startswith("new-") for rid, _ in hits)  # still k: the expired are skipped
    assert index.forget_expired(now=1100.0) == 4
    assert index.shards[("space", DEFAULT_TENANT)].index.ntotal == 6
    assert index.add(_items(vectors[:1], "late", expires_at=1150.0), now=1160.0) == 0  # expired on arrival


def test_indexing_and_search_go_on_while_a_snapshot_file_is_written(tmp_path, monkeypatch) -> None:
    index = VectorIndex(tmp_path, use_gpu=False)
    vectors = unit_vectors(50, 16)
    index.add(_items(vectors[:40]))
    writing, release = threading.Event(), threading.Event()
    write_index = faiss.write_index

    def slow_disk(faiss_index, path: str) -> None:
        writing.set()
        release.wait(30)
        write_index(faiss_index, path)

    monkeypatch.setattr(faiss, "write_index", slow_disk)
    snapshot = threading.Thread(target=index.snapshot)
    snapshot.start()
    pool = ThreadPoolExecutor(1)  # the follower and searches run on worker threads
    try:
        assert writing.wait(10)
        added = pool.submit(index.add, _items(vectors[40:], "late")).result(timeout=2)
        hits = pool.submit(index.search, "space", vectors[45].tolist(), 1).result(timeout=2)
    finally:
        release.set()
        snapshot.join(30)
        pool.shutdown()
    assert added == 10 and hits[0][0] == "late-5"
    loaded = VectorIndex(tmp_path, use_gpu=False)
    assert loaded.load() and loaded.ntotal("space") == 40  # what the index held when the snapshot began


def test_a_search_is_answered_while_a_snapshot_is_copying_a_shard(tmp_path) -> None:
    index = VectorIndex(tmp_path, use_gpu=False)
    vectors = unit_vectors(60, 16)
    index.add(_items(vectors[:40]), position=("results", "7-0"))
    index.snapshot_chunk = 10  # the shard is copied in four turns of the lock
    copying, release = threading.Event(), threading.Event()
    chunks = 0

    def hold_after_the_first_chunk() -> None:
        nonlocal chunks
        chunks += 1
        if chunks == 1:
            copying.set()
            release.wait(30)

    index.on_snapshot_chunk = hold_after_the_first_chunk
    snapshot = threading.Thread(target=index.snapshot)
    snapshot.start()
    pool = ThreadPoolExecutor(1)  # the follower and searches run on worker threads
    try:
        assert copying.wait(10), "the snapshot did not copy its shard in chunks"
        # The snapshot is in the middle of the shard: the lock is free for searches and indexing.
        hits = pool.submit(index.search, "space", vectors[5].tolist(), 1).result(timeout=5)
        added = pool.submit(index.add, _items(vectors[40:], "late")).result(timeout=5)
    finally:
        release.set()
        snapshot.join(30)
        pool.shutdown()
    assert hits[0][0] == "id-5" and added == 20
    assert chunks == 4
    loaded = VectorIndex(tmp_path, use_gpu=False)
    assert loaded.load() and loaded.positions == {"results": "7-0"}
    assert loaded.ntotal("space") == 40  # the vectors the shard held when its copy began
    assert loaded.search("space", vectors[33].tolist(), 1)[0][0] == "id-33"


def test_a_sweep_during_a_snapshot_makes_that_shards_copy_start_over(tmp_path) -> None:
    index = VectorIndex(tmp_path, use_gpu=False)
    vectors = unit_vectors(30, 16)
    index.add(_items(vectors[:10], "old", expires_at=1100.0) + _items(vectors[10:], "new"), now=1000.0)
    index.snapshot_chunk = 8
    chunks = 0

    def sweep_after_the_first_chunk() -> None:
        nonlocal chunks
        chunks += 1
        if chunks == 1:  # compacts the shard: the vectors copied so far moved
            assert index.forget_expired(now=1100.0) == 10

    index.on_snapshot_chunk = sweep_after_the_first_chunk
    index.snapshot()
    loaded = VectorIndex(tmp_path, use_gpu=False)
    assert loaded.load() and loaded.ntotal("space") == 20
    assert {rid for rid, _ in loaded.search("space", vectors[0].tolist(), 30, now=1000.0)} == {
        f"new-{i}" for i in range(20)
    }


# -- binders started by the tests below, on Redis and MongoDB databases of their own


@pytest.fixture
def isolated(stack) -> dict[str, str]:
    number = next(_databases)
    return {"REDIS_URL": stack.redis_db_url(number), "MONGO_DB": f"index_test_{number}_{time.time_ns()}"}


_databases = itertools.count(31)


async def _search(client: httpx.AsyncClient, vector: list[float], k: int, tenant: str | None = None) -> list[str]:
    response = await client.post("/search", json={"space": "minilm", "vector": vector, "k": k, "tenant": tenant})
    assert response.status_code == 200, response.text
    return [hit["request_id"] for hit in response.json()["hits"]]


async def test_an_expired_results_vector_is_forgotten_so_no_hit_lacks_its_record(stack, mongo, isolated) -> None:
    retention_s = 8.0
    process, url = stack.start_binder("binder-expiry", RESULT_RETENTION_S=str(int(retention_s)), **isolated)
    redis = aioredis.from_url(isolated["REDIS_URL"], decode_responses=True)
    collection = mongo[isolated["MONGO_DB"]][RESULTS_COLLECTION]
    vectors = unit_vectors(6, 384, seed=11)
    # Three finished long enough ago to expire 4 s from now; three expire 8 s from now.
    expiring = [embedding_record(v.tolist(), age_s=retention_s - 4) for v in vectors[:3]]
    lasting = [embedding_record(v.tolist()) for v in vectors[3:]]
    try:
        await publish(redis, expiring + lasting)
        async with httpx.AsyncClient(headers=AUTH, base_url=url) as client:
            query = vectors[0].tolist()
            deadline = time.monotonic() + 10
            while len(await _search(client, query, 10)) < 6 or await collection.count_documents({}) < 6:
                assert time.monotonic() < deadline, "not all indexed and stored"
                await asyncio.sleep(0.05)
            deadline = time.monotonic() + retention_s
            while True:
                # MongoDB's TTL monitor at its most eager (nx-27017 has none): gone at expires_at.
                await collection.delete_many({"expires_at": {"$lte": datetime.now(UTC)}})
                hits = await _search(client, query, 10)
                stored = await collection.count_documents({"_id": {"$in": hits}})
                assert stored == len(hits), "a hit whose record MongoDB no longer has (record: null)"
                if not {r.request_id for r in expiring} & set(hits):
                    break
                assert time.monotonic() < deadline, "expired vectors still returned"
                await asyncio.sleep(0.05)
        assert set(hits) == {r.request_id for r in lasting}
    finally:
        stack.stop(process)
        await redis.aclose()


async def test_healthz_keeps_answering_while_a_large_snapshot_is_written(stack, isolated) -> None:
    name = "binder-big-snapshot"
    directory = stack.data_dir / "faiss" / name  # where binder_spec points FAISS_DIR
    count, dim = 120_000, 384
    prepared = VectorIndex(directory, use_gpu=False)
    vectors = unit_vectors(count, dim, seed=12)
    prepared.add([Item("minilm", DEFAULT_TENANT, f"bulk-{i}", vectors[i]) for i in range(count)])
    first = prepared.snapshot().name
    del prepared, vectors
    process, url = stack.start_binder(name, **isolated)
    redis = aioredis.from_url(isolated["REDIS_URL"], decode_responses=True)
    saw_writing, answered_while_writing = False, 0
    slowest = 0.0  # the longest /healthz answer, for the message only (nothing is timed)

    def writing() -> bool:
        return any(p.name.endswith(".partial") for p in directory.iterdir())

    try:
        async with httpx.AsyncClient(headers=AUTH, base_url=url, timeout=30) as client:
            # The client's set-up and first connection before the write can start: the
            # polls below begin at once, not a set-up's length into a short write.
            assert (await client.get("/healthz")).status_code == 200
            await publish(redis, [embedding_record(unit_vectors(1, dim, seed=13)[0].tolist())])  # makes one due
            deadline = time.monotonic() + 30
            while (directory / "CURRENT").read_text() == first:
                assert time.monotonic() < deadline, "no snapshot was written"
                before = writing()
                asked = time.monotonic()
                response = await client.get("/healthz")
                slowest = max(slowest, time.monotonic() - asked)
                assert response.status_code == 200
                saw_writing |= before
                if before and writing():
                    answered_while_writing += 1
                await asyncio.sleep(0.01)
        # No call asked while the snapshot was being written: either it was written between
        # two polls, or one call was held across the whole write (the slowest call says which).
        assert saw_writing, f"no call was asked while the snapshot was written (the slowest took {slowest:.2f} s)"
        # Calls asked and answered while the snapshot was being written (its .partial there
        # before each and after its answer): a write that held the binder's loop would hold
        # each call until it ended (.partial gone by then). Counted, not timed, so a slow
        # machine changes nothing; several, so that a moment before a blocking write does
        # not count as the whole write.
        assert answered_while_writing >= 3, f"{answered_while_writing} calls answered while the snapshot was written"
    finally:
        stack.stop(process)
        await redis.aclose()
