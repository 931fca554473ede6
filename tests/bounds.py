"""What a hostile input made a gateway process do, read from inside it: the event loop's
pauses (its probe's histogram on /metrics, gateway.server.api.loop_probe) and the peak
resident memory of the process and its children, before and after."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

PAUSES = "gateway_event_loop_pauses_seconds"
TICKS = "gateway_event_loop_probe_ticks"


def _samples(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=60).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in (PAUSES, TICKS):
            for sample in family.samples:
                key = sample.name + (f"|{sample.labels['le']}" if "le" in sample.labels else "")
                found[key] = sample.value
    assert f"{PAUSES}_count" in found, "the gateway exposes no loop pause histogram"
    return found


def pauses_over(url: str, seconds: float) -> int:
    """How many times the process's loop was held longer than `seconds` (a bucket bound),
    once its probe has woken since this was asked (so a pause before it is counted)."""
    ticks = _samples(url)[f"{TICKS}_total"]
    deadline = time.monotonic() + 60
    while (found := _samples(url))[f"{TICKS}_total"] < ticks + 2:
        assert time.monotonic() < deadline, "the loop probe did not wake"
    return int(found[f"{PAUSES}_count"] - found[f"{PAUSES}_bucket|{seconds}"])


def peak_rss(pid: int) -> int:
    """The peak resident memory (VmHWM) of a process and its children, in bytes."""
    parent = psutil.Process(pid)
    total = 0
    for process in (parent, *parent.children(recursive=True)):
        for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) * 1024
    return total


@dataclass
class Watched:
    pauses: int = 0  # loop pauses over 100 ms
    grown: int = 0  # peak RSS growth, bytes


class Watch:
    """`with Watch(url, pid) as seen:` ... then seen.pauses and seen.grown."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid, self.seen = url, pid, Watched()

    def __enter__(self) -> Watched:
        self._pauses = pauses_over(self.url, 0.1)
        self._rss = peak_rss(self.pid)
        return self.seen

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.seen.pauses = pauses_over(self.url, 0.1) - self._pauses
            self.seen.grown = peak_rss(self.pid) - self._rss
