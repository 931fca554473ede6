"""Reading a request's outcome: its live state in Redis while it runs, its final record
from Redis while Redis keeps it (until RESULTS_KEEP_S after the binder stored it), the
stored MongoDB record after that, and a clear "expired" after retention. Every read is
scoped to the caller's tenant: another tenant's request reads as unknown (404), so
existence does not leak.

A result the binder has stored reads as MongoDB holds it (`stored`, `expires_at`), but
from Redis's copy while Redis keeps it: what storing adds is known here, and the polls
that follow a request's end (a client polling every second, or a burst of them after a
burst of requests) then cost MongoDB nothing. A request with a webhook is the exception:
MongoDB holds its delivery's outcome."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import deque
from datetime import UTC, datetime

from gateway.common.result_store import ResultStore
from gateway.protocol import ResultRecord, State, request_id_time, utc
from gateway.protocol.http import LiveStatus, QueuePosition, result_urls
from gateway.protocol.redis_keys import shard_of
from gateway.server.errors import Gone, NotFound, Refused
from gateway.server.queue.jobs import Job, JobStore, QueueStanding
from gateway.server.results.notifier import CompletionNotifier

Outcome = ResultRecord | LiveStatus

# A record's JSON (ResultRecord.model_dump_json) names its status third, after two plain
# strings, so the first "status" key is its own (a quote inside a string is escaped).
_STATUS = re.compile(r'"status":"(\w+)"')


def record_state(record: str) -> State:
    """The status of a record's JSON, read without parsing the whole record (its outputs
    can be a vector of thousands of numbers)."""
    found = _STATUS.search(record)
    return State(found.group(1)) if found else State(json.loads(record)["status"])


def live_status(job: Job, queue: QueuePosition | None = None) -> LiveStatus:
    return LiveStatus(
        request_id=job.request_id,
        model=job.model,
        status=job.state,
        created_at=utc(job.created_at) or datetime.now(UTC),
        started_at=utc(job.started_at),
        attempts=job.attempts,
        metadata=job.payload.get("metadata") or {},
        queue=queue,
        urls=result_urls(job.request_id),
    )


class StartRate:
    """How fast queued requests of a model start in a shard (TAKE's starts; those started at
    once by SUBMIT never waited), from the shard's start counter as this process has seen it
    over the last WINDOW_S (read whenever a queued request is)."""

    WINDOW_S = 60.0

    def __init__(self) -> None:
        self._seen: dict[tuple[int, str], deque[tuple[float, int]]] = {}

    def per_second(self, shard: int, model: str, started: int, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        seen = self._seen.setdefault((shard, model), deque())
        seen.append((now, started))
        while len(seen) > 2 and now - seen[1][0] > self.WINDOW_S:
            seen.popleft()
        then, count = seen[0]
        if now - then < 1.0 or started <= count:
            return None
        return (started - count) / (now - then)


def is_final(outcome: Outcome) -> bool:
    return outcome.status.terminal


class ResultReader:
    def __init__(self, jobs: JobStore, store: ResultStore, notifier: CompletionNotifier, retention_s: int) -> None:
        self.jobs = jobs
        self.store = store
        self.notifier = notifier
        self.retention_s = retention_s
        self.rate = StartRate()

    def live(self, job: Job, standing: QueueStanding | None) -> LiveStatus:
        """A request that has not ended, with where it stands while it is queued (read
        with it, at the same instant: JobStore.read)."""
        return live_status(job, self.position(job, standing) if job.state == State.QUEUED else None)

    async def standing(self, job: Job) -> QueuePosition | None:
        """Where a job read as queued stands now (None: it has moved on since)."""
        return self.position(job, await self.jobs.queue_position(job.request_id))

    def position(self, job: Job, found: QueueStanding | None) -> QueuePosition | None:
        if found is None:
            return None
        rate = self.rate.per_second(shard_of(job.request_id).index, job.model, found.started)
        eta = round((found.position + 1) / rate, 3) if rate else None
        return QueuePosition(position=found.position, tenant_position=found.tenant_position, eta_s=eta)

    def unknown(self, request_id: str) -> Refused:
        created = request_id_time(request_id)
        if created is not None and created + self.retention_s < time.time():
            days = self.retention_s / 86400
            return Gone("result_expired", f"the result of {request_id} has expired (kept {days:g} days)")
        return NotFound("not_found", f"no request {request_id}")

    async def job(self, request_id: str, tenant: str | None) -> Job | None:
        """The live job, if it exists and belongs to the tenant (None = any tenant), as a
        status read takes it (without its payload: JobStore.status)."""
        job = await self.jobs.status(request_id)
        if job is None or (tenant is not None and job.tenant != tenant):
            return None
        return job

    def kept_as_stored(self, end: str | None) -> ResultRecord | None:
        """A stored request's record as MongoDB holds it, from Redis's copy while Redis
        keeps it; None for a request with a webhook (MongoDB has its outcome) or once
        Redis's copy is gone."""
        if end is None:
            return None
        record = ResultRecord.model_validate_json(end)  # (FINISH emptied the job's payload)
        return self.store.as_stored(record) if record.webhook is None else None

    async def get(self, request_id: str, tenant: str | None = None) -> Outcome:
        job, end, standing = await self.jobs.read(request_id)
        if job is not None and (tenant is None or job.tenant == tenant):
            if not job.state.terminal:
                return self.live(job, standing)
            if job.stored:
                stored = self.kept_as_stored(end) or await self.store.get(request_id, tenant)
                if stored is not None:
                    return stored
            if end:
                return ResultRecord.model_validate_json(end)
        stored = await self.store.get(request_id, tenant)
        if stored is None:
            raise self.unknown(request_id)
        if stored.expires_at and stored.expires_at < datetime.now(UTC):
            raise self.unknown(request_id)  # the TTL monitor has not swept it yet
        return stored

    async def wait(self, request_id: str, timeout: float, tenant: str | None = None) -> Outcome:
        """The outcome as soon as the request ends, or its live state after timeout."""
        deadline = time.monotonic() + timeout
        while True:
            async with self.notifier.watch(request_id) as ended:
                outcome = await self.get(request_id, tenant)
                remaining = deadline - time.monotonic()
                if is_final(outcome) or remaining <= 0:
                    return outcome
                record = await self.ended(ended, remaining)
            if record is not None:
                return record

    @staticmethod
    async def ended(watch: asyncio.Future[str | None], timeout: float) -> ResultRecord | None:
        """The record a watch delivers within timeout, if it does."""
        try:
            record = await asyncio.wait_for(watch, timeout)
        except TimeoutError:
            return None
        return ResultRecord.model_validate_json(record) if record else None

    async def record_json(self, request_id: str, entry: str) -> str:
        """A record named by its results-stream entry: from Redis, or MongoDB once stored."""
        record = await self.jobs.record_at(shard_of(request_id), entry)
        if record is not None:
            return record
        stored = await self.store.get(request_id, None)
        if stored is None:
            raise self.unknown(request_id)
        return stored.model_dump_json()

    async def get_json(self, request_id: str, tenant: str | None = None) -> tuple[bool, str, State]:
        """As get(), as JSON: (ended, the record's or live state's JSON, state). The record
        of a request that ended is passed on as Redis holds it, never parsed again (once
        stored, parsed once here to add what storing adds: kept_as_stored)."""
        job, end, standing = await self.jobs.read(request_id)
        if job is not None and (tenant is None or job.tenant == tenant):
            if not job.state.terminal:
                return False, self.live(job, standing).model_dump_json(), job.state
            if end is not None and not job.stored:
                return True, end, job.state
            if job.stored and (kept := self.kept_as_stored(end)) is not None:
                return True, kept.model_dump_json(), kept.status
        outcome = await self.get(request_id, tenant)
        return is_final(outcome), outcome.model_dump_json(), outcome.status

    async def wait_json(
        self, request_id: str, timeout: float, tenant: str | None = None, *, fresh: bool = False
    ) -> tuple[bool, str, State]:
        """As wait(), as JSON (see get_json): the record a waiter is woken with is passed on
        as is. fresh: the request was started just now in this process by this caller (it
        cannot have ended before this call watches for its end), so nothing is read before
        waiting."""
        deadline = time.monotonic() + timeout
        while True:
            async with self.notifier.watch(request_id) as ended:
                if not fresh:
                    final, body, state = await self.get_json(request_id, tenant)
                    remaining = deadline - time.monotonic()
                    if final or remaining <= 0:
                        return final, body, state
                fresh = False
                remaining = deadline - time.monotonic()
                try:
                    record = await asyncio.wait_for(ended, remaining)
                except TimeoutError:
                    record = None
            if record is not None:
                return True, record, record_state(record)

    async def get_many(self, request_ids: list[str], tenant: str | None = None) -> dict[str, ResultRecord]:
        found = await self.store.get_many(request_ids, tenant)
        for request_id in request_ids:
            if request_id not in found:
                job = await self.job(request_id, tenant)
                if job is not None and job.state.terminal:
                    data = await self.jobs.final_record(request_id)
                    if data:
                        found[request_id] = ResultRecord.model_validate_json(data)
        return found
