"""The request queue's scripts on a real Redis (no Triton, no gateway): fair order,
admission budgets, concurrency limits, leases, hand-over, idempotent writes, and what is
left in Redis when the work is done. One behaviour per test."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.common.redis import RedisClients, connect
from gateway.protocol import State, new_request_id
from gateway.protocol.redis_keys import Shard
from gateway.server import spine
from gateway.server.dispatch.leases import LeaseKeeper
from gateway.server.dispatch.scheduler import Headroom
from gateway.server.queue import jobs, scripts
from gateway.server.queue.jobs import TAKE_TOKEN_TTL_S, Admission, Job, JobStore, NewRequest

SHARD = Shard(0)
OPEN = Admission(max_backlog=10_000, max_batch_backlog=10_000, max_bytes=10**9, reserve=4)


async def queue(
    store: JobStore,
    tenant: str,
    count: int = 1,
    *,
    model: str = "m",
    band: str = "normal",
    admission: Admission = OPEN,
    start_as: str = "",
) -> tuple[str, list[str]]:
    """Submit `count` requests, one call each; (last outcome, ids)."""
    ids, outcome = [], ""
    for _ in range(count):
        now = time.time()
        request_id = new_request_id(now)
        submitted = await store.submit(
            [NewRequest(request_id, {"inputs": {}}, now, now + 60)],
            model=model,
            tenant=tenant,
            band=band,
            admission=admission,
            start_as=start_as,
        )
        outcome = submitted.outcome
        if outcome != "full":
            ids.append(request_id)
    return outcome, ids


async def take_all(store: JobStore, model: str = "m", consumer: str = "c1") -> list[Job]:
    taken = []
    while isinstance(job := await store.take(SHARD, model, consumer), Job):
        taken.append(job)
    return taken


async def finish(store: JobStore, job: Job, status: State = State.SUCCEEDED) -> None:
    assert isinstance(await store.finish(job.record(status), run=job.run), str)


async def run_of(store: JobStore, request_id: str) -> str:
    """The token of the request's current run (its fence)."""
    job = await store.load(request_id)
    assert job is not None and job.run
    return job.run


# -- fair order ---------------------------------------------------------------------------


async def test_tenants_take_turns_whatever_their_backlog(store: JobStore) -> None:
    await queue(store, "flood", 6)
    await queue(store, "light", 2)
    await queue(store, "other", 1)
    order = [job.tenant for job in await take_all(store)]
    assert order[:5] == ["flood", "light", "other", "flood", "light"]
    assert order[5:] == ["flood"] * 4


async def test_one_take_of_several_starts_them_in_the_order_single_takes_would(store: JobStore) -> None:
    await queue(store, "flood", 6)
    await queue(store, "light", 2)
    await queue(store, "other", 1)
    taken = await store.take_many(SHARD, "m", "c1", most=5)
    assert isinstance(taken, list)
    assert [job.tenant for job in taken] == ["flood", "light", "other", "flood", "light"]
    assert len({job.run for job in taken}) == 5  # each run its own fence
    assert [job.tenant for job in await take_all(store)] == ["flood"] * 4


async def test_a_take_of_several_starts_no_more_than_asked_and_no_more_than_wait(store: JobStore) -> None:
    await queue(store, "t", 3)
    first = await store.take_many(SHARD, "m", "c1", most=2)
    assert isinstance(first, list) and len(first) == 2
    rest = await store.take_many(SHARD, "m", "c1", most=8)
    assert isinstance(rest, list) and len(rest) == 1
    assert await store.take_many(SHARD, "m", "c1", most=8) == "empty"


async def test_a_tenant_of_weight_two_starts_twice_as_often(store: JobStore) -> None:
    heavy = Admission(**{**OPEN.__dict__, "weight": 2.0})
    await queue(store, "double", 8, admission=heavy)
    await queue(store, "single", 8)
    first_six = [job.tenant for job in (await take_all(store))[:6]]
    assert first_six.count("double") == 4 and first_six.count("single") == 2


async def test_a_tenant_arriving_late_starts_next_instead_of_after_the_backlog(store: JobStore) -> None:
    await queue(store, "flood", 20)
    for _ in range(5):
        assert isinstance(await store.take(SHARD, "m", "c1"), Job)
    await queue(store, "late", 1)
    job = await store.take(SHARD, "m", "c1")
    assert isinstance(job, Job) and job.tenant in ("late", "flood")
    second = await store.take(SHARD, "m", "c1")
    assert isinstance(second, Job)
    assert "late" in (job.tenant, second.tenant)


async def test_higher_bands_start_first(store: JobStore) -> None:
    await queue(store, "t", 2, band="batch")
    await queue(store, "t", 1, band="low")
    await queue(store, "t", 1, band="high")
    await queue(store, "t", 1, band="normal")
    assert [job.band for job in await take_all(store)] == ["high", "normal", "low", "batch", "batch"]


async def test_each_model_has_its_own_queue(store: JobStore) -> None:
    for tenant in range(50):
        await queue(store, f"embedder-{tenant}", 1, model="text_embed")
    await queue(store, "writer", 1, model="llm")
    job = await store.take(SHARD, "llm", "c1")
    assert isinstance(job, Job) and job.tenant == "writer"


# -- headroom for light tenants -------------------------------------------------------------


async def test_within_the_headroom_only_a_tenant_running_nothing_may_start(store: JobStore) -> None:
    await queue(store, "flood", 3)
    assert isinstance(await store.take(SHARD, "m", "c1"), Job)  # flood now runs one
    assert await store.take(SHARD, "m", "c1", light_only=True) == "held"
    await queue(store, "light", 1)
    job = await store.take(SHARD, "m", "c1", light_only=True)
    assert isinstance(job, Job) and job.tenant == "light"


def test_headroom_counts_only_the_tenants_seen_on_that_model() -> None:
    headroom = Headroom(window_s=5.0, fraction=0.25)
    for tenant in range(100):
        headroom.touch("text_embed", f"t{tenant}", now=0.0)
    headroom.touch("llm", "writer", now=0.0)
    assert headroom.reserve("llm", slots=32, now=1.0) == 0
    assert headroom.reserve("text_embed", slots=32, now=1.0) == 8  # capped at a quarter of the slots


