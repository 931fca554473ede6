"""Requests as durable jobs in Redis.

Each request is a hash `req:<id>` (its state and payload), an entry in one of the
request lanes (streams read by the dispatchers' consumer group) and an event stream
`events:<id>`. Every state change is one Lua script, so it is atomic: a request is
accepted once, started by one dispatcher at a time, and finished exactly once (the
finish also publishes the result to the `results` stream and acknowledges the lane
entry, so a request whose run finished is never run again)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from gateway.contracts import (
    BACKLOG_KEY,
    CANCEL_CHANNEL,
    DEADLINES_KEY,
    DISPATCH_GROUP,
    DONE_CHANNEL,
    REQUEST_LANES,
    RESULTS_STREAM,
    TERMINAL_EVENT,
    ErrorInfo,
    EventKind,
    ResultRecord,
    State,
    Timings,
    WebhookSpec,
    events_key,
    idempotency_key,
    request_key,
    utc,
)
from gateway.streams import ensure_group

SUBMIT = """
if KEYS[6] ~= '' then
  local previous = redis.call('GET', KEYS[6])
  if previous then return {'existing', previous} end
end
local backlog = tonumber(redis.call('GET', KEYS[5]) or '0')
if backlog >= tonumber(ARGV[6]) then return {'full', tostring(backlog)} end
local entry = redis.call('XADD', KEYS[3], '*', 'id', ARGV[1])
redis.call('HSET', KEYS[1], 'state', 'queued', 'model', ARGV[2], 'payload', ARGV[3],
  'created_at', ARGV[4], 'deadline', ARGV[5], 'lane', KEYS[3], 'entry', entry, 'attempts', 0)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[7], '*', 'event', 'queued', 'data', ARGV[8])
redis.call('ZADD', KEYS[4], ARGV[5], ARGV[1])
redis.call('INCR', KEYS[5])
if KEYS[6] ~= '' then redis.call('SET', KEYS[6], ARGV[9], 'EX', ARGV[10]) end
return {'accepted', entry}
"""

START = """
local h = redis.call('HMGET', KEYS[1], 'state', 'cancel')
local state = h[1]
if not state then return {'missing', ''} end
if state ~= 'queued' and state ~= 'running' then return {'done', state} end
if state == 'queued' then redis.call('DECR', KEYS[3]) end
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], 'state', 'running', 'started_at', ARGV[2], 'owner', ARGV[1])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'event', 'running',
  'data', cjson.encode({attempt = attempts, restarted = (state == 'running')}))
return {'run', redis.call('HGETALL', KEYS[1])}
"""

FINISH = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 0 end
local allowed = false
for s in string.gmatch(ARGV[8], '[^,]+') do
  if s == state then allowed = true end
end
if not allowed then return 0 end
if state == 'queued' then redis.call('DECR', KEYS[5]) end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'record', ARGV[2], 'finished_at', ARGV[3])
if ARGV[11] ~= '' then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'event', 'output', 'data', ARGV[11])
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'event', ARGV[5], 'data', ARGV[2])
redis.call('XADD', KEYS[3], '*', 'id', ARGV[7], 'record', ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[7])
local lane = redis.call('HGET', KEYS[1], 'lane')
local entry = redis.call('HGET', KEYS[1], 'entry')
if lane and entry then redis.call('XACK', lane, ARGV[9], entry) end
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[6])
-- The message carries the record, so a waiting client needs no further read.
redis.call('PUBLISH', ARGV[10], ARGV[7] .. '\\n' .. ARGV[2])
return 1
"""


@dataclass(frozen=True)
class Submitted:
    outcome: str  # "accepted", "existing" (idempotent replay) or "full" (backlog)
    request_id: str | None = None
    body_hash: str | None = None
    backlog: int = 0


@dataclass
class Job:
    """A request as the dispatcher and the API see it, read from its hash."""

    request_id: str
    model: str
    state: State
    payload: dict[str, Any]
    created_at: float
    deadline: float
    started_at: float | None
    attempts: int
    cancel_requested: bool
    record_json: str | None
    stored: bool  # the binder has written the result to MongoDB

    @classmethod
    def from_hash(cls, request_id: str, h: dict[str, str]) -> Job:
        return cls(
            request_id=request_id,
            model=h.get("model", ""),
            state=State(h["state"]),
            payload=json.loads(h.get("payload") or "{}"),
            created_at=float(h.get("created_at", 0)),
            deadline=float(h.get("deadline", 0)),
            started_at=float(h["started_at"]) if h.get("started_at") else None,
            attempts=int(h.get("attempts", 0)),
            cancel_requested=h.get("cancel") == "1",
            record_json=h.get("record"),
            stored=h.get("stored") == "1",
        )

    def record(
        self,
        status: State,
        *,
        outputs: dict[str, Any] | None = None,
        error: ErrorInfo | None = None,
        replica: str | None = None,
        ttft_s: float | None = None,
        finished_at: float | None = None,
    ) -> ResultRecord:
        finished = time.time() if finished_at is None else finished_at
        started = self.started_at
        webhook = self.payload.get("webhook")
        return ResultRecord(
            request_id=self.request_id,
            model=self.model,
            status=status,
            inputs=self.payload.get("inputs_stored", {}),
            parameters=self.payload.get("parameters", {}),
            outputs=outputs,
            error=error,
            replica=replica,
            attempts=self.attempts,
            created_at=utc(self.created_at),
            started_at=utc(started),
            finished_at=utc(finished),
            timings=Timings(
                queue_ms=round((started - self.created_at) * 1000, 3) if started else None,
                run_ms=round((finished - started) * 1000, 3) if started else None,
                ttft_ms=round(ttft_s * 1000, 3) if ttft_s is not None else None,
                total_ms=round((finished - self.created_at) * 1000, 3),
            ),
            webhook=WebhookSpec.model_validate(webhook) if webhook else None,
        )


