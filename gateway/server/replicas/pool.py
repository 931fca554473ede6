"""The pool of Triton replicas: one long-lived gRPC client each, health probes, and
least-outstanding choice (LLMs get a cache-aware choice through a router).

A replica is used only while its last probe found the server ready and listing the
model READY. A replica that fails a call at the transport level, or refuses a probe, is
ejected at once and comes back when a probe finds it healthy again (its channel
reconnects within a second, so a restarted Triton is used again within a probe interval
of being ready). A replica that only answers probes late (busy) stays in until it misses
several in a row: load is not a fault. The set of replicas can change while
running (DNS discovery): new addresses join, gone ones leave once idle. A healthy replica
this gateway has sent nothing since its last probe is probed every IDLE_PROBE_S only (a
call to it that fails at the transport level still ejects it at once).

A gateway keeps at most REPLICA_MAX_INFLIGHT requests of a model in flight on a replica,
and no more than the model's engine can run beside what the other gateways keep there
(`engine_limits`, from the engine's own metrics: routing/load.py). The rest wait in the
fair queue, so which tenant's request runs next is decided there, not by the engine's
FIFO."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE

log = logging.getLogger(__name__)

SLOW_PROBES_TO_EJECT = 3
# A healthy replica unused since its last probe is probed this often (else every
# PROBE_INTERVAL_S, as one that is out, in use or slow to answer).
IDLE_PROBE_S = 5.0

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
    # Find a peer that vanished without closing its connection (a partition, a dead host).
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 2),
    # gRPC backs off reconnecting up to 120 s by default: a Triton that restarted would
    # be found by the probes only that late. Reconnect within a probe interval instead.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass(eq=False)
class Replica:
    url: str
    client: triton_aio.InferenceServerClient
    max_inflight: int  # per model: each model of a Triton has its own instances and queue
    inflight: int = 0  # all models together
    busy: dict[str, int] = field(default_factory=dict)  # in flight, per model
    healthy: bool = False
    ready_models: frozenset[str] = field(default_factory=frozenset)
    last_error: str = ""
    # Bumped each time the replica comes back after being unhealthy (a restart, maybe).
    generation: int = 0
    removed: bool = False
    # Probes in a row that timed out (a busy server answers late: not a fault by itself).
    slow_probes: int = 0
    # Requests sent to it so far, and that count and the (loop) time at its last probe.
    taken: int = 0
    taken_at_probe: int = 0
    probed_at: float = 0.0
    # Per Triton model whose engine reports its capacity: how many of this gateway's
    # requests it can run now (its capacity less what the other gateways keep there).
    engine_limits: dict[str, int] = field(default_factory=dict)

    def serves(self, model: str) -> bool:
        return self.healthy and not self.removed and model in self.ready_models

    def limit(self, model: str) -> int:
        engine = self.engine_limits.get(model)
        return self.max_inflight if engine is None else min(self.max_inflight, engine)

    def has_room(self, model: str) -> bool:
        return self.busy.get(model, 0) < self.limit(model)

    def free(self, model: str) -> int:
        return max(0, self.limit(model) - self.busy.get(model, 0))


class ReplicaPool:
    def __init__(
        self, urls: Iterable[str], *, max_inflight: int, probe_interval_s: float, probe_timeout_s: float
    ) -> None:
        self.max_inflight = max_inflight
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.replicas: list[Replica] = []
        self._changed = asyncio.Condition()
        # Set by every acquire: the load tracker scrapes while requests take slots.
        self.used = asyncio.Event()
        self._rotation = itertools.count()
        self._probe_task: asyncio.Task[None] | None = None
        # Called with a replica when it (re)joins the rotation, e.g. to drop routing state.
        self.on_admitted: list[Callable[[Replica], None]] = []
        for url in urls:
            self._add(url)

    def _add(self, url: str) -> Replica:
        replica = Replica(
            url=url,
            client=triton_aio.InferenceServerClient(url, channel_args=CHANNEL_OPTIONS),
            max_inflight=self.max_inflight,
        )
        self.replicas.append(replica)
        return replica

    async def set_urls(self, urls: Iterable[str]) -> None:
        """Make the pool hold exactly these replicas (discovery). New ones are probed
        before use; removed ones take no new work and close once idle."""
        wanted = list(dict.fromkeys(urls))
        current = {r.url: r for r in self.replicas if not r.removed}
        for url in wanted:
            if url not in current:
                log.info("replica %s discovered", url)
                await self._probe(self._add(url))
        for url, replica in current.items():
            if url not in wanted:
                log.info("replica %s gone from discovery", url)
                replica.removed = True
        await self._close_idle_removed()

    async def _close_idle_removed(self) -> None:
        for replica in [r for r in self.replicas if r.removed and r.inflight == 0]:
            self.replicas.remove(replica)
            await replica.client.close()

    async def start(self) -> None:
        await self.probe_all()
        self._probe_task = asyncio.create_task(self._probe_forever(), name="replica-probes")

    async def close(self) -> None:
        if self._probe_task:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
        for replica in self.replicas:
            await replica.client.close()

    # -- health --------------------------------------------------------------------------

    async def _probe(self, replica: Replica) -> None:
        replica.probed_at, replica.taken_at_probe = asyncio.get_running_loop().time(), replica.taken
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                ready = await replica.client.is_server_ready()
                index = await replica.client.get_model_repository_index(as_json=True) if ready else {}
            models = frozenset(m["name"] for m in index.get("models", []) if m.get("state") == "READY")
            healthy = bool(ready and models)
            error = "" if healthy else "server not ready"
            replica.slow_probes = 0
        except TimeoutError:
            # Under load a probe can wait behind the work: only a replica that stays silent
            # for several probes in a row is taken out (overload is backpressure, not a fault).
            replica.slow_probes += 1
            if replica.slow_probes < SLOW_PROBES_TO_EJECT and replica.healthy:
                return
            healthy, models, error = False, frozenset(), f"no answer to {replica.slow_probes} probes in a row"
        except Exception as exc:  # unreachable, gRPC error: not usable now
            healthy, models, error = False, frozenset(), f"{type(exc).__name__}: {exc}"
        if healthy and not replica.healthy:
            replica.generation += 1
            log.warning("replica %s admitted", replica.url)
            for callback in self.on_admitted:
                callback(replica)
        elif replica.healthy and not healthy:
            log.warning("replica %s ejected: %s", replica.url, error)
        replica.healthy, replica.ready_models, replica.last_error = healthy, models, error
        if healthy:
            await self._notify()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(r) for r in list(self.replicas) if not r.removed))
        await self._close_idle_removed()

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            now = asyncio.get_running_loop().time()
            await asyncio.gather(*(self._probe(r) for r in list(self.replicas) if self._probe_due(r, now)))
            await self._close_idle_removed()

    @staticmethod
    def _probe_due(replica: Replica, now: float) -> bool:
        if replica.removed:
            return False
        idle = replica.healthy and not replica.slow_probes and replica.inflight == 0
        idle = idle and replica.taken == replica.taken_at_probe
        return not idle or now - replica.probed_at >= IDLE_PROBE_S

    def eject(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            log.warning("replica %s ejected: %s", replica.url, reason)
        replica.healthy, replica.last_error = False, reason

    # -- choosing ------------------------------------------------------------------------

    def candidates(self, model: str, exclude: frozenset[str] = frozenset()) -> list[Replica]:
        """Healthy replicas serving the model with room. A replica in `exclude` (it just
        failed this request) is left out only while another one can serve."""
        serving = [r for r in self.replicas if r.serves(model)]
        others = [r for r in serving if r.url not in exclude]
        pool = others or serving
        return [r for r in pool if r.has_room(model)]

    def least_outstanding(self, candidates: list[Replica]) -> Replica:
        offset = next(self._rotation) % len(candidates)
        rotated = candidates[offset:] + candidates[:offset]
        return min(rotated, key=lambda r: r.inflight)

    async def acquire(
        self,
        model: str,
        timeout: float,
        exclude: frozenset[str] = frozenset(),
        choose: Callable[[list[Replica]], Replica] | None = None,
    ) -> Replica:
        """Wait up to timeout for a replica with a free slot (TimeoutError after); it
        counts as in flight until release(). `choose` picks among the candidates."""
        async with asyncio.timeout(max(timeout, 0)):
            async with self._changed:
                while not (found := self.candidates(model, exclude)):
                    await self._changed.wait()
                replica = (choose or self.least_outstanding)(found)
                replica.inflight += 1
                replica.taken += 1
                replica.busy[model] = replica.busy.get(model, 0) + 1
        self.used.set()
        return replica

    async def release(self, replica: Replica, model: str) -> None:
        replica.inflight -= 1
        replica.busy[model] = replica.busy.get(model, 0) - 1
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def limits_changed(self) -> None:
        """A replica's engine_limits were set again: waiters look once more."""
        await self._notify()

    def get(self, url: str) -> Replica | None:
        return next((r for r in self.replicas if r.url == url and not r.removed), None)

    def free_slots(self, model: str) -> int:
        """Room for more requests of this model on the replicas serving it."""
        return sum(r.free(model) for r in self.replicas if r.serves(model))

    def ready(self) -> bool:
        return any(r.healthy and not r.removed for r in self.replicas)

    def serving(self, model: str) -> list[Replica]:
        return [r for r in self.replicas if r.serves(model)]