def test_headroom_forgets_tenants_after_the_window() -> None:
    headroom = Headroom(window_s=5.0, fraction=0.25)
    headroom.touch("m", "a", now=0.0)
    headroom.touch("m", "b", now=0.0)
    assert headroom.reserve("m", slots=8, now=1.0) == 1
    assert headroom.reserve("m", slots=8, now=6.0) == 0


# -- admission ---------------------------------------------------------------------------------


async def test_a_flood_cannot_make_another_tenant_wait_for_a_429(store: JobStore) -> None:
    small = Admission(max_backlog=20, max_batch_backlog=20, max_bytes=10**9, tenant_max_queued=20, reserve=4)
    outcome, _ = await queue(store, "flood", 25, admission=small)
    assert outcome == "full"
    outcome, ids = await queue(store, "light", 1, admission=small)
    assert outcome == "accepted" and len(ids) == 1


async def test_batches_have_their_own_budget(store: JobStore) -> None:
    small = Admission(max_backlog=10, max_batch_backlog=10, max_bytes=10**9, tenant_max_queued=10, reserve=0)
    outcome, _ = await queue(store, "batcher", 10, band="batch", admission=small)
    assert outcome == "accepted"
    assert (await queue(store, "batcher", 1, band="batch", admission=small))[0] == "full"
    assert (await queue(store, "someone", 1, admission=small))[0] == "accepted"


async def test_a_tenant_cannot_hold_more_than_its_share(store: JobStore) -> None:
    capped = Admission(max_backlog=100, max_batch_backlog=100, max_bytes=10**9, tenant_max_queued=5, reserve=0)
    outcome, ids = await queue(store, "greedy", 8, admission=capped)
    assert outcome == "full" and len(ids) == 5


async def test_several_requests_are_admitted_together_or_not_at_all(store: JobStore) -> None:
    capped = Admission(max_backlog=100, max_batch_backlog=100, max_bytes=10**9, tenant_max_queued=5, reserve=0)
    now = time.time()
    many = [NewRequest(new_request_id(now), {"i": n}, now, now + 60) for n in range(6)]
    submitted = await store.submit(many, model="m", tenant="t", band="normal", admission=capped)
    assert submitted.outcome == "full"
    assert await store.redis.llen(SHARD.queue("m", "normal", "t")) == 0
    submitted = await store.submit(many[:5], model="m", tenant="t", band="normal", admission=capped)
    assert submitted.outcome == "accepted"
    assert await store.redis.llen(SHARD.queue("m", "normal", "t")) == 5


async def test_an_idempotency_key_returns_the_first_request(store: JobStore) -> None:
    now = time.time()
    first = NewRequest(new_request_id(now), {}, now, now + 60, ("key-1", "hash-a"))
    again = NewRequest(new_request_id(now), {}, now, now + 60, ("key-1", "hash-a"))
    assert (await store.submit([first], model="m", tenant="t", band="normal", admission=OPEN)).outcome == "accepted"
    replay = await store.submit([again], model="m", tenant="t", band="normal", admission=OPEN)
    assert replay.outcome == "existing" and replay.existing == [(first.request_id, "hash-a")]
    assert await store.idempotent("t", "key-1") == (first.request_id, "hash-a")


# -- concurrency limits -----------------------------------------------------------------------


async def test_a_tenant_at_its_limit_waits_until_one_of_its_runs_ends(store: JobStore) -> None:
    limited = Admission(**{**OPEN.__dict__, "max_concurrent": 1})
    await queue(store, "limited", 3, admission=limited)
    first = await store.take(SHARD, "m", "c1")
    assert isinstance(first, Job)
    assert await store.take(SHARD, "m", "c1") == "empty"
    await finish(store, first)
    second = await store.take(SHARD, "m", "c1")
    assert isinstance(second, Job) and second.tenant == "limited"


async def test_a_limited_tenant_does_not_hold_back_others(store: JobStore) -> None:
    limited = Admission(**{**OPEN.__dict__, "max_concurrent": 1})
    await queue(store, "limited", 3, admission=limited)
    await queue(store, "free", 2)
    assert sorted(job.tenant for job in await take_all(store)) == ["free", "free", "limited"]


# -- starting at once ---------------------------------------------------------------------------


async def test_a_request_starts_at_once_when_nothing_of_its_model_waits(store: JobStore) -> None:
    outcome, (request_id,) = await queue(store, "t", 1, start_as="c1")
    assert outcome == "started"
    job = await store.load(request_id)
    assert job is not None and job.state == State.RUNNING and job.attempts == 1


async def test_a_request_does_not_overtake_its_own_tenants_waiting_work(store: JobStore) -> None:
    await queue(store, "t", 1)
    outcome, _ = await queue(store, "t", 1, start_as="c1")
    assert outcome == "accepted"


async def test_a_request_does_not_overtake_a_higher_band(store: JobStore) -> None:
    await queue(store, "t", 1, band="high")
    outcome, _ = await queue(store, "u", 1, start_as="c1")
    assert outcome == "accepted"


async def test_a_request_does_not_overtake_a_reclaimed_run(store: JobStore) -> None:
    _, (lost,) = await queue(store, "t", 1, start_as="dead")
    await store.redis.zadd(SHARD.leases, {lost: 0})  # its process died
    assert await store.reclaim(SHARD) == 1
    outcome, _ = await queue(store, "u", 1, start_as="c1")
    assert outcome == "accepted"


async def test_a_request_starts_at_once_again_once_the_reclaimed_runs_are_taken_or_finished(store: JobStore) -> None:
    _, ids = await queue(store, "t", 2)
    jobs = await take_all(store, consumer="dead")
    await store.redis.zadd(SHARD.leases, dict.fromkeys(ids, 0))
    assert await store.reclaim(SHARD) == 2
    again = await store.take(SHARD, "m", "c2")  # one is started again...
    assert isinstance(again, Job) and again.request_id in ids
    other = next(job for job in jobs if job.request_id != again.request_id)
    await finish(store, other)  # ...and its old run ends the other
    assert await store.redis.llen(SHARD.reclaimed("m")) == 0
    assert await store.redis.hget(SHARD.backlog, "r:m") is None
    outcome, _ = await queue(store, "u", 1, start_as="c1")
    assert outcome == "started"


