"""Wake long-polls the moment a request ends.

One Redis pub/sub subscription per process (channel `done`, published by the finish
script with the request id and its record) feeds in-process futures, so a thousand
waiting clients cost one connection and no extra read. Pub/sub may drop a message
while reconnecting, so waiters re-check the state in Redis when their wait ends."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from redis.asyncio import Redis

from gateway.contracts import DONE_CHANNEL

log = logging.getLogger(__name__)


class CompletionNotifier:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        # Each future gets the record's JSON, or None for "look again" (after a reconnect).
        self._waiters: dict[str, set[asyncio.Future[str | None]]] = defaultdict(set)
        self._task: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="completion-notifier")
        await asyncio.wait_for(self._subscribed.wait(), timeout=10)

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _listen(self) -> None:
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(DONE_CHANNEL)
                self._subscribed.set()
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        request_id, _, record = message["data"].partition("\n")
                        self._wake(request_id, record or None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("completion channel lost (%s); resubscribing", exc)
                self._wake_all()  # let waiters re-check rather than miss an ending
                await asyncio.sleep(0.5)
            finally:
                await pubsub.aclose()

    def deliver(self, request_id: str, record: str) -> None:
        """Wake this process's waiters at once, without the pub/sub round trip (called by
        the dispatcher that finished the request; the published message then finds none)."""
        self._wake(request_id, record)

    def _wake(self, request_id: str, record: str | None) -> None:
        for future in self._waiters.pop(request_id, ()):
            if not future.done():
                future.set_result(record)

    def _wake_all(self) -> None:
        for request_id in list(self._waiters):
            self._wake(request_id, None)

    @asynccontextmanager
    async def watch(self, request_id: str) -> AsyncIterator[asyncio.Future[str | None]]:
        """A future set when request_id ends. Register first, then check the state (or
        submit), then await it: no ending is missed in between."""
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._waiters[request_id].add(future)
        try:
            yield future
        finally:
            waiters = self._waiters.get(request_id)
            if waiters is not None:
                waiters.discard(future)
                if not waiters:
                    del self._waiters[request_id]
