"""What a Redis did over a measured window, from INFO read before and after it: the
commands it ran (INFO commandstats, which counts the commands run inside Lua scripts as
well as the EVALSHA that ran them), the time it spent executing them, its CPU
(used_cpu_sys + used_cpu_user) and the bytes it read and wrote (replication included)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis


@dataclass
class RedisSample:
    """INFO of one Redis at one instant."""

    info: dict[str, Any]  # INFO all
    calls: Counter[str] = field(default_factory=Counter)  # commandstats: calls per command
    usec: Counter[str] = field(default_factory=Counter)  # commandstats: microseconds per command

    @classmethod
    def read(cls, client: redis.Redis) -> RedisSample:
        info = client.info("all")  # one call: the window counts one INFO of its own
        sample = cls(info)
        for name, stat in info.items():
            if name.startswith("cmdstat_"):
                sample.calls[name.removeprefix("cmdstat_")] += int(stat["calls"])
                sample.usec[name.removeprefix("cmdstat_")] += int(stat["usec"])
        return sample

    @classmethod
    def at(cls, url: str) -> RedisSample:
        client = redis.Redis.from_url(url, decode_responses=True)
        try:
            return cls.read(client)
        finally:
            client.close()


@dataclass
class RedisWindow:
    """What Redis did between two samples (summed over nodes with `+`)."""

    calls: Counter[str] = field(default_factory=Counter)
    cpu_s: float = 0.0
    bytes_in: float = 0.0
    bytes_out: float = 0.0
    # microseconds executing each command (an EVALSHA's include the commands its script ran)
    usec: Counter[str] = field(default_factory=Counter)

    @classmethod
    def between(cls, before: RedisSample, after: RedisSample) -> RedisWindow:
        def delta(name: str) -> float:
            return float(after.info.get(name, 0)) - float(before.info.get(name, 0))

        calls = after.calls.copy()
        calls.subtract(before.calls)
        calls["info"] -= 1  # the first sample's own
        usec = after.usec.copy()
        usec.subtract(before.usec)
        return cls(
            calls=+calls,
            cpu_s=delta("used_cpu_sys") + delta("used_cpu_user"),
            bytes_in=delta("total_net_input_bytes"),
            bytes_out=delta("total_net_output_bytes"),
            usec=+usec,
        )

    def __add__(self, other: RedisWindow) -> RedisWindow:
        return RedisWindow(
            self.calls + other.calls,
            self.cpu_s + other.cpu_s,
            self.bytes_in + other.bytes_in,
            self.bytes_out + other.bytes_out,
            self.usec + other.usec,
        )

    @property
    def exec_usec(self) -> float:
        """Microseconds executing commands, all of them (scripts' inner ones counted twice)."""
        return float(sum(self.usec.values()))

    @property
    def commands(self) -> int:
        return sum(self.calls.values())
