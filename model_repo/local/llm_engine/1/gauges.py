"""The engine's gauges, set from its thread after each step, without costing the step.

A Python-backend metric's `set` is a round trip to Triton's server process made with the GIL
held (python_backend's Metric::SendSetValueRequest does not release it), and the engine
reported twelve gauges twice a step: at 128 streams on an H100 they were 42% of the engine
thread's samples holding the GIL (py-spy --gil), and the stub's other threads waited. So a
gauge is set only when its value changed, and at most every `period` seconds while the
engine runs (TensorRT-LLM's backend also reports its statistics on a period). An idle
engine's values go out at once, as do the first ones after idle: what a scrape or a test
reads once the work is done, or once it began, is never stale."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

PERIOD_S = 0.05


class Gauges:
    """gauges: name -> an object with `set(value)` (pb_utils metrics)."""

    def __init__(self, gauges: dict[str, Any], period: float = PERIOD_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.gauges = gauges
        self.period = period
        self.clock = clock
        self._values: dict[str, float] = {}
        self._at = -float("inf")
        self._idle = True

    def due(self, idle: bool) -> bool:
        """Whether to report now; `idle`: nothing runs or waits."""
        return idle or self._idle or self.clock() - self._at >= self.period

    def report(self, values: dict[str, float], idle: bool) -> None:
        """Set the gauges whose value changed (call when `due`)."""
        self._at, self._idle = self.clock(), idle
        for name, value in values.items():
            if self._values.get(name) != value:
                self._values[name] = value
                self.gauges[name].set(value)
