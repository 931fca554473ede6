"""How long the event loop is held by work, measured from inside the process: one task
wakes every TICK_S and records how late it woke, counting only the part the loop's own
thread spent running (its CPU time over the interval), so a process the OS merely left
waiting on a loaded machine reads as no pause. What it cannot see: a pause while another
thread holds the GIL (the gateway's threads run C code that releases it: decompression,
tokenizers).

    gateway_event_loop_pauses_seconds     a histogram of the pauses over PAUSE_FLOOR_S
    gateway_event_loop_max_pause_seconds  the longest since the process started
    gateway_event_loop_probe_ticks_total  its wake-ups (a reader waits for one to know
                                          that a pause before it was recorded)

One wake-up every 25 ms costs a few microseconds: it runs always, in every process."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TICK_S = 0.025
PAUSE_FLOOR_S = 0.005  # lateness below this is scheduling noise, not a pause
_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LoopProbe:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.pauses = Histogram(
            "gateway_event_loop_pauses_seconds",
            f"Times the event loop was held by work past a {TICK_S * 1000:g} ms wake-up, over "
            f"{PAUSE_FLOOR_S * 1000:g} ms (its thread's CPU time; the OS's waits excluded)",
            buckets=_BUCKETS,
            registry=registry,
        )
        self.longest = Gauge(
            "gateway_event_loop_max_pause_seconds",
            "The longest the event loop was held by work, since the process started",
            registry=registry,
        )
        self.ticks = Counter(
            "gateway_event_loop_probe_ticks", "Wake-ups of the event loop's pause probe", registry=registry
        )
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._max = 0.0

    def ensure_running(self) -> None:
        """Start the probe on the running loop, once (again only on another loop: tests)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._task is not None and not self._task.done():
            return
        self._loop = loop
        self._task = loop.create_task(self._run(), name="loop-probe")

    async def _run(self) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        while True:
            await asyncio.sleep(TICK_S)
            now_wall, now_cpu = time.perf_counter(), time.thread_time()
            late = now_wall - wall - TICK_S
            pause = min(late, now_cpu - cpu)
            wall, cpu = now_wall, now_cpu
            self.ticks.inc()
            if pause > PAUSE_FLOOR_S:
                self.pauses.observe(pause)
                if pause > self._max:
                    self._max = pause
                    self.longest.set(pause)
