"""Lease renewal on a thread of its own: request work cannot starve it.

A running request's lease must be renewed while its run lives, however busy the event
loop is. Renewed from the loop, a process saturated by request work (or a loop blocked by
a slow step) for longer than a lease let its leases lapse: another gateway took the runs
over and ran them twice, and the extra load fed the overload. The LeaseKeeper renews from
a daemon thread, with a synchronous Redis client of its own (one Redis, or the cluster:
each shard's RENEW goes to the node holding it, the client following the slot map) and
its own clock: every third of the lease, one RENEW per shard for the runs registered with
it, the shards renewed side by side (a shard whose node is away holds up no other).

What RENEW reports goes back to the event loop (call_soon_threadsafe): a stale run
(another run took over, or it was handed on) is stopped, a cancel is passed on (pub/sub
makes a cancel fast; renewal makes it certain). A run that ended while still its own (its
FINISH landed between this round's list of runs and its RENEW) is only forgotten: stopping
it would cancel a task waiting for its own FINISH's reply, as if another run had taken over.

A process that stops altogether (killed, frozen, starved of CPU) renews nothing: its
leases lapse and its work moves, as before. An event loop wedged for good while this
thread lives would otherwise keep its runs forever, so the keeper renews only while the
loop has answered it within LOOP_STALL_S (it posts a callback every round): a loop
stalled longer lets its leases lapse too."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from gateway.common.redis import REDIS_OUTAGE, RedisClients
from gateway.protocol.ids import request_id_shard
from gateway.protocol.redis_keys import Shard
from gateway.server import spine

log = logging.getLogger(__name__)

# A loop that has not run the keeper's callback for this long is wedged: its runs' leases
# are left to lapse, so that another gateway takes them over.
LOOP_STALL_S = 60.0
# After a failed renewal the next round comes this soon (a third of the lease at most).
RETRY_S = 0.25
# Shards renewed at once (each RENEW holds a thread while it waits for its node).
MAX_WORKERS = 16

# (request id, run token, flag): 0 stale, 2 asked to cancel; called on the event loop.
OnFlag = Callable[[str, str, int], None]


class LeaseKeeper:
    def __init__(
        self,
        clients: RedisClients,
        shards: list[Shard],
        consumer: str,
        lease_ms: int,
        on_flag: OnFlag,
        *,
        stall_s: float = LOOP_STALL_S,
    ) -> None:
        self.clients = clients
        self.shards = shards
        self.consumer = consumer
        self.lease_ms = lease_ms
        self.interval_s = lease_ms / 3000
        self.on_flag = on_flag
        self.stall_s = stall_s
        self.rounds = 0  # renewal rounds done (tests wait on it)
        self._runs: dict[str, str] = {}  # request id -> run token
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_seen = time.monotonic()
        self._stalled = False

    # -- called on the event loop ----------------------------------------------------------

    def add(self, request_id: str, run: str) -> None:
        """Renew this run's lease from now on (its start gave it a whole lease)."""
        with self._lock:
            self._runs[request_id] = run

    def discard(self, request_id: str, run: str) -> None:
        """The run ended (or was handed on): no more renewals."""
        with self._lock:
            if self._runs.get(request_id) == run:
                del self._runs[request_id]

    def check_now(self) -> None:
        """A round now (cancels and stale runs missed while pub/sub was away)."""
        self._wake.set()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_seen = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._main, name=f"lease-keeper-{self.consumer}", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop renewing (the runs left are handed on next, or their leases lapse)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        self._wake.set()
        await asyncio.to_thread(thread.join, self.clients.timeout_s * 2 + 1)

    def _seen(self) -> None:
        self._loop_seen = time.monotonic()

    # -- the thread ------------------------------------------------------------------------

    def _main(self) -> None:
        # A renewal that takes longer than a third of the lease is of no use: give up on it
        # sooner than the clients' own timeout (the next round tries again).
        client = self.clients.sync_client(timeout_s=min(self.clients.timeout_s, max(0.5, self.interval_s)))
        pool = ThreadPoolExecutor(max_workers=max(1, min(MAX_WORKERS, len(self.shards))), thread_name_prefix="renew")
        in_flight: dict[int, Future[bool]] = {}
        try:
            wait = 0.0
            while not self._stop.is_set():
                self._wake.wait(wait)
                self._wake.clear()
                if self._stop.is_set():
                    break
                wait = self.interval_s
                try:
                    if not self._round(client, pool, in_flight):
                        wait = min(RETRY_S, self.interval_s)
                except Exception:  # a defect of ours: log it, renew again next round
                    log.exception("renewing leases failed")
                    wait = min(RETRY_S, self.interval_s)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            client.close()

    def _round(self, client: Any, pool: ThreadPoolExecutor, in_flight: dict[int, Future[bool]]) -> bool:
        """Renew every shard's runs (one RENEW per shard, side by side); False when a
        shard's renewal failed last time (the next round comes sooner)."""
        loop = self._loop
        assert loop is not None
        try:
            loop.call_soon_threadsafe(self._seen)
        except RuntimeError:  # the loop is closed: nobody runs anything here any more
            self._stop.set()
            return True
        stalled = time.monotonic() - self._loop_seen
        if stalled > self.stall_s:
            if not self._stalled:
                log.error(
                    "the event loop has not run for %.0f s: leases are no longer renewed, other gateways take "
                    "this process's runs over",
                    stalled,
                )
            self._stalled = True
            return True
        if self._stalled:
            log.warning("the event loop runs again: leases are renewed again")
            self._stalled = False
        with self._lock:
            runs = list(self._runs.items())
        by_shard: dict[int, list[tuple[str, str]]] = {}
        for request_id, run in runs:
            by_shard.setdefault(request_id_shard(request_id) % len(self.shards), []).append((request_id, run))
        ok = True
        for index, done in list(in_flight.items()):
            if done.done():
                del in_flight[index]
                ok = ok and not done.exception() and done.result()
        for index, shard_runs in by_shard.items():
            if index not in in_flight:  # a renewal still waiting for its node is not sent again
                in_flight[index] = pool.submit(self._renew_shard, client, self.shards[index], shard_runs)
        self.rounds += 1
        return ok

    def _renew_shard(self, client: Any, shard: Shard, runs: list[tuple[str, str]]) -> bool:
        try:
            flags = spine.keep_leases(client, shard, self.consumer, self.lease_ms, runs)
        except REDIS_OUTAGE as exc:  # that shard's Redis is away (a failover): the others go on
            log.warning("renewing %d leases in %s failed: %s", len(runs), shard.prefix, type(exc).__name__)
            return False
        except Exception as exc:
            log.warning("renewing %d leases in %s failed: %s: %s", len(runs), shard.prefix, type(exc).__name__, exc)
            return False
        loop = self._loop
        assert loop is not None
        for (request_id, run), flag in zip(runs, flags, strict=True):
            flag = int(flag)
            if flag in (0, 3):
                self.discard(request_id, run)
            if flag in (0, 2):  # 3: the run ends on its own (its FINISH is in, or on its way back)
                try:
                    loop.call_soon_threadsafe(self.on_flag, request_id, run, flag)
                except RuntimeError:
                    return True
        return True
