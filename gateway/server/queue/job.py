"""A request as the queue holds it: what admits it (Admission), what is submitted
(NewRequest, its payload as stored), what SUBMIT, EMIT and QUEUE answer, and the Job a
dispatcher runs, with the record it ends with (JobStore, jobs.py, moves them through the
scripts)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from typing import Any

from gateway.protocol import (
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
from gateway.protocol.redis_keys import Shard, shard_of


@dataclass(frozen=True)
class Admission:
    """The limits one submission is admitted under (SUBMIT's `admit`): by requests and by
    bytes, the same shape each, side by side."""

    max_backlog: int  # interactive requests waiting in the shard
    max_batch_backlog: int  # batch-band requests waiting in the shard
    max_bytes: int  # payload bytes waiting in the shard
    tenant_max_queued: int = 0  # this tenant's own cap in its band class, always (0: none)
    tenant_share: int = 0  # its share of the class's backlog: binds only while other tenants wait (0: none)
    reserve: int = 0  # below this many waiting, the tenant is admitted even when the backlog is full
    tenant_bytes_share: int = 0  # its share of the waiting bytes, while other tenants wait (0: none)
    bytes_reserve: int = 0  # below this many bytes waiting, admitted even when the bytes are full
    weight: float = 1.0
    max_concurrent: int = 0

    def script_arg(self) -> dict[str, Any]:
        """As SUBMIT reads it; `settings`: the tenant's weight and concurrency limit as TAKE
        reads them from the shard's tenants hash."""
        return {
            "max_backlog": self.max_backlog,
            "max_batch_backlog": self.max_batch_backlog,
            "max_bytes": self.max_bytes,
            "tenant_max_queued": self.tenant_max_queued,
            "tenant_share": self.tenant_share,
            "reserve": self.reserve,
            "tenant_bytes_share": self.tenant_bytes_share,
            "bytes_reserve": self.bytes_reserve,
            "max_concurrent": self.max_concurrent,
            "settings": f"{float(self.weight)!r} {self.max_concurrent}",
        }


def inputs_delta(inputs: dict[str, Any], stored: dict[str, Any]) -> dict[str, Any] | None:
    """What a request's record keeps of its inputs (the model's `stored_inputs`), as a
    change to them, so that the payload holds a prompt once: None when the record keeps the
    inputs as they are, else the members it sets and those it drops (an image's bytes)."""
    changed = {name: value for name, value in stored.items() if name not in inputs or inputs[name] != value}
    dropped = [name for name in inputs if name not in stored]
    return {"set": changed, "drop": dropped} if changed or dropped else None


def stored_inputs(payload: dict[str, Any]) -> dict[str, Any]:
    """The inputs a request's record keeps (inputs_delta, undone)."""
    if "inputs_stored" in payload:  # a payload submitted before stored_delta: whole
        return payload["inputs_stored"]
    inputs, delta = payload.get("inputs") or {}, payload.get("stored_delta")
    if not delta:
        return inputs
    return {name: value for name, value in inputs.items() if name not in delta["drop"]} | delta["set"]


def stored_payload(payload: dict[str, Any]) -> str:
    """A request's payload as SUBMIT stores it and counts its bytes: compact JSON, its text
    not escaped (a CJK character counts its 3 UTF-8 bytes, not a 6-byte escape)."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False)


# The members of a payload a status read answers with (NewRequest.meta).
META_MEMBERS = ("metadata", "prompt_tokens")
# The fields of a request's hash a status read takes (JobStore.status, scripts.READ): every
# field but the payload (the run's owner and lease are the dispatchers' business).
STATUS_FIELDS = (
    "state",
    "model",
    "tenant",
    "band",
    "created_at",
    "deadline",
    "started_at",
    "attempts",
    "emitted",
    "cancel",
    "stored",
    "replica",
    "run",
    "handovers",
    "result",
    "meta",
)


@dataclass(frozen=True)
class NewRequest:
    request_id: str
    payload: dict[str, Any]
    created_at: float
    deadline: float
    idempotency: tuple[str, str] | None = None  # (key, body hash)

    @cached_property
    def stored(self) -> bytes:
        """The payload as SUBMIT stores it and counts its bytes (made once)."""
        return stored_payload(self.payload).encode()

    @cached_property
    def meta(self) -> str:
        """What a status read answers from the payload (its labels, the prompt's tokens as
        counted at submission), stored beside it (the hash's `meta`): a read of a request's
        standing takes this and never the payload, which can be megabytes."""
        return stored_payload({name: self.payload[name] for name in META_MEMBERS if name in self.payload})


@dataclass(frozen=True)
class Submitted:
    outcome: str  # "accepted", "started" (accepted and begun here), "existing" (idempotent replay) or "full"
    # existing: per request, the (id, body hash) of the earlier submission with its key
    existing: list[tuple[str, str]] = field(default_factory=list)
    reason: str = ""  # full: backlog, batch, bytes or tenant
    count: int = 0
    run: str = ""  # started: the run's token (its fence)


@dataclass(frozen=True)
class QueueStanding:
    """What the QUEUE script tells of a queued request (see scripts.QUEUE)."""

    tenant_position: int  # requests of its tenant before it, same model and band
    tenants: int  # tenants ready in its band
    rank: int  # of them, how many go before its tenant in this round
    first: int  # tenants ready in higher bands, and reclaimed requests: they all go first
    started: int  # requests of its model started from the queue in its shard so far (for the rate)

    @property
    def position(self) -> int:
        """Requests that start before it, as the fair queue goes now: in each round every
        ready tenant starts one, so the requests of its own tenant before it cost a round
        each (an estimate: tenants that run out of work leave the rounds sooner)."""
        return self.first + self.tenant_position * max(1, self.tenants) + self.rank


def _standing(reply: list[Any] | None) -> QueueStanding | None:
    """A QueueStanding from the scripts' reply (see scripts/reads.py _STANDING); None: not queued."""
    if not reply:
        return None
    mine, tenants, rank, first, started = (int(value) for value in reply)
    return QueueStanding(mine, tenants, rank, first, started)


@dataclass(frozen=True)
class TokenEvent:
    """Pieces [index, index + count) of a request's run (its token), as one token event."""

    request_id: str
    run: str
    index: int
    text: str
    count: int
    ids: list[int]


@dataclass(frozen=True)
class Emitted:
    outcome: str  # ok, cancel, stale, gap
    event_id: str  # the token event's stream id ('' when nothing was added)
    emitted: int  # pieces in the stream after the call


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
    band: str = "normal"
    replica: str | None = None
    # Token ids already emitted by earlier runs (engine path), to resume from.
    emitted_ids: list[int] = field(default_factory=list)
    run: str = ""  # the current run's token (its fence); '' while it has not run
    handovers: int = 0  # runs handed on by a draining gateway (no failed delivery)
    # False for a job read for its status (from_status): its payload holds META_MEMBERS only.
    whole: bool = True

    @property
    def deliveries(self) -> int:
        """Starts that count against the delivery limit: attempts less hand-overs."""
        return self.attempts - self.handovers

    @classmethod
    def started_at_once(cls, new: NewRequest, *, model: str, tenant: str, band: str, run: str) -> Job:
        """The job of a request SUBMIT started at once (its first attempt, running now
        under `run`), as SUBMIT wrote it: no read needed."""
        return cls(
            request_id=new.request_id,
            model=model,
            tenant=tenant,
            state=State.RUNNING,
            payload=new.payload,
            created_at=new.created_at,
            deadline=new.deadline,
            started_at=time.time(),
            attempts=1,
            emitted=0,
            cancel_requested=False,
            stored=False,
            band=band,
            run=run,
        )

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
            band=h.get("band", "normal"),
            replica=h.get("replica"),
            emitted_ids=[int(t) for t in tokens.split(",") if t],
            run=h.get("run", ""),
            handovers=int(h.get("handovers", 0)),
        )

    @classmethod
    def from_status(cls, request_id: str, values: list[str | None]) -> Job | None:
        """A job read for its status: the STATUS_FIELDS of its hash, in that order (None
        when it has none); its payload is what `meta` holds (a hash written before `meta`
        existed has its whole payload read in its place: scripts.READ)."""
        h = {name: value for name, value in zip(STATUS_FIELDS, values, strict=True) if value is not None}
        if "state" not in h:
            return None
        job = cls.from_hash(request_id, {**h, "payload": h.get("meta") or "{}"})
        job.whole = False
        return job

    @property
    def shard(self) -> Shard:
        return shard_of(self.request_id)

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
        if not self.whole:  # a status read's job lacks the inputs a record keeps
            raise ValueError(f"the job of {self.request_id} was read without its payload")
        finished = time.time() if finished_at is None else finished_at
        started = self.started_at
        webhook = self.payload.get("webhook")
        return ResultRecord(
            request_id=self.request_id,
            model=self.model,
            tenant=self.tenant,
            status=status,
            inputs=stored_inputs(self.payload),
            parameters=self.payload.get("parameters", {}),
            outputs=outputs,
            error=error,
            replica=replica,
            route=route,
            usage=usage if usage is not None else self.queued_usage(status),
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
            traceparent=self.payload.get("traceparent"),
        )

    def queued_usage(self, status: State) -> Usage | None:
        """A request that ended without running (cancelled or expired while queued)
        still reports the prompt it was admitted with: no tokens were generated."""
        prompt = self.payload.get("prompt_tokens")
        if prompt is None or status == State.SUCCEEDED:
            return None
        return Usage(prompt_tokens=int(prompt), completion_tokens=0)
