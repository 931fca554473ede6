"""Which queued request starts next: the scheduling policy, stated once.

1. **Reclaimed first.** A request that was running when its dispatcher died (its lease ran
   out) or stopped (it handed it on) starts again before anything else of its model.
2. **Bands**: the high and normal bands together, then low, then batch. A lower band
   starts only while no tenant of a higher one can. The high band (an operator's grant)
   is a head start, not a pass: its tenants join `HIGH_BAND_LEAD` ahead of the shared
   virtual clock, so a granted tenant's request goes before the normal backlog while the
   tenant is within its share, and a flood of them gets it its share and no more.
3. **Weighted fair share between tenants, per model.** Within a band (and across high and
   normal), tenants take turns by start-time fair queuing: each tenant with waiting work
   has a virtual time; the lowest starts next and its virtual time grows by 1/weight (in
   both the high and the normal band where it waits in both: one share); a tenant that
   becomes ready joins at the current virtual time (so it neither waits behind others'
   backlogs nor saves up credit while idle). Each model has its own queues, virtual times
   and ready sets: traffic on one model never holds back another.
4. **Concurrency limits.** A tenant at its `max_concurrent` leaves the ready sets until one
   of its runs ends.
5. **Headroom for light tenants.** While other tenants were active on a model lately
   (within `FAIR_WINDOW_S`), a dispatcher keeps its last free slots of that model for
   tenants that run nothing of it now: one slot per other recent tenant (whether it runs
   something now or not), at most `fair_headroom` of the model's slots but at least one.
   A light tenant's request then starts at once instead of waiting for a heavy tenant's
   run to end; a tenant alone gets every slot
   (work-conserving but for that headroom, and never more held back than there are other
   recent tenants).

Steps 1-4 run inside Redis (the TAKE script, gateway.server.queue.scripts), over the
shard's sorted set of ready tenants: one decision is O(log tenants) whatever their number,
and one Redis round trip. This module holds the dispatcher's side: the headroom (step 5)
and which shards to ask (a shard is asked again only when work was announced there or a
poll finds it), both O(1) per decision."""

from __future__ import annotations

import math
import time

from cachetools import TTLCache

from gateway.protocol.redis_keys import Shard

# A tenant counts as recently active on a model (and is kept a slot) this long.
FAIR_WINDOW_S = 5.0


class Headroom:
    """Tenants seen lately per model (a TTL cache per model: a tenant's entry lives window_s
    after it was last seen; O(1) to touch, amortised O(1) to expire), and how many free
    slots to keep for light ones."""

    def __init__(self, *, window_s: float = FAIR_WINDOW_S, fraction: float = 0.25) -> None:
        self.window_s = window_s
        self.fraction = fraction
        self._clock = _Clock()
        self._seen: dict[str, TTLCache[str, None]] = {}

    def touch(self, model: str, tenant: str, now: float | None = None) -> None:
        seen = self._seen.get(model)
        if seen is None:
            seen = self._seen[model] = TTLCache(math.inf, ttl=self.window_s, timer=self._clock)
        self._clock.now = now
        try:
            seen[tenant] = None
        finally:
            self._clock.now = None

    def recent(self, model: str, now: float | None = None) -> int:
        seen = self._seen.get(model)
        if seen is None:
            return 0
        self._clock.now = now
        try:
            return len(seen)  # (drops the entries that expired)
        finally:
            self._clock.now = None

    def reserve(self, model: str, slots: int, now: float | None = None) -> int:
        """Free slots of `model` kept for light tenants: one per other recent tenant, at
        most `fraction` of the model's slots but at least one (0 when at most one tenant is
        about, or the model has one slot)."""
        others = self.recent(model, now) - 1
        if others <= 0 or slots <= 1:
            return 0
        return min(others, max(1, math.floor(slots * self.fraction)))


class _Clock:
    """Headroom's timer: time.monotonic, or the time its caller passed (`now`, as tests do)."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now: float | None = None

    def __call__(self) -> float:
        return time.monotonic() if self.now is None else self.now


class ShardPlan:
    """Per model, the shards that may hold work: marked when work is announced there
    (pub/sub) or by a periodic poll, cleared when a TAKE finds nothing. Shards are asked
    in turn, so no shard is starved by another's backlog."""

    def __init__(self, shards: list[Shard]) -> None:
        self.shards = shards
        self._marked: dict[str, set[int]] = {}
        self._turn: dict[str, int] = {}

    def mark(self, shard: int, model: str) -> None:
        self._marked.setdefault(model, set()).add(shard)

    def mark_all(self, models: list[str]) -> None:
        everything = {shard.index for shard in self.shards}
        for model in models:
            self._marked[model] = set(everything)

    def forget(self, model: str) -> None:
        self._marked.pop(model, None)

    def clear(self, shard: int, model: str) -> None:
        self._marked.get(model, set()).discard(shard)

    def next(self, model: str) -> Shard | None:
        """The next marked shard for `model`, in rotation (None when none is marked)."""
        marked = self._marked.get(model)
        if not marked:
            return None
        count = len(self.shards)
        turn = self._turn.get(model, 0)
        for step in range(count):
            index = (turn + step) % count
            if index in marked:
                self._turn[model] = index + 1
                return self.shards[index]
        return None

    def models(self) -> list[str]:
        return [model for model, marked in self._marked.items() if marked]
