"""Which queued request a dispatcher starts next.

Queues are streams per (model, band, tenant). A dispatcher reads a model's queues only
while its replicas have room for that model, keeps a few entries ahead in a local
buffer, and starts them in order: requests reclaimed from dead dispatchers first, then
bands in order (high, normal, low, batch), and within a band the tenant with the
smallest weighted share of the running work (weighted fair sharing of the replicas'
slots), so a tenant that floods its queue gets what others leave unused but cannot
delay them."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from redis.asyncio import Redis

from gateway.common.streams import Entry
from gateway.protocol.redis_keys import BANDS, QUEUE_REGISTRY, parse_queue_stream


@dataclass
class _Band:
    tenants: dict[str, deque[Entry]] = field(default_factory=dict)
    order: deque[str] = field(default_factory=deque)  # round-robin order, for ties

    def push(self, tenant: str, entry: Entry) -> None:
        if tenant not in self.tenants:
            self.tenants[tenant] = deque()
            self.order.append(tenant)
        self.tenants[tenant].append(entry)

    def pop(self, share: Callable[[str], float], allowed: Callable[[str], bool]) -> Entry | None:
        """The next request of the waiting tenant with the smallest share of the running
        work (running requests / weight), ties in round-robin order; a tenant at its
        concurrency limit is passed over for now. A tenant with nothing queued leaves."""
        for tenant in [t for t in self.order if not self.tenants[t]]:
            self.order.remove(tenant)
            del self.tenants[tenant]
        candidates = [t for t in self.order if allowed(t)]
        if not candidates:
            return None
        tenant = min(candidates, key=share)  # min() keeps the first of equals: round robin
        self.order.remove(tenant)
        self.order.append(tenant)
        return self.tenants[tenant].popleft()

    def __len__(self) -> int:
        return sum(len(q) for q in self.tenants.values())


class LocalQueue:
    """Entries this dispatcher has read (or reclaimed) but not started, per model."""

    def __init__(self, share: Callable[[str], float]) -> None:
        self.share = share  # tenant -> running requests / weight
        self.reclaimed: dict[str, deque[Entry]] = {}
        self.bands: dict[str, dict[str, _Band]] = {}

    def push(self, entry: Entry, *, reclaimed: bool = False) -> None:
        model, band, tenant = parse_queue_stream(entry.stream)
        if reclaimed:
            self.reclaimed.setdefault(model, deque()).append(entry)
        else:
            self.bands.setdefault(model, {}).setdefault(band, _Band()).push(tenant, entry)

    def pop(self, model: str, allowed: Callable[[str], bool] = lambda tenant: True) -> Entry | None:
        reclaimed = self.reclaimed.get(model)
        if reclaimed:
            return reclaimed.popleft()
        bands = self.bands.get(model, {})
        for band in BANDS:
            if band in bands and (entry := bands[band].pop(self.share, allowed)) is not None:
                return entry
        return None

    def waiting(self, model: str, tenant: str) -> bool:
        """Whether the tenant has work waiting here for this model."""
        return any(band.tenants.get(tenant) for band in self.bands.get(model, {}).values())

    def count(self, model: str) -> int:
        return len(self.reclaimed.get(model, ())) + sum(len(b) for b in self.bands.get(model, {}).values())

    def models(self) -> list[str]:
        return [m for m in {*self.reclaimed, *self.bands} if self.count(m)]

    def entries(self) -> list[Entry]:
        found = [e for q in self.reclaimed.values() for e in q]
        for bands in self.bands.values():
            for band in bands.values():
                found.extend(e for q in band.tenants.values() for e in q)
        return found

    def drain(self) -> list[Entry]:
        found = self.entries()
        self.reclaimed.clear()
        self.bands.clear()
        return found


class QueueRegistry:
    """The queue streams in use, read from Redis (`queue:streams`, scored by last use)."""

    def __init__(self, redis: Redis, *, window_s: float, refresh_s: float = 0.5) -> None:
        self.redis = redis
        self.window_s = window_s
        self.refresh_s = refresh_s
        self.streams: dict[str, dict[str, list[str]]] = {}  # model -> band -> streams
        self._fetched = 0.0

    async def refresh(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._fetched < self.refresh_s:
            return
        names = await self.redis.zrangebyscore(QUEUE_REGISTRY, time.time() - self.window_s, "+inf")
        streams: dict[str, dict[str, list[str]]] = {}
        for name in names:
            try:
                model, band, _ = parse_queue_stream(name)
            except ValueError:
                continue
            streams.setdefault(model, {}).setdefault(band, []).append(name)
        self.streams = streams
        self._fetched = time.monotonic()

    def add(self, stream: str) -> bool:
        """Know a queue at once (this process just used it); True if it was new."""
        model, band, _ = parse_queue_stream(stream)
        streams = self.streams.setdefault(model, {}).setdefault(band, [])
        if stream in streams:
            return False
        streams.append(stream)
        return True

    def of(self, model: str, band: str) -> list[str]:
        return self.streams.get(model, {}).get(band, [])

    def all(self) -> list[str]:
        return [s for bands in self.streams.values() for names in bands.values() for s in names]
