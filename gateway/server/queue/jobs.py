"""JobStore: the request lifecycle on top of the scripts (queue/scripts/).

submit -> (its tenant's queue) -> take [attempt n, run token] -> emit* -> finish, with
cancel and expiry from outside, leases renewed while a run lives (dispatch/leases.py), and
reclaim / hand-over putting a running request back at the front of the line. A run holds
its run token (its fence, random: see scripts/__init__.py) from start to finish; its attempt
number is for display, resuming and the delivery limit (which leaves hand-overs out).

Durability across a failover (REDIS_WAIT_REPLICAS): SUBMIT and FINISH (whose record
feeds the binders) are followed by WAIT on the same connection. A submission that fewer
replicas confirmed in time is refused (NotReplicated, 503 `not_replicated`): it reached
the primary only, and a failover now would lose it. Its request stays where it is (and
runs, if the primary lives on): resent with the same Idempotency-Key it is found again,
not queued twice. A finish that was not confirmed is logged: nothing waits on its answer
(a failover that loses it leaves the run to be reclaimed and finished again, and the
binder stores a request once). A SUBMIT or FINISH replayed on a new connection (the
client retries after a lost reply) that finds its own earlier write makes a write all the
same, so the WAIT after it covers the write it found (scripts/__init__.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError

from gateway.common.redis import REDIS_OUTAGE, GroupCommit, NotReplicated, RedisClients
from gateway.protocol import (
    TERMINAL_EVENT,
    ResultRecord,
    State,
)
from gateway.protocol.redis_keys import CANCEL_CHANNEL, DONE_CHANNEL, Shard, all_shards, shard_for_tenant, shard_of
from gateway.server.queue import scripts
from gateway.server.queue.job import (
    STATUS_FIELDS,
    Admission,
    Emitted,
    Job,
    NewRequest,
    QueueStanding,
    Submitted,
    TokenEvent,
    _standing,
    inputs_delta,
    stored_inputs,
    stored_payload,
)

log = logging.getLogger(__name__)

__all__ = [
    "TAKE_TOKEN_TTL_S",
    "Admission",
    "Emitted",
    "Job",
    "JobStore",
    "NewRequest",
    "QueueStanding",
    "Submitted",
    "TokenEvent",
    "inputs_delta",
    "stored_inputs",
    "stored_payload",
]

# Payloads TAKE hands over at once that are parsed in a worker thread rather than on the loop.
LONG_PAYLOADS_BYTES = 256 * 1024
# The `running` event of a request started by SUBMIT itself (its first attempt).
RUNNING_FIRST = json.dumps({"attempt": 1, "restarted": False, "resume_from": 0})
# How long a dispatcher's last TAKE is remembered (a replay after a lost reply).
TAKE_TOKEN_TTL_S = 60
# Finishes no replica confirmed are logged at most this often.
UNREPLICATED_LOG_EVERY_S = 10.0


# A script a promoted node does not know is loaded there this many times at most, the
# slot map read again before each (a failover may still be settling).
SCRIPT_RELOADS = 5


class _Script(AsyncScript):
    """A Lua script that survives a failover: a node that does not know it (a replica just
    promoted, or a node restarted, whose script cache is empty) gets it loaded. On a
    cluster the slot map is read again and the script loaded on the node that owns the
    call's slot now, not through the map the failed call used (a map from before the
    failover names the old primaries, and a load sent through it fails on the dead one).
    On one Redis with a group commit, its calls share pipelines with the other script
    calls of their turn of the event loop (and a script made for many items has the calls
    of its turn merged into one)."""

    group: GroupCommit | None = None

    def __init__(self, client: Redis, script: str, *, head: tuple[int, int] | None = None, most: int = 1) -> None:
        """head, most: a script made for many items (SUBMIT, FINISH): the numbers of keys and
        arguments they share, and how many one call may carry (the group commit merges the
        calls ready together: gateway/common/redis.py)."""
        super().__init__(client, script)
        self.head = head
        self.most = most

    async def __call__(self, keys: Any = None, args: Any = None, client: Any = None) -> Any:
        if self.group is not None and client is None:
            return await self.group.call(self, keys or [], args or [])
        try:
            return await super().__call__(keys=keys, args=args, client=client)
        except NoScriptError:
            target = client if client is not None else self.registered_client
            manager = getattr(target, "nodes_manager", None)
            if manager is None or not keys:
                raise
        for attempt in range(SCRIPT_RELOADS):
            try:
                await manager.initialize()  # the cluster's current primaries
                node = target.get_node_from_key(keys[0])
                await target.execute_command("SCRIPT LOAD", self.script, target_nodes=node)
                return await super().__call__(keys=keys, args=args, client=client)
            except (NoScriptError, *REDIS_OUTAGE):
                if attempt == SCRIPT_RELOADS - 1:
                    raise
                await asyncio.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")


class JobStore:
    def __init__(
        self,
        redis: Redis,
        *,
        shards: int = 1,
        idempotency_ttl_s: int,
        lease_ms: int = 15_000,
        replication: RedisClients | None = None,
    ) -> None:
        """replication: the clients whose wait_replicas (if any) SUBMIT and FINISH wait for."""
        self.redis = redis
        self.replication = replication
        self.shards = all_shards(shards)
        self.idempotency_ttl_s = idempotency_ttl_s
        self.lease_ms = lease_ms
        # Called with every record this process ends (run, cancel while queued, expiry):
        # each request is counted once, by the process that ended it.
        self.on_ended: list[Callable[[ResultRecord], None]] = []
        self._submit = _Script(redis, scripts.SUBMIT, head=scripts.SUBMIT_HEAD, most=scripts.SUBMIT_MOST)
        self._take = _Script(redis, scripts.TAKE)
        self._emit = _Script(redis, scripts.EMIT)
        self._renew = _Script(redis, scripts.RENEW)
        self._reclaim = _Script(redis, scripts.RECLAIM)
        self._handover = _Script(redis, scripts.HANDOVER)
        self._finish = _Script(redis, scripts.FINISH, head=scripts.FINISH_HEAD, most=scripts.FINISH_MOST)
        self._cancel = _Script(redis, scripts.CANCEL)
        self._follow = _Script(redis, scripts.FOLLOW)
        self._read = _Script(redis, scripts.READ)
        self._queue = _Script(redis, scripts.QUEUE)
        group = replication.group if replication is not None and replication.main is redis else None
        for script in vars(self).values():
            if isinstance(script, _Script):
                script.group = group
        self.unreplicated_finishes = 0  # finishes no replica confirmed in time
        self._unreplicated_logged_at = 0.0

    async def _replicated(self, script: AsyncScript, keys: list[str], args: list[Any]) -> tuple[Any, int]:
        """The script's reply and how many replicas it still lacks (0: none asked or all there)."""
        if self.replication is None or not self.replication.wait_replicas:
            return await script(keys=keys, args=args), 0
        reply, acked = await self.replication.replicated(script, keys, args)
        return reply, max(0, self.replication.wait_replicas - (acked or 0))

    def shard_for(self, tenant: str) -> Shard:
        return self.shards[shard_for_tenant(tenant, len(self.shards))]

    async def idempotent(self, tenant: str, key: str) -> tuple[str, str] | None:
        """(request id, body hash) of an earlier submission with this key, if any."""
        found = await self.redis.get(self.shard_for(tenant).idempotency(tenant, key))
        if not found:
            return None
        previous = json.loads(found)
        return previous["id"], previous["hash"]

    async def submit(
        self,
        requests: list[NewRequest],
        *,
        model: str,
        tenant: str,
        band: str,
        admission: Admission,
        start_as: str = "",
        light_only: bool = False,
    ) -> Submitted:
        """Queue requests of one tenant and model, all or none. With one request and
        start_as (this process's consumer), it starts at once if nothing of its model waits
        in its shard (outcome "started", with the run's token)."""
        shard = shard_of(requests[0].request_id)
        run = secrets.token_hex(8) if start_as and len(requests) == 1 else ""
        submission = scripts.Submission(
            model=model,
            tenant=tenant,
            band=band,
            now=time.time(),
            idempotency_ttl_s=self.idempotency_ttl_s,
            admission=admission,
            lease_ms=self.lease_ms,
            running=RUNNING_FIRST,
            requests=tuple(requests),
            consumer=start_as if len(requests) == 1 else "",
            run=run,
            light_only=light_only,
        )
        call = scripts.Submit(shard, (submission,))
        # SUBMIT answers per submission: this call's one
        (reply,), missing = await self._replicated(self._submit, call.keys(), call.args())
        outcome = reply[0]
        if missing and outcome in ("accepted", "started"):
            await self._not_replicated(requests, (start_as, run) if outcome == "started" else None, missing)
        if outcome == "existing":
            found = [json.loads(value) for value in reply[1:]]
            return Submitted("existing", existing=[(f["id"], f["hash"]) for f in found])
        if outcome == "full":
            return Submitted("full", reason=reply[1], count=int(reply[2] or 0))
        return Submitted(outcome, run=run if outcome == "started" else "")

    async def _not_replicated(
        self, requests: list[NewRequest], started_for: tuple[str, str] | None, missing: int
    ) -> None:
        """Refuse a submission that too few replicas confirmed; one SUBMIT started for this
        process (consumer, run token) goes to the front of the line for any dispatcher
        (nobody here will run it)."""
        ids = [new.request_id for new in requests]
        if started_for is not None:
            consumer, run = started_for
            try:
                await self.handover(consumer, [(ids[0], run)])
            except Exception as exc:  # its lease runs out instead
                log.warning("handing on unreplicated %s failed: %s", ids[0], exc)
        assert self.replication is not None
        wanted, timeout_ms = self.replication.wait_replicas, self.replication.wait_timeout_ms
        raise NotReplicated(wanted - missing, wanted, timeout_ms, ids)

    async def take(self, shard: Shard, model: str, consumer: str, *, light_only: bool = False) -> Job | str:
        """Start the next request of `model` in the shard for this consumer: the Job (its
        `run` the new run's token), or "empty" (nothing waits) or "held" (only tenants
        outside the headroom wait)."""
        taken = await self.take_many(shard, model, consumer, light_only=light_only)
        return taken if isinstance(taken, str) else taken[0]

    async def take_many(
        self, shard: Shard, model: str, consumer: str, *, most: int = 1, light_only: bool = False
    ) -> list[Job] | str:
        """Start up to `most` requests of `model` in the shard for this consumer, in the
        fair order, in one call: their Jobs (at least one), or "empty" or "held" (take)."""
        call = scripts.Take(
            shard,
            model,
            consumer,
            now=time.time(),
            lease_ms=self.lease_ms,
            token=secrets.token_hex(8),
            token_ttl_s=TAKE_TOKEN_TTL_S,
            most=most,
            light_only=light_only,
        )
        reply = await self._take(keys=call.keys(), args=call.args())
        if reply[0] != "run":
            return str(reply[0])
        runs = reply[1:]

        def jobs() -> list[Job]:
            return [
                Job.from_hash(str(rid), dict(zip(fields[::2], fields[1::2], strict=True)), ids)
                for rid, fields, ids in zip(runs[::3], runs[1::3], runs[2::3], strict=True)
            ]

        # Up to `most` payloads of up to a body's size each: parsed in a worker thread when
        # large, so the loop waits at most for one payload's parse (the thread lets go of
        # the interpreter's lock between them), not for all of them.
        if sum(len(value) for fields in runs[1::3] for value in fields) > LONG_PAYLOADS_BYTES:
            return await asyncio.to_thread(jobs)
        return jobs()

    async def load(self, request_id: str) -> Job | None:
        h = await self.redis.hgetall(shard_of(request_id).request(request_id))
        return Job.from_hash(request_id, h) if h else None

    async def load_many(self, request_ids: list[str]) -> list[Job | Exception | None]:
        """The jobs of these requests in one round trip (a pipeline of HGETALLs), parsed in a
        worker thread when large (as take_many does); a hash that does not parse is its
        error, in its place (one broken request does not hide the others)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.hgetall(shard_of(request_id).request(request_id))
            found = await pipe.execute()

        def parsed(request_id: str, h: dict[str, str]) -> Job | Exception | None:
            try:
                return Job.from_hash(request_id, h) if h else None
            except Exception as exc:
                return exc

        def jobs() -> list[Job | Exception | None]:
            return [parsed(rid, h) for rid, h in zip(request_ids, found, strict=True)]

        if sum(len(value) for h in found for value in h.values()) > LONG_PAYLOADS_BYTES:
            return await asyncio.to_thread(jobs)
        return jobs()

    async def status(self, request_id: str) -> Job | None:
        """The job as a status read needs it: its STATUS_FIELDS, never its payload (which
        can be megabytes; the job's payload holds its `meta` only: Job.from_status)."""
        key = shard_of(request_id).request(request_id)
        values = await self.redis.hmget(key, STATUS_FIELDS)
        if values[0] is not None and values[-1] is None:  # a hash from before `meta`
            values[-1] = await self.redis.hget(key, "payload")
        return Job.from_status(request_id, values)

    async def read(self, request_id: str) -> tuple[Job | None, str | None, QueueStanding | None]:
        """The job (as status() reads it) with what goes with its state, read at one
        instant (one script): if it has ended, its record (JSON) while the results stream
        still holds it (until the binders stored it); if it is queued, where it stands. A
        job read as queued always has its standing: two reads would leave a window in which
        a dispatcher takes it between them (queued, but no longer in any queue)."""
        call = scripts.Read(shard_of(request_id), request_id)
        values, record, standing = await self._read(keys=call.keys(), args=call.args())
        job = Job.from_status(request_id, values) if values else None
        if job is None:
            return None, None, None
        return job, record or None, _standing(standing)

    async def load_with_end(self, request_id: str) -> tuple[Job | None, str | None]:
        """The job and, if it has ended, its record (JSON) while the results stream still
        holds it (until the binders stored it), in one round trip."""
        job, record, _ = await self.read(request_id)
        return job, record

    async def final_record(self, request_id: str) -> str | None:
        """The record of an ended request while the results stream still holds it."""
        job, record = await self.load_with_end(request_id)
        return record if job is not None and job.state.terminal else None

    async def queue_position(self, request_id: str) -> QueueStanding | None:
        """Where a queued request stands (None when it is not queued)."""
        call = scripts.Read(shard_of(request_id), request_id)
        return _standing(await self._queue(keys=call.keys(), args=call.args()))

    async def record_at(self, shard: Shard, entry: str) -> str | None:
        """The record at an entry of the shard's results stream (gone once stored and trimmed)."""
        found = await self.redis.xrange(shard.results, entry, entry)
        return found[0][1].get("record") if found else None

    async def emit(self, request_id: str, run: str, index: int, text: str, count: int, ids: list[int]) -> Emitted:
        """Publish pieces [index, index + count) of the run with token `run` as one token event."""
        event = TokenEvent(request_id, run, index, text, count, ids)
        (emitted,) = await self.emit_many(shard_of(request_id), [event])
        return emitted

    async def emit_many(self, shard: Shard, events: list[TokenEvent]) -> list[Emitted]:
        """Token events of several runs of one shard, in one call."""
        call = scripts.Emit(shard, tuple(events))
        reply = await self._emit(keys=call.keys(), args=call.args())
        return [
            Emitted(str(reply[i]), str(reply[i + 1] or ""), int(reply[i + 2] or 0)) for i in range(0, len(reply), 3)
        ]

    async def follow(self, request_id: str, notice: bool = False) -> bool:
        """Have the scripts that write the request's events name it in its shard's notices
        (an event hub follows it), and with notice, name it there now (a new follower);
        False when the request is not there."""
        call = scripts.Follow(shard_of(request_id), request_id, notice)
        return bool(await self._follow(keys=call.keys(), args=call.args()))

    async def renew(self, shard: Shard, consumer: str, runs: list[tuple[str, str]]) -> list[int]:
        """Renew the leases of (request id, run token) runs in a shard: per run 1 still
        ours, 2 asked to cancel, 0 stale. (The dispatcher renews from a thread of its own:
        dispatch/leases.py, with the same arguments.)"""
        if not runs:
            return []
        call = scripts.Renew(shard, consumer, self.lease_ms, tuple(runs))
        return [int(flag) for flag in await self._renew(keys=call.keys(), args=call.args())]

    async def reclaim(self, shard: Shard, limit: int = 200) -> int:
        """Put running requests whose lease ran out back at the front of the line."""
        call = scripts.Reclaim(shard, limit)
        return int(await self._reclaim(keys=call.keys(), args=call.args()))

    async def handover(self, consumer: str, runs: list[tuple[str, str]]) -> int:
        """Hand this consumer's running requests, (request id, run token), on to other
        dispatchers at once; a hand-over does not count against the delivery limit."""
        by_shard: dict[Shard, list[tuple[str, str]]] = {}
        for request_id, run in runs:
            by_shard.setdefault(shard_of(request_id), []).append((request_id, run))
        moved = 0
        for shard, shard_runs in by_shard.items():
            call = scripts.Handover(shard, consumer, tuple(shard_runs))
            moved += int(await self._handover(keys=call.keys(), args=call.args()))
        return moved

    async def finish(
        self,
        record: ResultRecord,
        *,
        allowed: tuple[State, ...] = (State.RUNNING,),
        run: str | None = None,
        output_event: bool = False,
        emitted: int | None = None,
    ) -> str | int | None:
        """Record the terminal state once; returns the record's JSON, None if the request
        was not in an allowed state (or `run`, a run token, is no longer the current run), or the
        number of pieces its stream holds when that is fewer than `emitted` (a gap: the
        caller sends the missing pieces, then finishes again)."""
        data = record.model_dump_json()
        shard = shard_of(record.request_id)
        item = scripts.FinishItem(
            request_id=record.request_id,
            model=record.model,
            tenant=record.tenant,
            status=record.status.value,
            terminal=TERMINAL_EVENT[record.status].value,
            record=data,
            finished_at=record.finished_at.timestamp() if record.finished_at else time.time(),
            allowed=tuple(s.value for s in allowed),
            output_event=output_event,
            run=run,
            emitted=emitted,
        )
        call = scripts.Finish(shard, DONE_CHANNEL, (item,))
        reply, missing = await self._replicated(self._finish, call.keys(), call.args())
        (outcome,) = reply  # FINISH answers per request: this call's one
        if outcome[0] == "error":
            raise ResponseError(str(outcome[1]))
        if outcome[0] == "gap":
            return int(outcome[1])
        if int(outcome[0]) != 1:
            return None
        if missing:
            self._finish_not_replicated(record.request_id)
        for hook in self.on_ended:
            hook(record)
        return data

    def _finish_not_replicated(self, request_id: str) -> None:
        self.unreplicated_finishes += 1
        if time.monotonic() - self._unreplicated_logged_at >= UNREPLICATED_LOG_EVERY_S:
            self._unreplicated_logged_at = time.monotonic()
            log.warning(
                "the finish of %s reached its primary but no replica confirmed it in time "
                "(%d such finishes so far); a failover now could lose it",
                request_id,
                self.unreplicated_finishes,
            )

    async def cancel(self, request_id: str) -> str:
        """CANCEL: the cancel flag set in the request's hash (its dispatcher checks it; the
        pub/sub message is the fast path); the state the script found it in, "missing" for an
        unknown request. A queued one is ended by the spine (spine.cancel)."""
        call = scripts.Cancel(shard_of(request_id), request_id, CANCEL_CHANNEL)
        return str(await self._cancel(keys=call.keys(), args=call.args()))

    async def overdue(self, shard: Shard, now: float, most: int) -> list[str]:
        """The shard's requests whose deadline passed by `now`, at most `most`, soonest first."""
        return list(await self.redis.zrangebyscore(shard.deadlines, "-inf", now, start=0, num=most))

    async def forget_deadlines(self, shard: Shard, request_ids: list[str]) -> None:
        """Drop from the shard's deadlines those of requests that ended (FINISH leaves them)."""
        if request_ids:
            await self.redis.zrem(shard.deadlines, *request_ids)

    async def waiting(self, shard: Shard, models: list[str]) -> tuple[int, list[str]]:
        """(requests queued in the shard, the models with work waiting there): queued ones by
        the backlog's per-model counters; a run to start again (a reclaimed list holds one,
        rare) makes every model's. One pipeline: the shard's keys share its hash tag."""
        if not models:
            return 0, []
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(shard.backlog)
            pipe.exists(*(shard.reclaimed(model) for model in models))
            counters, reclaimed = await pipe.execute()
        queued = int(counters.get("all", 0)) + int(counters.get("batch", 0))
        if reclaimed:
            return queued, models
        return queued, [model for model in models if int(counters.get(f"m:{model}", 0)) > 0]