async def test_a_tenant_with_nothing_waiting_starts_at_once_beside_a_backlog(store: JobStore) -> None:
    await queue(store, "flood", 5)
    outcome, _ = await queue(store, "light", 1, start_as="c1")
    assert outcome == "started"


# -- replays after a lost reply ---------------------------------------------------------------------


async def test_the_redis_client_retries_connection_errors_and_timeouts_with_the_asyncio_retry(
    redis_server: str,
) -> None:
    client = connect(redis_server, timeout_s=2.0, max_connections=2)
    try:
        connection = await client.connection_pool.get_connection()  # what runs the commands
        await client.connection_pool.release(connection)
        assert isinstance(connection.retry, Retry)
        failures: list[Exception] = [RedisConnectionError("reply lost"), RedisTimeoutError("no reply")]

        async def command() -> str:
            if failures:
                raise failures.pop(0)
            return "PONG"

        async def failed(error: Exception) -> None:
            pass

        assert await connection.retry.call_with_retry(command, failed) == "PONG"
    finally:
        await client.aclose()


async def test_a_replayed_start_at_once_starts_nothing_more(store: JobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    now = time.time()
    new = NewRequest(new_request_id(now), {"inputs": {}}, now, now + 60)
    # Each submit() draws a run token; the client resends the very same call (same token).
    monkeypatch.setattr(jobs, "secrets", SimpleNamespace(token_hex=lambda nbytes: "lost-reply"))
    for _ in range(2):  # the same SUBMIT again, as the client resends it after a lost reply
        submitted = await store.submit([new], model="m", tenant="t", band="normal", admission=OPEN, start_as="c1")
        assert submitted.outcome == "started"
    job = await store.load(new.request_id)
    assert job is not None and job.state == State.RUNNING and job.attempts == 1
    # Its `queued` and `running` events, written once (one entry holds both: results/events.py).
    (entry,) = [fields for _, fields in await store.redis.xrange(SHARD.events(new.request_id))]
    assert entry["event"] == "running" and "queued" in entry
    assert await store.redis.hget(SHARD.running, "t:t") == "1"


async def test_a_replayed_take_starts_nothing_more(store: JobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    _, (first, second) = await queue(store, "t", 2)
    # Each take() draws a token; the client resends the very same call (same token) after a lost reply.
    monkeypatch.setattr(jobs, "secrets", SimpleNamespace(token_hex=lambda nbytes: "lost-reply"))
    job = await store.take(SHARD, "m", "c1")
    replay = await store.take(SHARD, "m", "c1")
    assert isinstance(job, Job) and isinstance(replay, Job)
    assert job.request_id == replay.request_id == first
    assert job.attempts == replay.attempts == 1
    events = [fields["event"] for _, fields in await store.redis.xrange(SHARD.events(first))]
    assert events.count("running") == 1
    waiting = await store.load(second)
    assert waiting is not None and waiting.state == State.QUEUED


async def test_a_run_taken_again_gets_the_token_ids_of_the_pieces_sent_before(store: JobStore) -> None:
    await queue(store, "t", 2)
    first = await store.take(SHARD, "m", "a")
    assert isinstance(first, Job)
    assert (await store.emit(first.request_id, first.run, 0, "ab", 2, [11, 12])).outcome == "ok"
    await store.redis.zadd(SHARD.leases, {first.request_id: 0})  # a's lease ran out
    assert await store.reclaim(SHARD) == 1
    taken = await store.take_many(SHARD, "m", "b", most=4)
    assert isinstance(taken, list) and [job.emitted for job in taken] == [2, 0]
    assert taken[0].request_id == first.request_id and taken[0].emitted_ids == [11, 12]
    assert taken[1].emitted_ids == []


async def test_a_replayed_take_of_several_starts_nothing_more(store: JobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    _, ids = await queue(store, "t", 3)
    monkeypatch.setattr(jobs, "secrets", SimpleNamespace(token_hex=lambda nbytes: "lost-reply"))
    taken = await store.take_many(SHARD, "m", "c1", most=2)
    replay = await store.take_many(SHARD, "m", "c1", most=2)
    assert isinstance(taken, list) and isinstance(replay, list)
    assert [j.request_id for j in taken] == [j.request_id for j in replay] == ids[:2]
    assert [j.run for j in taken] == [j.run for j in replay]
    for request_id in ids[:2]:
        events = [fields["event"] for _, fields in await store.redis.xrange(SHARD.events(request_id))]
        assert events.count("running") == 1
    waiting = await store.load(ids[2])
    assert waiting is not None and waiting.state == State.QUEUED


async def test_a_dispatchers_last_take_is_not_kept_forever(store: JobStore) -> None:
    await queue(store, "t", 1)
    assert isinstance(await store.take(SHARD, "m", "c1"), Job)
    assert 0 < await store.redis.ttl(f"{SHARD.prefix}take:c1") <= TAKE_TOKEN_TTL_S


async def _writes(store: JobStore) -> int:
    """Writes the Redis has made (each one replicated): its changes since the last save."""
    return int((await store.redis.info("persistence"))["rdb_changes_since_last_save"])


async def test_a_replayed_submit_or_finish_writes_so_that_the_wait_after_it_covers_what_it_found(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # WAIT counts only the writes of its own connection: a replay on a new connection that
    # wrote nothing would be confirmed at once, whether or not a replica holds what it found.
    monkeypatch.setattr(jobs, "secrets", SimpleNamespace(token_hex=lambda nbytes: "lost-reply"))
    now = time.time()
    new = NewRequest(new_request_id(now), {"inputs": {}}, now, now + 60, idempotency=("key", "hash"))
    kwargs: dict = {"model": "m", "tenant": "t", "band": "normal", "admission": OPEN, "start_as": "c1"}
    assert (await store.submit([new], **kwargs)).outcome == "started"
    before = await _writes(store)
    assert (await store.submit([new], **kwargs)).outcome == "started"  # the same call, replayed
    assert await _writes(store) > before
    other = NewRequest(new_request_id(now), {"inputs": {}}, now, now + 60, idempotency=("key", "hash"))
    before = await _writes(store)
    assert (await store.submit([other], **kwargs)).outcome == "existing"  # answered with the first
    assert await _writes(store) > before
    job = await store.load(new.request_id)
    assert job is not None
    record = job.record(State.SUCCEEDED)
    assert isinstance(await store.finish(record, run=job.run), str)
    before = await _writes(store)
    assert await store.finish(record, run=job.run) is None  # the same finish, replayed
    assert await _writes(store) > before


# -- leases, reclaim, hand-over -------------------------------------------------------------------


async def test_a_run_whose_lease_ran_out_starts_again_first_as_a_new_attempt(store: JobStore) -> None:
    await queue(store, "t", 2)
    job = await store.take(SHARD, "m", "dead")
    assert isinstance(job, Job)
    await store.redis.zadd(SHARD.leases, {job.request_id: 0})
    assert await store.reclaim(SHARD) == 1
    again = await store.take(SHARD, "m", "alive")
    assert isinstance(again, Job) and again.request_id == job.request_id and again.attempts == 2
    assert await store.renew(SHARD, "dead", [(job.request_id, job.run)]) == [0]  # the old run is stale


async def test_handed_over_runs_start_again_at_once(store: JobStore) -> None:
    await queue(store, "t", 1)
    job = await store.take(SHARD, "m", "stopping")
    assert isinstance(job, Job)
    assert await store.handover("stopping", [(job.request_id, job.run)]) == 1
    again = await store.take(SHARD, "m", "other")
    assert isinstance(again, Job) and again.request_id == job.request_id


async def test_a_take_lost_in_a_failover_reuses_the_attempt_number_but_fences_the_old_run_out(
    store: JobStore,
) -> None:
    await queue(store, "t", 1)
    first = await store.take(SHARD, "m", "a")
    assert isinstance(first, Job)
    request_id, request = first.request_id, SHARD.request(first.request_id)
    await store.redis.zadd(SHARD.leases, {request_id: 0})  # a's lease ran out
    assert await store.reclaim(SHARD) == 1
    lost = await store.take(SHARD, "m", "b")
    assert isinstance(lost, Job) and lost.attempts == 2
    # A failover loses b's TAKE: the promoted replica holds the request as it was before it
    # (attempts 1, a's run, no owner, first in line). b runs on, unaware.
    await store.redis.hset(request, mapping={"attempts": 1, "run": first.run})
    await store.redis.hdel(request, "owner")
    await store.redis.zrem(SHARD.leases, request_id)
    await store.redis.rpush(SHARD.reclaimed("m"), request_id)
    again = await store.take(SHARD, "m", "c")
    assert isinstance(again, Job) and again.request_id == request_id
    assert again.attempts == lost.attempts == 2  # the attempt number is handed out twice
    assert again.run != lost.run  # the fence never is
    # b, the run whose TAKE was lost, can neither publish, keep, hand on nor finish it.
    assert (await store.emit(request_id, lost.run, 0, "x", 1, [])).outcome == "stale"
    assert await store.renew(SHARD, "b", [(request_id, lost.run)]) == [0]
    assert await store.handover("b", [(request_id, lost.run)]) == 0
    assert await store.finish(lost.record(State.SUCCEEDED), run=lost.run) is None
    # c, the current run, can.
    assert (await store.emit(request_id, again.run, 0, "y", 1, [])).outcome == "ok"
    await finish(store, again)


async def test_hand_overs_do_not_count_as_deliveries(store: JobStore) -> None:
    await queue(store, "t", 1)
    for i in range(5):  # five rolling deploys, each draining gateway passing the run on
        job = await store.take(SHARD, "m", f"draining-{i}")
        assert isinstance(job, Job) and job.deliveries == 1
        assert await store.handover(f"draining-{i}", [(job.request_id, job.run)]) == 1
    job = await store.take(SHARD, "m", "last")
    assert isinstance(job, Job) and job.attempts == 6 and job.handovers == 5 and job.deliveries == 1
    # A run that died (its lease ran out) is a delivery that failed: it counts.
    await store.redis.zadd(SHARD.leases, {job.request_id: 0})
    assert await store.reclaim(SHARD) == 1
    again = await store.take(SHARD, "m", "heir")
    assert isinstance(again, Job) and again.attempts == 7 and again.deliveries == 2


async def test_renewing_keeps_a_run_and_reports_a_cancel(store: JobStore) -> None:
    await queue(store, "t", 1)
    job = await store.take(SHARD, "m", "c1")
    assert isinstance(job, Job)
    assert await store.renew(SHARD, "c1", [(job.request_id, job.run)]) == [1]
    await store.cancel(job.request_id)
    assert await store.renew(SHARD, "c1", [(job.request_id, job.run)]) == [2]


# -- token events --------------------------------------------------------------------------------


async def test_a_replayed_emit_adds_nothing(store: JobStore) -> None:
    _, (request_id,) = await queue(store, "t", 1, start_as="c1")
    run = await run_of(store, request_id)
    assert (await store.emit(request_id, run, 0, "Hello", 1, [7])).outcome == "ok"
    replay = await store.emit(request_id, run, 0, "Hello", 1, [7])
    assert replay.outcome == "ok" and replay.event_id == ""
    assert await store.redis.xlen(SHARD.events(request_id)) == 2  # queued and running (one entry), one token


async def test_an_emit_past_the_stream_end_reports_the_gap(store: JobStore) -> None:
    _, (request_id,) = await queue(store, "t", 1, start_as="c1")
    reply = await store.emit(request_id, await run_of(store, request_id), 4, "late", 1, [])
    assert reply.outcome == "gap" and reply.emitted == 0


async def test_finish_refuses_a_stream_that_lost_pieces(store: JobStore) -> None:
    _, (request_id,) = await queue(store, "t", 1, start_as="c1")
    run = await run_of(store, request_id)
    await store.emit(request_id, run, 0, "a", 1, [])
    job = await store.load(request_id)
    assert job is not None
    assert await store.finish(job.record(State.SUCCEEDED), run=run, emitted=3) == 1
    await store.emit(request_id, run, 1, "bc", 2, [])
    assert isinstance(await store.finish(job.record(State.SUCCEEDED), run=run, emitted=3), str)


async def test_a_stale_run_can_neither_emit_nor_finish(store: JobStore) -> None:
    _, (request_id,) = await queue(store, "t", 1, start_as="c1")
    first = await run_of(store, request_id)
    await store.handover("c1", [(request_id, first)])
    job = await store.take(SHARD, "m", "c2")
    assert isinstance(job, Job) and job.attempts == 2
    assert (await store.emit(request_id, first, 0, "x", 1, [])).outcome == "stale"
    assert await store.finish(job.record(State.SUCCEEDED), run=first) is None


# -- what is left ------------------------------------------------------------------------------------


async def test_nothing_per_tenant_is_left_when_the_work_is_done(store: JobStore) -> None:
    limited = Admission(**{**OPEN.__dict__, "max_concurrent": 1})
    await queue(store, "a", 3, admission=limited)
    await queue(store, "b", 2, band="batch")
    _, (cancelled,) = await queue(store, "c", 1)
    await spine.cancel(store, cancelled)
    while True:
        jobs = await take_all(store)
        if not jobs:
            break
        for job in jobs:
            await finish(store, job)
    keys = set(await store.redis.keys("*"))
    per_tenant = [k for k in keys if any(part in k for part in (":q:", ":blocked:"))]
    assert per_tenant == []
    assert await store.redis.hgetall(SHARD.backlog) == {}
    assert await store.redis.hgetall(SHARD.running) == {}
    assert await store.redis.zcard(SHARD.leases) == 0
    for band in ("normal", "batch"):
        assert await store.redis.zcard(SHARD.ready("m", band)) == 0


# -- deadlines: the sweeper's set ---------------------------------------------------------------------


async def test_a_queued_request_is_in_the_deadlines_set(store: JobStore) -> None:
    _, (request_id,) = await queue(store, "t", 1)
    assert await store.redis.zscore(SHARD.deadlines, request_id) is not None


async def test_a_run_started_at_once_stays_out_of_the_deadlines_set_and_finishes_without_it(store: JobStore) -> None:
    outcome, (request_id,) = await queue(store, "t", 1, start_as="c1")
    assert outcome == "started"
    assert await store.redis.zscore(SHARD.deadlines, request_id) is None
    job = await store.load(request_id)
    assert job is not None
    await finish(store, job)
    assert await store.redis.zcard(SHARD.deadlines) == 0


async def test_a_run_started_at_once_whose_lease_ran_out_enters_the_deadlines_set(store: JobStore) -> None:
    _, (request_id,) = await queue(store, "t", 1, start_as="c1")
    job = await store.load(request_id)
    assert job is not None
    await store.redis.zadd(SHARD.leases, {request_id: 0})  # its process died
    assert await store.reclaim(SHARD) == 1
    assert await store.redis.zscore(SHARD.deadlines, request_id) == job.deadline
    again = await store.take(SHARD, "m", "c2")
    assert isinstance(again, Job) and again.request_id == request_id
    await finish(store, again)
    assert await store.redis.zcard(SHARD.deadlines) == 0


async def test_a_run_started_at_once_and_handed_over_enters_the_deadlines_set(store: JobStore) -> None:
    _, (request_id,) = await queue(store, "t", 1, start_as="c1")
    job = await store.load(request_id)
    assert job is not None
    assert await store.handover("c1", [(request_id, job.run)]) == 1
    assert await store.redis.zscore(SHARD.deadlines, request_id) == job.deadline
    again = await store.take(SHARD, "m", "c2")
    assert isinstance(again, Job) and again.request_id == request_id
    await finish(store, again)
    assert await store.redis.zcard(SHARD.deadlines) == 0


# -- finishes ready together: one FINISH ---------------------------------------------------------------


@pytest.fixture
async def clients(redis_server: str) -> AsyncIterator[RedisClients]:
    clients = RedisClients.open(url=redis_server, cluster_nodes=[], timeout_s=5, max_connections=20)
    await clients.main.flushdb()
    yield clients
    await clients.main.aclose()


@pytest.fixture
def grouped(clients: RedisClients) -> JobStore:
    """A JobStore whose script calls go through a group commit, as a gateway's on one Redis."""
    return JobStore(clients.main, idempotency_ttl_s=60, lease_ms=10_000, replication=clients)


async def _evalshas(redis: aioredis.Redis) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def test_finishes_ready_together_end_in_one_call(grouped: JobStore) -> None:
    limited = Admission(**{**OPEN.__dict__, "max_concurrent": 3})
    await queue(grouped, "a", 3, admission=limited)
    await queue(grouped, "b", 4)
    first, *jobs = await take_all(grouped)
    assert len(jobs) == 6
    await finish(grouped, first)  # alone (and the script loaded, if Redis did not know it)
    before = await _evalshas(grouped.redis)
    finished = await asyncio.gather(*(grouped.finish(job.record(State.SUCCEEDED), run=job.run) for job in jobs))
    # The first alone (nothing was pending: sent at once), the five made while it was in flight in one.
    assert await _evalshas(grouped.redis) - before == 2
    assert all(isinstance(record, str) for record in finished)
    for job in jobs:
        ended = await grouped.load(job.request_id)
        assert ended is not None and ended.state == State.SUCCEEDED
    assert await grouped.redis.hgetall(SHARD.running) == {}
    assert await grouped.redis.zcard(SHARD.leases) == 0


async def test_a_tenant_at_its_limit_is_unblocked_by_runs_ending_together(grouped: JobStore) -> None:
    limited = Admission(**{**OPEN.__dict__, "max_concurrent": 2})
    await queue(grouped, "a", 4, admission=limited)
    jobs = await take_all(grouped)
    assert len(jobs) == 2  # at its limit: the other two wait in its blocked set
    await asyncio.gather(*(grouped.finish(job.record(State.SUCCEEDED), run=job.run) for job in jobs))
    assert len(await take_all(grouped)) == 2


async def test_in_one_call_each_finish_gets_its_own_outcome(grouped: JobStore) -> None:
    await queue(grouped, "t", 3)
    ran, stale, streamed = await take_all(grouped)
    await grouped.redis.hset(SHARD.request(streamed.request_id), "emitted", 1)
    before = await _evalshas(grouped.redis)
    outcomes = await asyncio.gather(
        grouped.finish(ran.record(State.SUCCEEDED), run=ran.run),
        grouped.finish(stale.record(State.SUCCEEDED), run="another run"),
        grouped.finish(streamed.record(State.SUCCEEDED), run=streamed.run, emitted=3),
        grouped.finish(ran.record(State.FAILED), run=ran.run),  # the same request again: already ended
    )
    assert await _evalshas(grouped.redis) - before == 2  # the first alone (nothing was pending), the rest in one
    assert isinstance(outcomes[0], str)
    assert outcomes[1] is None
    assert outcomes[2] == 1  # the gap: the stream holds 1 piece of the 3 the run sent
    assert outcomes[3] is None
    ended = await grouped.load(ran.request_id)
    assert ended is not None and ended.state == State.SUCCEEDED


# -- submissions ready together: one SUBMIT --------------------------------------------------------------


def _new(idempotency: tuple[str, str] | None = None) -> NewRequest:
    now = time.time()
    return NewRequest(new_request_id(now), {"inputs": {}}, now, now + 60, idempotency)


async def test_submissions_ready_together_go_in_one_call_each_admitted_as_if_alone(grouped: JobStore) -> None:
    await queue(grouped, "warm", 1, start_as="c0")  # (the script loaded, if Redis did not know it)
    small = Admission(**{**OPEN.__dict__, "tenant_max_queued": 1})
    before = await _evalshas(grouped.redis)
    answers = await asyncio.gather(
        grouped.submit([_new()], model="m", tenant="a", band="normal", admission=OPEN, start_as="c1"),
        grouped.submit([_new()], model="m", tenant="b", band="normal", admission=small),
        grouped.submit([_new()], model="m", tenant="b", band="normal", admission=small),
        grouped.submit([_new(), _new()], model="m", tenant="c", band="normal", admission=OPEN),
    )
    assert await _evalshas(grouped.redis) - before == 2  # a's alone (nothing was pending), the rest in one
    assert [a.outcome for a in answers] == ["started", "accepted", "full", "accepted"]
    assert answers[2].reason == "tenant"  # b's second: its first, in the same call, counts
    assert await grouped.redis.zcard(SHARD.leases) == 2  # warm's and a's
    assert await grouped.redis.hget(SHARD.running, "t:a") == "1"


async def _calls_of(redis: aioredis.Redis, command: str) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_submissions_in_one_call_read_the_backlog_counters_once(grouped: JobStore) -> None:
    await queue(grouped, "warm", 1)  # (the script loaded, if Redis did not know it)
    before = await _calls_of(grouped.redis, "hmget")
    answers = await asyncio.gather(
        *(grouped.submit([_new()], model="m", tenant="t", band="normal", admission=OPEN) for _ in range(5))
    )
    assert [a.outcome for a in answers] == ["accepted"] * 5
    # Each submission looks for its own hash (a replay); the counters are read once a call:
    # the first's alone (nothing was pending), the other four's together.
    assert await _calls_of(grouped.redis, "hmget") - before == 5 + 2
    assert await grouped.redis.hget(SHARD.backlog, "m:m") == "6"


async def test_a_concurrency_limit_holds_within_one_call(grouped: JobStore) -> None:
    limited = Admission(**{**OPEN.__dict__, "max_concurrent": 2})
    answers = await asyncio.gather(
        *(
            grouped.submit([_new()], model=model, tenant="t", band="normal", admission=limited, start_as="c1")
            for model in ("m", "n", "o", "p")  # other models: nothing of one waits behind another
        )
    )
    assert sorted(a.outcome for a in answers) == ["accepted", "accepted", "started", "started"]
    assert await grouped.redis.hget(SHARD.running, "t:t") == "2"
    assert await grouped.redis.zcard(SHARD.leases) == 2


async def test_the_same_idempotency_key_twice_in_one_call_is_one_request(grouped: JobStore) -> None:
    first, second = _new(("key", "h1")), _new(("key", "h1"))
    answers = await asyncio.gather(
        grouped.submit([first], model="m", tenant="t", band="normal", admission=OPEN),
        grouped.submit([second], model="m", tenant="t", band="normal", admission=OPEN),
    )
    assert answers[0].outcome == "accepted"
    assert answers[1].outcome == "existing" and answers[1].existing == [(first.request_id, "h1")]
    assert not await grouped.redis.exists(SHARD.request(second.request_id))


# -- the cost of a request ---------------------------------------------------------------------------

# What a request started at once and finished costs Redis: the commands inside the scripts
# (INFO commandstats counts them, TIME for the lease's end on Redis's clock among them) and
# the two EVALSHA.
STARTED_AND_FINISHED_COMMANDS = 22


async def _commands(redis: aioredis.Redis) -> int:
    stats = await redis.info("commandstats")
    return sum(int(stat["calls"]) for name, stat in stats.items() if name != "cmdstat_info")


async def test_a_request_started_at_once_and_finished_costs_at_most_22_redis_commands(store: JobStore) -> None:
    for _ in range(2):  # counted the second time: the scripts loaded, the tenant's settings written
        counted = await _commands(store.redis)
        outcome, (request_id,) = await queue(store, "t", 1, start_as="c1")
        counted = await _commands(store.redis) - counted
        job = await store.load(request_id)
        assert outcome == "started" and job is not None
        before_finish = await _commands(store.redis)
        await finish(store, job)
        counted += await _commands(store.redis) - before_finish
    assert counted <= STARTED_AND_FINISHED_COMMANDS, counted


async def test_a_finished_request_keeps_its_live_state_until_the_binder_stores_it(store: JobStore) -> None:
    _, (request_id,) = await queue(store, "t", 1, start_as="c1")
    job = await store.load(request_id)
    assert job is not None
    await finish(store, job)
    # No expiry: the binder gives one once it stored the record (or could not).
    assert await store.redis.ttl(SHARD.request(request_id)) == -1
    assert await store.redis.ttl(SHARD.events(request_id)) == -1


# -- the cost of a decision --------------------------------------------------------------------------


async def _one_waiting_per_tenant(store: JobStore, model: str, tenants: int) -> None:
    """One waiting request per tenant of `model`, queued directly."""
    async with store.redis.pipeline(transaction=False) as pipe:
        for n in range(tenants):
            request_id = new_request_id(shard=0)
            key = SHARD.request(request_id)
            pipe.hset(key, mapping={"state": "queued", "model": model, "tenant": f"t{n}", "band": "normal"})
            pipe.rpush(SHARD.queue(model, "normal", f"t{n}"), request_id)
            pipe.zadd(SHARD.ready(model, "normal"), {f"t{n}": 0})
        await pipe.execute()


async def test_a_scheduling_decision_does_not_grow_with_the_waiting_tenants(store: JobStore) -> None:
    await store.redis.flushdb()
    await _one_waiting_per_tenant(store, "few", 100)
    await _one_waiting_per_tenant(store, "many", 10_000)
    samples: dict[str, list[float]] = {"few": [], "many": []}
    for _ in range(30):  # taken in turn, so whatever else loads the machine weighs on both alike
        for model, times in samples.items():
            started = time.perf_counter()
            assert isinstance(await store.take(SHARD, model, "c1"), Job)
            times.append((time.perf_counter() - started) * 1000)
    few, many = statistics.median(samples["few"]), statistics.median(samples["many"])
    # O(log n) in Redis: the same order of cost with 100 times the tenants (the old scheduler,
    # O(n), took 756 ms at 1,000).
    assert many < max(5 * few, few + 5.0), (few, many)


# -- pieces written again after Redis lost them ------------------------------------------------


async def test_pieces_written_again_keep_their_events_boundaries(store: JobStore) -> None:
    from gateway.server.dispatch.emitter import TokenEmitter
    from gateway.server.dispatch.relay import TokenRelay
    from gateway.server.models import Piece

    _, (request_id,) = await queue(store, "t", 1, start_as="c1")
    run = await run_of(store, request_id)
    emitter = TokenEmitter(TokenRelay(store, window_s=0), request_id, run, first_index=0, on_cancel=lambda: None)
    for texts in (["a", "b"], ["c", "d", "e"], ["f"]):
        await emitter.add([Piece(t) for t in texts])
        await emitter.settle()  # (each add its own event: written behind the run otherwise)
    events = SHARD.events(request_id)
    tokens = [entry for entry in await store.redis.xrange(events) if entry[1]["event"] == "token"]
    await store.redis.xdel(events, *(entry_id for entry_id, _ in tokens[1:]))  # Redis lost the last two
    await store.redis.hset(SHARD.request(request_id), "emitted", 2)
    await emitter.refill(time.time() + 10, emitted=2)
    again = [fields for _, fields in await store.redis.xrange(events) if fields["event"] == "token"]
    assert [(f["i"], f["n"]) for f in again] == [("0", "2"), ("2", "3"), ("5", "1")]


async def test_pieces_added_while_an_event_is_written_go_in_the_next_event(store: JobStore) -> None:
    from gateway.server.dispatch.emitter import TokenEmitter
    from gateway.server.dispatch.relay import TokenRelay
    from gateway.server.models import Piece

    _, (request_id,) = await queue(store, "t", 1, start_as="c1")
    run = await run_of(store, request_id)
    emitter = TokenEmitter(TokenRelay(store, window_s=0.05), request_id, run, first_index=0, on_cancel=lambda: None)
    for text in "abcdef":  # as fast as a replica's responses come: adding never waits for Redis
        await emitter.add([Piece(text)])
        await asyncio.sleep(0)  # (the run awaiting its next response)
    await emitter.close(time.time() + 10)
    tokens = [f for _, f in await store.redis.xrange(SHARD.events(request_id)) if f["event"] == "token"]
    assert [(f["i"], f["n"]) for f in tokens] == [("0", "1"), ("1", "5")]


def test_a_reader_skips_token_events_it_has_the_pieces_of() -> None:
    from gateway.server.results.events import EventHub, _Follower, _ShardReader

    reader = _ShardReader(SHARD)
    follower = _Follower("k", "0-0", next_piece=0)
    reader.followers["k"] = {follower}
    EventHub._fan_out(reader, "k", [("1-0", [("token", "ab")], (0, 2)), ("2-0", [("token", "cde")], (2, 3))])
    EventHub._fan_out(reader, "k", [("3-0", [("token", "cde")], (2, 3)), ("4-0", [("token", "f")], (5, 1))])
    delivered = []
    while not follower.queue.empty():
        event = follower.queue.get_nowait()
        assert event is not None
        delivered.append(event.data)
    assert delivered == ["ab", "cde", "f"]


# -- renewals ------------------------------------------------------------------------------------------


async def _started(store: JobStore, consumer: str = "c1") -> tuple[str, str]:
    """A request started at once by `consumer`: (its id, its run's token)."""
    now = time.time()
    request_id = new_request_id(now)
    submitted = await store.submit(
        [NewRequest(request_id, {"inputs": {}}, now, now + 60)],
        model="m",
        tenant="t",
        band="normal",
        admission=OPEN,
        start_as=consumer,
    )
    assert submitted.outcome == "started"
    return request_id, submitted.run


async def _renew(clients: RedisClients, request_id: str, run: str, consumer: str = "c1") -> list[int]:
    client = clients.sync_client()
    try:
        return await asyncio.to_thread(spine.keep_leases, client, SHARD, consumer, 10_000, [(request_id, run)])
    finally:
        client.close()


async def test_renewing_a_running_run_of_ours_keeps_it(grouped: JobStore, clients: RedisClients) -> None:
    request_id, run = await _started(grouped)
    assert await _renew(clients, request_id, run) == [1]


async def _started_and_finished(store: JobStore) -> tuple[str, str]:
    """A request started at once by c1 whose run then finished it: (its id, the run's token)."""
    request_id, run = await _started(store)
    job = await store.load(request_id)
    assert job is not None
    assert isinstance(await store.finish(job.record(State.SUCCEEDED), run=run), str)
    return request_id, run


async def test_renewing_a_run_its_own_finish_ended_says_ended_not_stale(
    grouped: JobStore, clients: RedisClients
) -> None:
    request_id, run = await _started_and_finished(grouped)
    assert await _renew(clients, request_id, run) == [3]
    assert await grouped.redis.zscore(SHARD.leases, request_id) is None  # no lease for an ended run


async def test_renewing_a_run_another_took_over_says_stale(grouped: JobStore, clients: RedisClients) -> None:
    request_id, run = await _started(grouped)
    await grouped.redis.zadd(SHARD.leases, {request_id: 0})  # its lease ran out
    assert await grouped.reclaim(SHARD) == 1
    (taken,) = await take_all(grouped, consumer="c2")
    assert taken.request_id == request_id and taken.run != run
    assert await _renew(clients, request_id, run) == [0]


async def test_the_lease_keeper_forgets_a_run_whose_own_finish_landed_without_stopping_it(
    grouped: JobStore, clients: RedisClients
) -> None:
    request_id, run = await _started_and_finished(grouped)
    flags: list[tuple[str, int]] = []
    keeper = LeaseKeeper(clients, [SHARD], "c1", 300, lambda rid, _run, flag: flags.append((rid, flag)))
    keeper.add(request_id, run)  # the run still registered: its FINISH's reply is on its way back
    keeper.start()
    try:
        deadline = time.monotonic() + 30
        while keeper.rounds < 3:
            assert time.monotonic() < deadline, "the lease keeper made no rounds"
            await asyncio.sleep(0.05)
    finally:
        await keeper.stop()
    await asyncio.sleep(0)  # anything the keeper posted to this loop runs now
    assert flags == []  # not reported stale: the dispatcher would cancel a run awaiting its own FINISH
    keeper.add(request_id, "a later run")  # (it was forgotten: a fresh add is the only entry)
    assert keeper._runs == {request_id: "a later run"}


# -- the high band: a head start, not more than a share ------------------------------------------


async def test_an_idle_granted_tenants_high_band_request_goes_before_the_normal_backlog(store: JobStore) -> None:
    for tenant in ("a", "b", "c"):
        await queue(store, tenant, 3)
    _, (urgent,) = await queue(store, "granted", 1, band="high")
    assert (await take_all(store))[0].request_id == urgent


async def test_a_flood_in_the_high_band_gets_its_tenant_its_share_and_no_more(store: JobStore) -> None:
    await queue(store, "granted", 40, band="high")
    _, ordinary = await queue(store, "other", 5)
    order = [job.request_id for job in await take_all(store)]
    # An equal tenant without priority would alternate with it; the grant adds its head start.
    last_ordinary = max(order.index(request_id) for request_id in ordinary)
    assert last_ordinary < 2 * len(ordinary) + scripts.HIGH_BAND_LEAD


async def test_a_tenant_waiting_in_the_high_and_normal_bands_has_one_share(store: JobStore) -> None:
    await queue(store, "both", 20, band="high")
    await queue(store, "both", 20)
    _, ordinary = await queue(store, "other", 5)
    order = [job.request_id for job in await take_all(store)]
    assert max(order.index(request_id) for request_id in ordinary) < 2 * len(ordinary) + scripts.HIGH_BAND_LEAD


async def test_a_take_of_large_payloads_parses_them_off_the_event_loop(store: JobStore, monkeypatch) -> None:
    threaded: list[object] = []
    real_to_thread = asyncio.to_thread

    async def to_thread(work, *args):
        threaded.append(work)
        return await real_to_thread(work, *args)

    monkeypatch.setattr(jobs.asyncio, "to_thread", to_thread)
    now = time.time()
    small = [NewRequest(new_request_id(now), {"inputs": {"text": "x"}}, now, now + 60) for _ in range(4)]
    await store.submit(small, model="m", tenant="t", band="normal", admission=OPEN)
    assert len(await store.take_many(SHARD, "m", "c1", most=4)) == 4 and threaded == []
    large = [NewRequest(new_request_id(now), {"inputs": {"text": "x" * 100_000}}, now, now + 60) for _ in range(4)]
    await store.submit(large, model="m", tenant="t", band="normal", admission=OPEN)
    taken = await store.take_many(SHARD, "m", "c1", most=4)
    assert len(taken) == 4 and len(threaded) == 1
    assert all(len(job.payload["inputs"]["text"]) == 100_000 for job in taken)


async def test_the_sweep_reads_a_shards_overdue_requests_in_one_round_trip_and_expires_them(
    store: JobStore, monkeypatch
) -> None:
    from gateway.server.dispatch.sweeper import Sweeper
    from gateway.server.settings import GatewaySettings

    now = time.time()
    overdue = [NewRequest(new_request_id(now), {"inputs": {"text": "late"}}, now - 10, now - 1) for _ in range(50)]
    await store.submit(overdue, model="m", tenant="t", band="normal", admission=OPEN)

    async def one_by_one(request_id: str) -> None:
        raise AssertionError("a request read on its own")

    monkeypatch.setattr(store, "load", one_by_one)
    sweeper = Sweeper(store, SimpleNamespace(replicas=[]), GatewaySettings(), metrics=None)  # type: ignore[arg-type]
    await sweeper.sweep()
    assert {job.state for job in await store.load_many([r.request_id for r in overdue])} == {State.EXPIRED}
    assert await store.redis.zcard(SHARD.deadlines) == 0


async def test_the_live_gateways_are_counted_and_a_stale_or_stopped_one_is_not(store: JobStore) -> None:
    from gateway.server.routing.load import GatewayPresence

    one, two = GatewayPresence(store.redis, "gw-1"), GatewayPresence(store.redis, "gw-2", fresh_s=30)
    assert await one.count() == 1
    assert await two.count() == 2
    await store.redis.zadd("gateways", {"gw-gone": time.time() - 60})  # stopped saying so a minute ago
    assert await two.count() == 2
    await one.leave()
    assert await two.count() == 1