class JobStore:
    def __init__(self, redis: Redis, *, events_maxlen: int, live_state_ttl_s: int, idempotency_ttl_s: int) -> None:
        self.redis = redis
        self.events_maxlen = events_maxlen
        self.live_state_ttl_s = live_state_ttl_s
        self.idempotency_ttl_s = idempotency_ttl_s
        self._submit = redis.register_script(SUBMIT)
        self._start = redis.register_script(START)
        self._finish = redis.register_script(FINISH)

    async def ensure_groups(self) -> None:
        for lane in REQUEST_LANES:
            await ensure_group(self.redis, lane, DISPATCH_GROUP)

    async def submit(
        self,
        *,
        request_id: str,
        model: str,
        payload: dict[str, Any],
        created_at: float,
        deadline: float,
        lane: str,
        max_backlog: int,
        idempotency: tuple[str, str] | None = None,
    ) -> Submitted:
        """idempotency is (key, body hash): the same key returns the first request's id."""
        idem_key = idempotency_key(idempotency[0]) if idempotency else ""
        idem_value = json.dumps({"id": request_id, "hash": idempotency[1]}) if idempotency else ""
        queued = json.dumps({"request_id": request_id, "model": model, "created_at": created_at})
        outcome, value = await self._submit(
            keys=[request_key(request_id), events_key(request_id), lane, DEADLINES_KEY, BACKLOG_KEY, idem_key],
            args=[
                request_id, model, json.dumps(payload), created_at, deadline, max_backlog,
                self.events_maxlen, queued, idem_value, self.idempotency_ttl_s,
            ],
        )
        if outcome == "existing":
            previous = json.loads(value)
            return Submitted("existing", previous["id"], previous["hash"])
        if outcome == "full":
            return Submitted("full", backlog=int(value))
        return Submitted("accepted", request_id)

    async def load(self, request_id: str) -> Job | None:
        h = await self.redis.hgetall(request_key(request_id))
        return Job.from_hash(request_id, h) if h else None

    async def start(self, request_id: str, consumer: str) -> Job | None:
        """Mark the request running (again, if a dead dispatcher had it). None when there
        is nothing to run: unknown, or already finished."""
        action, fields = await self._start(
            keys=[request_key(request_id), events_key(request_id), BACKLOG_KEY],
            args=[consumer, time.time(), self.events_maxlen],
        )
        if action != "run":
            return None
        return Job.from_hash(request_id, dict(zip(fields[::2], fields[1::2])))

    async def publish(self, request_id: str, kind: EventKind, data: dict[str, Any]) -> None:
        await self.redis.xadd(
            events_key(request_id),
            {"event": kind.value, "data": json.dumps(data)},
            maxlen=self.events_maxlen,
            approximate=True,
        )

    async def finish(
        self,
        record: ResultRecord,
        *,
        allowed: tuple[State, ...] = (State.RUNNING,),
        output_event: dict[str, Any] | None = None,
    ) -> str | None:
        """Record the terminal state once; returns the record's JSON, or None if the
        request was not in an allowed state (someone else finished it first).
        output_event, if given, is published as an `output` event before the terminal one."""
        data = record.model_dump_json()
        finished = record.finished_at.timestamp() if record.finished_at else time.time()
        applied = await self._finish(
            keys=[
                request_key(record.request_id), events_key(record.request_id), RESULTS_STREAM,
                DEADLINES_KEY, BACKLOG_KEY,
            ],
            args=[
                record.status.value, data, finished, self.events_maxlen, TERMINAL_EVENT[record.status].value,
                self.live_state_ttl_s, record.request_id, ",".join(s.value for s in allowed),
                DISPATCH_GROUP, DONE_CHANNEL, json.dumps(output_event) if output_event else "",
            ],
        )
        return data if applied else None

    async def cancel(self, request_id: str) -> State | None:
        """Cancel: a queued request ends now; a running one is asked to stop (its
        dispatcher hears it on the cancel channel). Returns the state after the call."""
        job = await self.load(request_id)
        if job is not None and job.state == State.QUEUED:
            if await self.finish(job.record(State.CANCELED), allowed=(State.QUEUED,)) is not None:
                return State.CANCELED
            job = await self.load(request_id)  # it started meanwhile
        if job is not None and job.state == State.RUNNING:
            await self.redis.hset(request_key(request_id), "cancel", "1")
            await self.redis.publish(CANCEL_CHANNEL, request_id)
        return job.state if job else None

    async def backlog(self) -> int:
        return int(await self.redis.get(BACKLOG_KEY) or 0)
