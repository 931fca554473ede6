"""JobStore: the request lifecycle on top of the scripts in scripts.py.

submit -> (queue stream) -> start [attempt n] -> emit* -> finish, with cancel and expiry
from outside. A run holds its attempt number (its fence) from start to finish."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from redis.asyncio import Redis

from gateway.protocol import (
    TERMINAL_EVENT,
    ErrorInfo,
    IndexRef,
    ResultRecord,
    Route,
    State,
    Timings,
    Usage,
    WebhookSpec,
    utc,
)
from gateway.protocol.redis_keys import (
    BACKLOG,
    CANCEL_CHANNEL,
    DEADLINES,
    DISPATCH_GROUP,
    DONE_CHANNEL,
    QUEUE_REGISTRY,
    RESULTS_STREAM,
    RUNNING,
    events_key,
    idempotency_key,
    request_key,
)
from gateway.server.queue import scripts

# The `running` event of a request started by SUBMIT itself (its first attempt).
RUNNING_FIRST = json.dumps({"attempt": 1, "restarted": False, "resume_from": 0})


def tokens_key(request_id: str) -> str:
    return f"tokens:{request_id}"


@dataclass(frozen=True)
class Submitted:
    outcome: str  # "accepted", "started" (accepted and begun here), "existing" (idempotent replay) or "full"
    request_id: str | None = None
    body_hash: str | None = None
    reason: str = ""  # full: backlog, bytes or tenant
    count: int = 0
    entry: str = ""  # accepted or started: its queue entry


@dataclass
class Job:
    """A request as the dispatcher and the API see it, read from its hash."""

    request_id: str
    model: str
    tenant: str
    state: State
    payload: dict[str, Any]
    created_at: float
    deadline: float
    started_at: float | None
    attempts: int
    emitted: int
    cancel_requested: bool
    stored: bool  # the binder has written the result to MongoDB
    stream: str = ""
    entry: str = ""
    replica: str | None = None
    # Token ids already emitted by earlier runs (engine path), to resume from.
    emitted_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hash(cls, request_id: str, h: dict[str, str], tokens: str = "") -> Job:
        return cls(
            request_id=request_id,
            model=h.get("model", ""),
            tenant=h.get("tenant", ""),
            state=State(h["state"]),
            payload=json.loads(h.get("payload") or "{}"),
            created_at=float(h.get("created_at", 0)),
            deadline=float(h.get("deadline", 0)),
            started_at=float(h["started_at"]) if h.get("started_at") else None,
            attempts=int(h.get("attempts", 0)),
            emitted=int(h.get("emitted", 0)),
            cancel_requested=h.get("cancel") == "1",
            stored=h.get("stored") == "1",
            stream=h.get("stream", ""),
            entry=h.get("entry", ""),
            replica=h.get("replica"),
            emitted_ids=[int(t) for t in tokens.split(",") if t],
        )

    def record(
        self,
        status: State,
        *,
        outputs: dict[str, Any] | None = None,
        error: ErrorInfo | None = None,
        replica: str | None = None,
        route: Route | None = None,
        usage: Usage | None = None,
        ttft_s: float | None = None,
        index: IndexRef | None = None,
        finished_at: float | None = None,
    ) -> ResultRecord:
        finished = time.time() if finished_at is None else finished_at
        started = self.started_at
        webhook = self.payload.get("webhook")
        return ResultRecord(
            request_id=self.request_id,
            model=self.model,
            tenant=self.tenant,
            status=status,
            inputs=self.payload.get("inputs_stored", {}),
            parameters=self.payload.get("parameters", {}),
            outputs=outputs,
            error=error,
            replica=replica,
            route=route,
            usage=usage,
            attempts=self.attempts,
            created_at=datetime.fromtimestamp(self.created_at, tz=UTC),
            started_at=utc(started),
            finished_at=utc(finished),
            timings=Timings(
                queue_ms=round((started - self.created_at) * 1000, 3) if started else None,
                run_ms=round((finished - started) * 1000, 3) if started else None,
                ttft_ms=round(ttft_s * 1000, 3) if ttft_s is not None else None,
                total_ms=round((finished - self.created_at) * 1000, 3),
            ),
            webhook=WebhookSpec.model_validate(webhook) if webhook else None,
            index=index if status == State.SUCCEEDED else None,
            metadata=self.payload.get("metadata") or {},
            trace_id=self.payload.get("trace_id"),
        )


class JobStore:
    def __init__(self, redis: Redis, *, live_state_ttl_s: int, idempotency_ttl_s: int) -> None:
        self.redis = redis
        self.live_state_ttl_s = live_state_ttl_s
        self.idempotency_ttl_s = idempotency_ttl_s
        self._submit = redis.register_script(scripts.SUBMIT)
        self._start = redis.register_script(scripts.START)
        self._emit = redis.register_script(scripts.EMIT)
        self._check = redis.register_script(scripts.CHECK)
        self._finish = redis.register_script(scripts.FINISH)
        self._cancel = redis.register_script(scripts.CANCEL)

    async def submit(
        self,
        *,
        request_id: str,
        model: str,
        tenant: str,
        payload: dict[str, Any],
        created_at: float,
        deadline: float,
        stream: str,
        band: str,
        max_backlog: int,
        max_backlog_bytes: int,
        tenant_max_queued: int = 0,
        idempotency: tuple[str, str] | None = None,
        start_as: str = "",
    ) -> Submitted:
        """idempotency is (key, body hash): the same key returns the first request's id.
        start_as: the consumer (this process's) to start the request at once, if nothing of
        its model is queued (outcome "started", with its queue entry)."""
        idem_key = idempotency_key(tenant, idempotency[0]) if idempotency else ""
        idem_value = json.dumps({"id": request_id, "hash": idempotency[1]}) if idempotency else ""
        queued = json.dumps({"request_id": request_id, "model": model, "created_at": created_at})
        reply = await self._submit(
            keys=[
                request_key(request_id),
                events_key(request_id),
                stream,
                DEADLINES,
                BACKLOG,
                idem_key,
                QUEUE_REGISTRY,
                RUNNING,
            ],
            args=[
                request_id,
                model,
                tenant,
                json.dumps(payload, separators=(",", ":")),
                created_at,
                deadline,
                max_backlog,
                max_backlog_bytes,
                queued,
                idem_value,
                self.idempotency_ttl_s,
                time.time(),
                tenant_max_queued,
                band,
                DISPATCH_GROUP,
                start_as,
                RUNNING_FIRST,
            ],
        )
        outcome = reply[0]
        if outcome == "existing":
            previous = json.loads(reply[1])
            return Submitted("existing", previous["id"], previous["hash"])
        if outcome == "full":
            return Submitted("full", reason=reply[1], count=int(reply[2] or 0))
        return Submitted(outcome, request_id, entry=reply[1])

    async def load(self, request_id: str) -> Job | None:
        h = await self.redis.hgetall(request_key(request_id))
        return Job.from_hash(request_id, h) if h else None

    async def final_record(self, request_id: str) -> str | None:
        """The terminal record of an ended request, from its event stream (the last event)."""
        last = await self.redis.xrevrange(events_key(request_id), count=1)
        if last and last[0][1].get("event") in {e.value for e in TERMINAL_EVENT.values()}:
            return last[0][1].get("data")
        return None

    async def start(self, request_id: str, consumer: str, entry: str) -> Job | None:
        """Mark the request running (again, if a dead dispatcher had it) under a new
        attempt. None when there is nothing to run: unknown, or already ended."""
        reply = await self._start(
            keys=[request_key(request_id), events_key(request_id), BACKLOG, tokens_key(request_id), RUNNING],
            args=[consumer, time.time(), entry],
        )
        if reply[0] != "run":
            return None
        fields = reply[1]
        return Job.from_hash(request_id, dict(zip(fields[::2], fields[1::2], strict=True)), reply[2])

    async def emit(self, request_id: str, attempt: int, text: str, count: int, ids: list[int]) -> str:
        """Publish a token event for run `attempt`: 'ok', 'cancel' or 'stale'."""
        return await self._emit(
            keys=[request_key(request_id), events_key(request_id), tokens_key(request_id)],
            args=[attempt, text, count, "".join(f"{t}," for t in ids)],
        )

    async def check(self, runs: list[tuple[str, int]]) -> list[int]:
        """For (request id, attempt) pairs: 1 still ours, 2 asked to cancel, 0 stale."""
        if not runs:
            return []
        return await self._check(keys=[request_key(rid) for rid, _ in runs], args=[a for _, a in runs])

    async def finish(
        self,
        record: ResultRecord,
        *,
        allowed: tuple[State, ...] = (State.RUNNING,),
        attempt: int | None = None,
        output_event: dict[str, Any] | None = None,
    ) -> str | None:
        """Record the terminal state once; returns the record's JSON, or None if the
        request was not in an allowed state, or `attempt` is no longer the current run.
        output_event, if given, is published as an `output` event before the terminal one."""
        data = record.model_dump_json()
        finished = record.finished_at.timestamp() if record.finished_at else time.time()
        applied = await self._finish(
            keys=[
                request_key(record.request_id),
                events_key(record.request_id),
                RESULTS_STREAM,
                DEADLINES,
                BACKLOG,
                tokens_key(record.request_id),
                RUNNING,
            ],
            args=[
                record.status.value,
                data,
                finished,
                TERMINAL_EVENT[record.status].value,
                self.live_state_ttl_s,
                record.request_id,
                ",".join(s.value for s in allowed),
                DISPATCH_GROUP,
                DONE_CHANNEL,
                json.dumps(output_event) if output_event else "",
                "" if attempt is None else attempt,
            ],
        )
        return data if applied else None

    async def cancel(self, request_id: str) -> State | None:
        """Cancel: a queued request ends now; a running one is asked to stop (the flag is
        in its hash, which its dispatcher checks; the pub/sub message is the fast path).
        Returns the state after the call, None if unknown."""
        state = await self._cancel(keys=[request_key(request_id)], args=[request_id, CANCEL_CHANNEL])
        if state == "missing":
            return None
        if state == State.QUEUED.value:
            job = await self.load(request_id)
            canceled = job.record(State.CANCELED) if job is not None and job.state == State.QUEUED else None
            if canceled is not None and await self.finish(canceled, allowed=(State.QUEUED,)) is not None:
                return State.CANCELED
            job = await self.load(request_id)  # it started meanwhile: its dispatcher sees the flag
            return job.state if job else None
        return State(state)

    async def running(self) -> dict[str, int]:
        """Requests running now, per tenant (all gateways)."""
        return {k: int(v) for k, v in (await self.redis.hgetall(RUNNING)).items()}

    async def backlog(self) -> dict[str, int]:
        return {k: int(v) for k, v in (await self.redis.hgetall(BACKLOG)).items()}
