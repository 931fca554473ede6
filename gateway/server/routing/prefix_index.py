"""Which prompt blocks were recently sent to which replica, shared by all gateways in
Redis (so N gateways route as one): for each block key, a hash of replica -> when, with
a TTL (ageing: a block not sent anywhere for ttl_s is forgotten, as the engine will
likely have evicted it). A replica that restarted empty is forgotten at once by bumping
its epoch: entries from an older epoch no longer count."""

from __future__ import annotations

import asyncio
import logging
import time

from redis.asyncio import Redis

log = logging.getLogger(__name__)

EPOCHS = "kvidx:epochs"


def _key(model: str, block: bytes) -> str:
    return f"kvidx:{model}:{block.hex()}"


class PrefixIndex:
    def __init__(self, redis: Redis, *, ttl_s: float, epoch_refresh_s: float = 1.0) -> None:
        self.redis = redis
        self.ttl_s = int(ttl_s)
        self.epoch_refresh_s = epoch_refresh_s
        self._epochs: dict[str, str] = {}
        self._epochs_at = 0.0
        self._writes: set[asyncio.Task[None]] = set()

    async def _current_epochs(self) -> dict[str, str]:
        if time.monotonic() - self._epochs_at > self.epoch_refresh_s:
            self._epochs = await self.redis.hgetall(EPOCHS)
            self._epochs_at = time.monotonic()
        return self._epochs

    async def matches(self, model: str, keys: list[bytes], replicas: list[str]) -> dict[str, int]:
        """For each replica, how many of the prompt's leading blocks it was sent (for this
        engine model: two models on one replica do not share a cache)."""
        if not keys or not replicas:
            return {}
        epochs = await self._current_epochs()
        async with self.redis.pipeline(transaction=False) as pipe:
            for block in keys:
                pipe.hmget(_key(model, block), replicas)
            rows = await pipe.execute()
        matched = dict.fromkeys(replicas, 0)
        live = set(replicas)
        for row in rows:
            for replica, value in zip(replicas, row, strict=True):
                if replica not in live:
                    continue
                if value is not None and value.split(":", 1)[0] == epochs.get(replica, "0"):
                    matched[replica] += 1
                else:
                    live.discard(replica)
            if not live:
                break
        return matched

    def record(self, model: str, keys: list[bytes], replica: str) -> None:
        """Note (in the background) that these blocks were sent to `replica`."""
        if keys:
            task = asyncio.ensure_future(self._record(model, keys, replica))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def _record(self, model: str, keys: list[bytes], replica: str) -> None:
        value = f"{self._epochs.get(replica, '0')}:{int(time.time())}"
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for block in keys:
                    pipe.hset(_key(model, block), replica, value)
                    pipe.expire(_key(model, block), self.ttl_s)
                await pipe.execute()
        except Exception as exc:  # the index is a hint: routing works without it
            log.debug("recording %d blocks for %s failed: %s", len(keys), replica, exc)

    async def forget(self, replica: str) -> None:
        """The replica restarted with an empty cache: none of its entries count any more."""
        epoch = await self.redis.hincrby(EPOCHS, replica, 1)
        self._epochs[replica] = str(epoch)
        log.info("prefix index: forgot replica %s (epoch %s)", replica, epoch)
