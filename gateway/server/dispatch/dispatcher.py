"""The dispatcher: what each gateway process owns of the runs it holds: its replica slots,
a task per run, their leases' renewal, and the loops that decide when to start work. Every
change of a request's state is a stage of gateway.server.spine (a request's life is read
there): the dispatcher asks spine.start to TAKE and hold requests, its task of each calls
spine.carry (run -> finish -> deliver), and spine.hand_over on shutdown.

- Asks for a model's work only while its replicas have a free slot, keeping the headroom
  for light tenants (scheduler.Headroom); asks the shards where work was announced
  (pub/sub `work`), and, every POLL_S in case a message was lost, those where work waits
  by each shard's backlog counters and reclaimed lists (one read a shard: cheap when
  idle; it sets the backlog gauge too).
- Every run holds its run token (its fence; the attempt number is for display and the
  delivery limit, which leaves hand-overs out). The lease keeper (leases.py) renews the
  leases from a thread of its own, so a busy event loop cannot let them lapse, and checks
  the fence and the cancel flag. A run that finds itself stale stops without finishing; a
  cancel is a flag in Redis, pub/sub only makes it fast. A lease not renewed (the process
  died) runs out, and the request is started again elsewhere, first in line.
- Deadlines: a run is stopped and ends `expired` when its deadline passes.
- On shutdown: no new work is taken; running requests get drain_s to finish while their
  leases are still renewed; those still running then are handed on at once (HANDOVER),
  so another gateway resumes them without waiting for a lease to run out."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.common.redis import REDIS_OUTAGE, RedisClients
from gateway.common.retry import LoopHealth, cancel_and_wait, supervise
from gateway.protocol import ResultRecord
from gateway.protocol.redis_keys import CANCEL_CHANNEL, WORK_CHANNEL, Shard
from gateway.server import spine
from gateway.server.dispatch.leases import LeaseKeeper
from gateway.server.dispatch.runner import RunControl, Runner
from gateway.server.dispatch.scheduler import Headroom, ShardPlan
from gateway.server.metrics import GatewayMetrics
from gateway.server.models import ModelRegistry
from gateway.server.queue.jobs import Job, JobStore
from gateway.server.replicas import ReplicaPool
from gateway.server.results.notifier import CompletionNotifier
from gateway.server.settings import GatewaySettings

log = logging.getLogger(__name__)

# Where work waits is read this often, whatever was announced.
POLL_S = 1.0

# At most this many requests started by one TAKE (the script runs alone in Redis meanwhile).
TAKE_MOST = 32


@dataclass
class Running:
    job: Job
    prepared: Any = None  # the validated inputs, when this process validated them at submission
    control: RunControl | None = None
    task: asyncio.Task[Any] | None = None  # (the call's own, for a run it carries: hold)
    acquired: bool = False
    stale: bool = False  # another run took over: it stops without finishing
    handed: bool = False  # shutting down: stopped, and handed on to another process


@dataclass
class Dispatcher:
    redis: RedisClients
    consumer: str
    jobs: JobStore
    pool: ReplicaPool
    registry: ModelRegistry
    runner: Runner
    settings: GatewaySettings
    metrics: GatewayMetrics
    notifier: CompletionNotifier
    # Called with every record this process ends (quick, in-line: they spawn what must wait;
    # spine.ended calls them).
    finished_hooks: list[Callable[[ResultRecord], None]] = field(default_factory=list)
    running: dict[str, Running] = field(default_factory=dict)
    health: dict[str, LoopHealth] = field(default_factory=dict)
    _loops: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _accepting: bool = True
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        # Stages 3 to 5 of the runs this process holds, with its parts (the same hooks).
        self.carrier = spine.Carrier(
            self.jobs,
            self.runner,
            self.registry,
            self.notifier,
            self.metrics,
            self.settings.max_deliveries,
            self.finished_hooks,
        )
        self.headroom = Headroom(fraction=self.settings.fair_headroom)
        self.plan = ShardPlan(self.jobs.shards)
        self.plan.mark_all(self.registry.names)
        self._side: set[asyncio.Task[None]] = set()
        self._acquiring: dict[str, int] = {}  # per model: runs not holding a replica slot yet
        # Per model: slots promised to submissions in flight that may start at once
        # (can_start_now until end_start_now), so concurrent calls cannot all take one slot.
        self._promised: dict[str, int] = {}
        self.leases = LeaseKeeper(self.redis, self.jobs.shards, self.consumer, self.jobs.lease_ms, self._on_lease)

    async def start(self) -> None:
        self.leases.start()
        for name, loop in (
            ("dispatcher take", self._take_loop),
            ("dispatcher channels", self._channel_loop),
        ):
            health = self.health[name] = LoopHealth(name)
            self._loops[name] = asyncio.create_task(supervise(health, loop), name=name)

    async def stop(self, drain_s: float | None = None) -> None:
        """Stop taking work; let running requests finish for up to drain_s (their leases
        still renewed); hand the rest on to other gateways at once."""
        self._accepting = False
        await cancel_and_wait(self._loops.values())
        drain = self.settings.drain_s if drain_s is None else drain_s
        tasks = [r.task for r in self.running.values() if r.task]
        if tasks:
            await asyncio.wait(tasks, timeout=drain)
        left = [(request_id, r.job.run) for request_id, r in self.running.items() if r.task and not r.task.done()]
        for request_id, _ in left:
            held = self.running[request_id]
            held.handed = True
            if held.task is not None:
                held.task.cancel()
        await asyncio.gather(*(t for t in tasks if not t.done()), return_exceptions=True)
        await self.leases.stop()
        if left:
            await spine.hand_over(self.jobs, self.consumer, left)

    # -- taking work -------------------------------------------------------------------

    def can_start_now(self, model: str, tenant: str) -> tuple[str, bool]:
        """(this process's consumer name, light only) if a request of `model` may start here
        at once (SUBMIT then starts it in the same round trip when nothing of the model
        waits), else ("", False). Light only: we are within the headroom, so only a
        tenant that runs nothing of the model may start."""
        self.headroom.touch(model, tenant)
        if not self._accepting or model not in self.registry:
            return "", False
        room = self._room(model)
        if room <= 0:
            return "", False
        self._promised[model] = self._promised.get(model, 0) + 1
        return self.consumer, room <= self.headroom.reserve(model, self._slots(model))

    def end_start_now(self, model: str) -> None:
        """The submission that can_start_now promised a slot has ended (started here, and
        adopted, or queued after all): the slot is no longer promised."""
        self._promised[model] -= 1

    def adopt(self, job: Job, prepared: Any = None) -> None:
        """Hold a request started for this process (by TAKE, or by SUBMIT at once for a
        call that does not carry it itself): a slot, a task that carries it to its end
        (spine.carry), its lease renewed; prepared: its inputs as validated at submission
        (not validated again)."""
        running = self._held(job, prepared)
        if running is not None:
            running.task = asyncio.create_task(self._hold(running), name=f"request-{job.request_id}")

    def hold(self, job: Job, prepared: Any = None) -> Callable[[], Awaitable[str | None]] | None:
        """Hold a request SUBMIT started at once for the call that submitted it, which
        carries it in its own task (no task made here): a slot and its lease renewed, as
        adopt's. What to await to carry it: its record's JSON as FINISH wrote it, or None
        (it was no longer this run's to finish, or this process hands it on). None: held
        already (the caller has nothing to carry)."""
        running = self._held(job, prepared)
        if running is None:
            return None

        async def carried() -> str | None:
            running.task = asyncio.current_task()  # what the lease keeper and shutdown stop
            return await self._hold(running)

        return carried

    def _held(self, job: Job, prepared: Any) -> Running | None:
        if job.request_id in self.running:
            return None
        self.headroom.touch(job.model, job.tenant)
        running = Running(job=job, prepared=prepared)
        self.running[job.request_id] = running
        self.leases.add(job.request_id, job.run)  # renewed from now on, however busy this loop is
        self._acquiring[job.model] = self._acquiring.get(job.model, 0) + 1
        return running

    def wake(self) -> None:
        """Look at every shard now (a replica came back: what waited can start)."""
        self.plan.mark_all(self.registry.names)
        self._wake.set()

    def notice(self, shard: Shard, model: str) -> None:
        """A request was just queued on `shard` by this process: ask there at once."""
        self.plan.mark(shard.index, model)
        self._wake.set()

    def _slots(self, model: str) -> int:
        adapter = self.registry.adapters.get(model)
        if adapter is None:
            return 0
        return sum(r.limit(adapter.triton_model) for r in self.pool.serving(adapter.triton_model))

    def _free(self, model: str) -> int:
        adapter = self.registry.adapters.get(model)
        return self.pool.free_slots(adapter.triton_model) if adapter else 0

    def _room(self, model: str) -> int:
        """Free slots of the model, less the runs of it still waiting to acquire one and
        those promised to submissions in flight."""
        return self._free(model) - self._acquiring.get(model, 0) - self._promised.get(model, 0)

    def _background(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._side.add(task)
        task.add_done_callback(self._side.discard)

    async def _take_loop(self) -> None:
        last_poll = time.monotonic()  # the channel loop marks every shard as it subscribes
        while self._accepting:
            self._wake.clear()
            if time.monotonic() - last_poll >= POLL_S:
                last_poll = time.monotonic()
                await self._poll()
            if await self._take_some():
                continue
            timeout = max(0.0, last_poll + POLL_S - time.monotonic())
            try:
                async with asyncio.timeout(timeout):  # in this task (wait_for would make one)
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _poll(self) -> None:
        """Mark the shards and models where work waits (queued: the backlog's per-model
        counter; a run to start again: a reclaimed list), whatever was announced; a shard
        that cannot be read is marked whole. Sets the backlog gauge."""
        models = self.registry.names
        found = await asyncio.gather(*(self._waiting(shard, models) for shard in self.jobs.shards))
        backlog = 0
        for shard, (queued, waiting) in zip(self.jobs.shards, found, strict=True):
            backlog += queued
            for model in waiting:
                self.plan.mark(shard.index, model)
        self.metrics.backlog.set(backlog)

    async def _waiting(self, shard: Shard, models: list[str]) -> tuple[int, list[str]]:
        """(requests queued in the shard, the models with work waiting there); a shard that
        cannot be read has work for every model."""
        try:
            return await self.jobs.waiting(shard, models)
        except REDIS_OUTAGE as exc:
            log.warning("reading the backlog of %s failed: %s", shard.prefix, type(exc).__name__)
            return 0, models

    async def _take_some(self) -> int:
        """Start what the free slots allow; how many started."""
        started = 0
        for model in self.plan.models():
            if model not in self.registry:
                self.plan.forget(model)
                continue
            while self._accepting and (room := self._room(model)) > 0:
                shard = self.plan.next(model)
                if shard is None:
                    break
                reserve = self.headroom.reserve(model, self._slots(model))
                light = room <= reserve
                self.plan.clear(shard.index, model)  # a wake during the call marks it again
                # Within the headroom one at a time (the policy looks at what runs); above
                # it as many as there is room for above it, in one call.
                most = 1 if light else min(room - reserve, TAKE_MOST)
                try:
                    got = await spine.start(self.jobs, self, shard, model, most=most, light_only=light)
                except REDIS_OUTAGE as exc:  # that shard's Redis is away (a failover): the others go on
                    log.warning("taking %s work from %s failed: %s", model, shard.prefix, type(exc).__name__)
                    continue
                if isinstance(got, list):  # each held here now (adopt)
                    self.plan.mark(shard.index, model)  # there may be more
                    started += len(got)
                elif got == "held":
                    self.plan.mark(shard.index, model)  # work waits there: ask again when a slot frees
                    break  # only heavy tenants wait: keep the headroom until then
        return started

    def _on_lease(self, request_id: str, run: str, flag: int) -> None:
        """What the lease keeper found (on this loop): 0 the run is stale, 2 it is asked to cancel."""
        running = self.running.get(request_id)
        if running is None or running.job.run != run:
            return  # that run has ended here
        control = running.control
        if flag == 0:
            if running.stale:
                return
            log.warning(
                "request %s: attempt %d is stale (another run took over); stopping", request_id, running.job.attempts
            )
            running.stale = True
            if control is not None:  # else its task stops as it begins
                control.stale = True
                control.stop()
                if running.task:
                    running.task.cancel()
        elif flag == 2:
            if control is None:
                running.job.cancel_requested = True
            elif not control.cancel_requested:
                control.cancel_requested = True
                control.stop()

    async def _channel_loop(self) -> None:
        """Cancels (a running request of ours asked to stop) and work announcements."""
        async with self.redis.subscription(CANCEL_CHANNEL, WORK_CHANNEL) as pubsub:
            # Cancels and work announced while we were not subscribed: look now.
            self.leases.check_now()
            self.plan.mark_all(self.registry.names)
            self._wake.set()
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0)
                if message is None:
                    await pubsub.ping()
                    continue
                if message["channel"] == WORK_CHANNEL:
                    self._announced(message["data"])
                    continue
                running = self.running.get(message["data"])
                if running and running.control and not running.control.cancel_requested:
                    running.control.cancel_requested = True
                    running.control.stop()

    def _announced(self, data: str) -> None:
        """'{s3}:model': work appeared in shard 3 for model."""
        tag, _, model = data.partition(":")
        try:
            shard = int(tag.strip("{}s"))
        except ValueError:
            return
        if shard < len(self.jobs.shards):
            self.plan.mark(shard, model)
            self._wake.set()

    # -- holding one request -----------------------------------------------------------

    async def _hold(self, running: Running) -> str | None:
        """A request this process holds, in its task (this dispatcher's, or the call's that
        submitted it: hold): its run's control (which the lease keeper, cancels and
        shutdown stop), spine.carry, then its slot and lease let go. The record's JSON, if
        this run finished it."""
        job = running.job
        try:
            if running.stale:
                return None
            control = running.control = RunControl(request_id=job.request_id, attempt=job.attempts, token=job.run)
            control.cancel_requested = job.cancel_requested
            return await spine.carry(
                self.carrier, job, control, running.prepared, on_acquired=lambda: self._acquired(running)
            )
        except asyncio.CancelledError:
            if not (running.stale or running.handed):
                raise
            # Stopped by us (another run took over; shutting down: it is handed on): the
            # task goes on (a call's task answers its caller), not counted as cancelled.
            # (Its run's abort may have cancelled it as well: every such request is undone.)
            task = asyncio.current_task()
            while task is not None and task.cancelling():
                task.uncancel()
            return None
        finally:
            if running.control is not None:
                running.control.release()
            self.leases.discard(job.request_id, job.run)
            self.running.pop(job.request_id, None)
            self._acquired(running)
            self._wake.set()

    def _acquired(self, running: Running) -> None:
        """The run holds a replica slot now (or ended without one): it no longer counts as waiting."""
        if not running.acquired:
            running.acquired = True
            self._acquiring[running.job.model] -= 1
