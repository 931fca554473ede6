"""The llm_engine's gauges (model_repo/local/llm_engine/1/gauges.py), pure logic: each set
is a round trip to Triton's server process with the GIL held, so a gauge is set only when
its value changed, at most once a period while the engine runs, and at once when it goes
idle or leaves idle."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "model_repo" / "local" / "llm_engine" / "1"))

from gauges import Gauges


class Gauge:
    def __init__(self) -> None:
        self.values: list[float] = []

    def set(self, value: float) -> None:
        self.values.append(value)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gauges(clock: Clock) -> tuple[Gauges, dict[str, Gauge]]:
    sets = {"active": Gauge(), "used": Gauge()}
    return Gauges(sets, period=0.05, clock=clock), sets


def report_if_due(reporter: Gauges, values: dict[str, float], idle: bool) -> bool:
    if reporter.due(idle):
        reporter.report(values, idle)
        return True
    return False


def test_a_running_engine_sets_its_gauges_at_most_once_a_period() -> None:
    clock = Clock()
    reporter, sets = gauges(clock)
    assert report_if_due(reporter, {"active": 1, "used": 1}, idle=False)  # the first report after idle
    reported = []
    for step in range(2, 102):  # 100 steps of 1 ms
        clock.now += 0.001
        reported.append(report_if_due(reporter, {"active": step, "used": step}, idle=False))
    assert sum(reported) == 2  # at 50 and 100 ms
    assert len(sets["active"].values) == 3


def test_a_gauge_is_set_only_when_its_value_changed() -> None:
    clock = Clock()
    reporter, sets = gauges(clock)
    for step in range(10):
        clock.now += 1
        report_if_due(reporter, {"active": 4, "used": step}, idle=False)
    assert sets["active"].values == [4]
    assert sets["used"].values == list(range(10))


def test_the_idle_state_and_the_first_state_after_it_are_set_at_once() -> None:
    clock = Clock()
    reporter, sets = gauges(clock)
    assert report_if_due(reporter, {"active": 3, "used": 3}, idle=False)
    clock.now += 0.001
    assert report_if_due(reporter, {"active": 0, "used": 0}, idle=True)  # the work is done
    clock.now += 0.001
    assert report_if_due(reporter, {"active": 1, "used": 1}, idle=False)  # new work began
    clock.now += 0.001
    assert not report_if_due(reporter, {"active": 2, "used": 2}, idle=False)
    assert sets["active"].values == [3, 0, 1]
