"""Reading a request's outcome: its live state in Redis while it runs, the stored
MongoDB record once the binder has written it, and a clear "expired" after retention."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone

from pymongo.asynchronous.collection import AsyncCollection

from gateway.contracts import ResultRecord, State, record_from_document, request_id_time
from gateway.errors import ApiError
from gateway.jobs import Job, JobStore
from gateway.notifier import CompletionNotifier
from gateway.schemas import LiveStatus, ResultUrls


def result_urls(request_id: str) -> ResultUrls:
    return ResultUrls(
        result=f"/results/{request_id}",
        events=f"/results/{request_id}/events",
        cancel=f"/results/{request_id}/cancel",
    )


def live_status(job: Job) -> LiveStatus:
    return LiveStatus(
        request_id=job.request_id, model=job.model, status=job.state,
        created_at=datetime.fromtimestamp(job.created_at, tz=timezone.utc),
        started_at=datetime.fromtimestamp(job.started_at, tz=timezone.utc) if job.started_at else None,
        attempts=job.attempts, urls=result_urls(job.request_id),
    )


Outcome = ResultRecord | LiveStatus


def is_final(outcome: Outcome) -> bool:
    return outcome.status in (State.SUCCEEDED, State.FAILED, State.CANCELED, State.EXPIRED)


class ResultReader:
    def __init__(
        self, jobs: JobStore, collection: AsyncCollection, notifier: CompletionNotifier, retention_s: int
    ) -> None:
        self.jobs = jobs
        self.collection = collection
        self.notifier = notifier
        self.retention_s = retention_s

    async def _stored(self, request_id: str) -> ResultRecord | None:
        document = await self.collection.find_one({"_id": request_id})
        return record_from_document(document) if document else None

    def _expired_or_unknown(self, request_id: str) -> ApiError:
        created = request_id_time(request_id)
        if created is not None and created + self.retention_s < time.time():
            days = self.retention_s / 86400
            return ApiError(410, "result_expired", f"the result of {request_id} has expired (kept {days:g} days)")
        return ApiError(404, "not_found", f"no request {request_id}")

    async def get(self, request_id: str) -> Outcome:
        job = await self.jobs.load(request_id)
        if job is not None:
            if not job.state.terminal or not job.record_json:
                return live_status(job)
            if job.stored:  # the stored record also carries the webhook outcome
                stored = await self._stored(request_id)
                if stored is not None:
                    return stored
            return ResultRecord.model_validate_json(job.record_json)
        stored = await self._stored(request_id)
        if stored is None:
            raise self._expired_or_unknown(request_id)
        if stored.expires_at and stored.expires_at < datetime.now(timezone.utc):
            raise self._expired_or_unknown(request_id)  # TTL monitor has not swept it yet
        return stored

    async def wait(self, request_id: str, timeout: float) -> Outcome:
        """The outcome as soon as the request ends, or its live state after timeout."""
        async with self.notifier.watch(request_id) as ended:
            outcome = await self.get(request_id)
            if is_final(outcome) or timeout <= 0:
                return outcome
            record = await self.ended(ended, timeout)
        return record or await self.get(request_id)

    @staticmethod
    async def ended(watch: asyncio.Future[str | None], timeout: float) -> ResultRecord | None:
        """The record a watch delivers within timeout, if it does."""
        try:
            record = await asyncio.wait_for(watch, timeout)
        except TimeoutError:
            return None
        return ResultRecord.model_validate_json(record) if record else None

    async def get_many(self, request_ids: list[str]) -> dict[str, ResultRecord]:
        found = {}
        async for document in self.collection.find({"_id": {"$in": request_ids}}):
            record = record_from_document(document)
            found[record.request_id] = record
        for request_id in request_ids:
            if request_id not in found:
                job = await self.jobs.load(request_id)
                if job is not None and job.record_json:
                    found[request_id] = ResultRecord.model_validate_json(job.record_json)
        return found
