"""Wake long-polls the moment a request ends.

One Redis pub/sub subscription per process (channel `done`, on which each finish script
publishes the ids of the requests it ended, space separated) feeds in-process futures, so a
thousand waiting clients cost one connection. The message names requests only (every gateway
process receives every message: records in it would be sent to all of them), so a waiter it
wakes reads the record (the results entry) once. A request run in this process needs no
message: its dispatcher hands the record to this process's waiters at once (`deliver`), and
messages for it are ignored while it runs (`running`), so that they do not make its waiters
read what is about to be handed to them. Pub/sub may drop a message while reconnecting, so on
every (re)subscription all waiters are told to look again."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from gateway.common.redis import RedisClients
from gateway.common.retry import LoopHealth, cancel_and_wait, supervise
from gateway.protocol.redis_keys import DONE_CHANNEL

log = logging.getLogger(__name__)


class CompletionNotifier:
    def __init__(self, redis: RedisClients) -> None:
        self.redis = redis
        # Each future gets the record's JSON, or None for "look again" (a `done` message, a
        # run of this process that ended without a record, a reconnect).
        self._waiters: dict[str, set[asyncio.Future[str | None]]] = defaultdict(set)
        # Runs of this process in progress, by request id (their dispatcher delivers).
        self._running: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self.health = LoopHealth("completion channel")

    async def start(self) -> None:
        self._task = asyncio.create_task(supervise(self.health, self._listen), name="completion-notifier")
        try:
            await asyncio.wait_for(self._subscribed.wait(), timeout=10)
        except TimeoutError:
            log.warning("completion channel not subscribed yet; long-polls re-check on their own until it is")

    async def close(self) -> None:
        if self._task:
            await cancel_and_wait([self._task])

    async def _listen(self) -> None:
        try:
            async with self.redis.subscription(DONE_CHANNEL) as pubsub:
                self._subscribed.set()
                self._wake_all()  # endings published while we were not listening: look again
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0)
                    if message is None:
                        await pubsub.ping()  # notice a dead connection within seconds
                        continue
                    for request_id in message["data"].split():
                        if request_id not in self._running:
                            self._wake(request_id, None)
        finally:
            self._wake_all()

    def deliver(self, request_id: str, record: str) -> None:
        """Wake this process's waiters at once with the record, without the pub/sub round
        trip and a read (called by the dispatcher that finished the request)."""
        self._wake(request_id, record)

    @contextmanager
    def running(self, request_id: str) -> Iterator[None]:
        """While a run of this process has the request: its `done` message is left to the
        run's deliver. A run that ends without delivering (another finished the request)
        tells the waiters to look again."""
        self._running[request_id] += 1
        try:
            yield
        finally:
            self._running[request_id] -= 1
            if self._running[request_id] <= 0:
                del self._running[request_id]
                self._wake(request_id, None)

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
