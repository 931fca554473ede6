"""A cache that answers from memory and reads again behind its callers (stale while
revalidate), for what every request looks up in MongoDB (its API key, its tenant's
settings): once a value is known, a slow or absent MongoDB neither fails nor slows the
requests that need it.

- A value younger than `fresh_s` is answered as it is.
- An older one is still answered at once, and one read per key starts in the background;
  a read that fails keeps the old value (MongoDB is down: what was known still holds).
- A value never read (or dropped) is read by its caller; callers that ask for it at the
  same time share that one read.
- `drop` / `clear` take effect at once, also on reads already in flight: a read that
  started before a drop does not store its (older) answer. So a key revoked while its
  verification is in flight is not put back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

from cachetools import LRUCache

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

log = logging.getLogger(__name__)


class RefreshingCache(Generic[K, V]):
    def __init__(self, *, fresh_s: float, maxsize: int) -> None:
        self.fresh_s = fresh_s
        self._entries: LRUCache[K, tuple[float, V]] = LRUCache(maxsize)
        self._reads: dict[K, asyncio.Task[V | None]] = {}
        # Bumped by every drop: a read stores its answer only if none happened meanwhile.
        self._generation = 0

    async def get(self, key: K, read: Callable[[], Awaitable[V | None]]) -> V | None:
        """The value of key: cached (refreshed behind when older than fresh_s), else read
        now. read() answers None for "there is no such value": nothing is cached then."""
        entry = self._entries.get(key)
        if entry is None:
            return await asyncio.shield(self._start(key, read))
        if time.monotonic() - entry[0] >= self.fresh_s and key not in self._reads:
            self._start(key, read).add_done_callback(_ignore_failure)
        return entry[1]

    def peek(self, key: K) -> V | None:
        """The cached value, however old, without reading."""
        entry = self._entries.get(key)
        return entry[1] if entry is not None else None

    def drop(self, key: K) -> None:
        self._generation += 1
        self._entries.pop(key, None)

    def drop_where(self, matches: Callable[[V], bool]) -> None:
        self._generation += 1
        for key in [key for key, (_, value) in self._entries.items() if matches(value)]:
            self._entries.pop(key, None)

    def clear(self) -> None:
        self._generation += 1
        self._entries.clear()

    def _start(self, key: K, read: Callable[[], Awaitable[V | None]]) -> asyncio.Task[V | None]:
        task = self._reads.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._read(key, read))
            self._reads[key] = task
            task.add_done_callback(lambda done: self._reads.pop(key, None) if self._reads.get(key) is done else None)
        return task

    async def _read(self, key: K, read: Callable[[], Awaitable[V | None]]) -> V | None:
        generation = self._generation
        value = await read()
        if generation == self._generation:
            if value is None:
                self._entries.pop(key, None)
            else:
                self._entries[key] = (time.monotonic(), value)
        return value


def _ignore_failure(task: asyncio.Task) -> None:
    """A refresh behind the callers that failed: the old value stays."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("a cache refresh failed: %s", type(task.exception()).__name__)
