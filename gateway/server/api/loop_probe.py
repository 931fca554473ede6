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
    gateway_event_loop_lag_seconds        how far behind the loop runs now (`lag`)

`lag` is the wake-up's whole lateness, the OS's waits included, smoothed over the last
few wake-ups (an exponential average, each wake-up a quarter of it): about what a
request arriving now waits before its first step, whether the loop is held by its own
work or the process is starved of CPU by others (a small machine's Triton running its
models on the CPU: bench/overload_wait.py measured the gateway given 0.27 of a core and
requests waiting seconds with its own work at no pause). One pause (a collection, one
large parse) moves it a quarter of the pause; a loop that stays behind holds it there.
The edge sheds new requests while it is over MAX_LOOP_LAG_S (gateway.server.api.edge).

One wake-up every 25 ms costs a few microseconds: it runs always, in every process."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TICK_S = 0.025
PAUSE_FLOOR_S = 0.005  # lateness below this is scheduling noise, not a pause
LAG_WEIGHT = 0.25  # a wake-up's share of `lag`
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
        self.lag = 0.0
        Gauge(
            "gateway_event_loop_lag_seconds",
            "How far behind the event loop runs: its probe's wall-clock lateness, smoothed "
            "(MAX_LOOP_LAG_S sheds beyond)",
            registry=registry,
        ).set_function(lambda: self.lag)
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
            self.lag += LAG_WEIGHT * (max(0.0, late) - self.lag)
            self.ticks.inc()
            if pause > PAUSE_FLOOR_S:
                self.pauses.observe(pause)
                if pause > self._max:
                    self._max = pause
                    self.longest.set(pause)
