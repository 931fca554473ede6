"""FAISS index snapshots: atomic, and a replay from the last applied entry reaches the
same index after a crash mid-snapshot."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap

import redis.asyncio as aioredis
from pymongo import AsyncMongoClient

from binder.index.follower import IndexFollower
from binder.index.vectors import VectorIndex
from gateway.common.result_store import ResultStore
from tests.records import embedding_record, publish, unit_vectors

CHILD = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    import redis.asyncio as aioredis
    from pymongo import AsyncMongoClient
    import binder.index.vectors as vectors
    from binder.index.follower import IndexFollower
    from gateway.common.result_store import ResultStore

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
        follower = IndexFollower(redis, index, store, snapshot_interval_s=0, batch=100)
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
    assert restored.ntotal("minilm") == 100  # the first, complete snapshot

    mongo: AsyncMongoClient = AsyncMongoClient(stack.mongo_url, tz_aware=True)
    follower = IndexFollower(redis, restored, ResultStore(mongo, database, 3600), snapshot_interval_s=3600)
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


def test_adding_a_request_id_again_adds_no_vector(tmp_path) -> None:
    index = VectorIndex(tmp_path, use_gpu=False)
    vector = unit_vectors(1, 8)[0].tolist()
    assert index.add([("space", "id-1", vector)]) == 1
    assert index.add([("space", "id-1", vector), ("space", "id-1", vector)]) == 0
    assert index.ntotal("space") == 1


def test_a_snapshot_round_trips(tmp_path) -> None:
    index = VectorIndex(tmp_path, use_gpu=False)
    vectors = unit_vectors(20, 16)
    index.add([("space", f"id-{i}", v.tolist()) for i, v in enumerate(vectors)], last_id="42-0")
    index.snapshot()
    loaded = VectorIndex(tmp_path, use_gpu=False)
    assert loaded.load()
    assert loaded.last_id == "42-0" and loaded.ntotal("space") == 20
    assert loaded.search("space", vectors[7].tolist(), 1)[0][0] == "id-7"
