"""The pool of Triton replicas: one long-lived gRPC client each, health probes, and
least-outstanding-requests routing.

A replica is used only while its last probe found the server ready and lists the
model READY. A replica that fails a call at the transport level is ejected at once and
comes back when a probe finds it healthy again."""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field

import tritonclient.grpc.aio as triton_aio

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Replica:
    url: str
    client: triton_aio.InferenceServerClient
    max_inflight: int
    inflight: int = 0
    healthy: bool = False
    ready_models: frozenset[str] = field(default_factory=frozenset)
    last_error: str = ""

    def serves(self, model: str) -> bool:
        return self.healthy and model in self.ready_models and self.inflight < self.max_inflight


class NoReplica(Exception):
    """No healthy replica serves the model (before the deadline)."""


class ReplicaPool:
    def __init__(self, urls: list[str], *, max_inflight: int, probe_interval_s: float, probe_timeout_s: float) -> None:
        self.replicas = [
            Replica(url=url, client=triton_aio.InferenceServerClient(url), max_inflight=max_inflight) for url in urls
        ]
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self._changed = asyncio.Condition()
        self._rotation = itertools.count()
        self._probe_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.probe_all()
        self._probe_task = asyncio.create_task(self._probe_forever(), name="replica-probes")

    async def close(self) -> None:
        if self._probe_task:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
        for replica in self.replicas:
            await replica.client.close()

    # -- health ----------------------------------------------------------------------

    async def _probe(self, replica: Replica) -> None:
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                ready = await replica.client.is_server_ready()
                index = await replica.client.get_model_repository_index(as_json=True) if ready else {}
            models = frozenset(m["name"] for m in index.get("models", []) if m.get("state") == "READY")
            healthy = bool(ready and models)
            error = "" if healthy else "server not ready"
        except Exception as exc:  # unreachable, timeout, gRPC error: all mean not usable now
            healthy, models, error = False, frozenset(), f"{type(exc).__name__}: {exc}"
        if healthy != replica.healthy:
            log.warning("replica %s %s", replica.url, "admitted" if healthy else f"ejected: {error}")
        replica.healthy, replica.ready_models, replica.last_error = healthy, models, error
        if healthy:
            await self._notify()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(r) for r in self.replicas))

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            await self.probe_all()

    def eject(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            log.warning("replica %s ejected: %s", replica.url, reason)
        replica.healthy, replica.last_error = False, reason

    # -- routing ---------------------------------------------------------------------

    def pick(self, model: str, exclude: frozenset[str] = frozenset()) -> Replica | None:
        """The replica with the fewest requests in flight (ties rotate)."""
        candidates = [r for r in self.replicas if r.serves(model) and r.url not in exclude]
        if not candidates:
            return None
        offset = next(self._rotation) % len(candidates)
        rotated = candidates[offset:] + candidates[:offset]
        return min(rotated, key=lambda r: r.inflight)

    async def acquire(self, model: str, timeout: float, exclude: frozenset[str] = frozenset()) -> Replica:
        """Wait up to timeout for a replica with a free slot; it counts as in flight
        until release()."""
        async with asyncio.timeout(max(timeout, 0)):
            async with self._changed:
                while (replica := self.pick(model, exclude)) is None:
                    await self._changed.wait()
                replica.inflight += 1
        return replica

    async def release(self, replica: Replica) -> None:
        replica.inflight -= 1
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def free_slots(self) -> int:
        return sum(max(0, r.max_inflight - r.inflight) for r in self.replicas if r.healthy)

    def ready(self) -> bool:
        return any(r.healthy for r in self.replicas)

    def has_model(self, model: str) -> bool:
        return any(r.healthy and model in r.ready_models for r in self.replicas)
