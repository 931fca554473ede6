"""Live load per replica, scraped from Triton's metrics endpoint every interval_s: the
engine's request counts and KV-cache blocks (TensorRT-LLM's nv_trt_llm_* families,
which the CPU stand-in reports too) and Triton's pending requests per model. Between
scrapes the load of this gateway's own requests is known exactly (routed minus ended),
and the scrape adds what the other gateways have there.

Each scrape also sets the replica's engine limits: for every Triton model that reports
its capacity (`nv_trt_llm_request_metrics{request_type="max"}`: how many requests its
engine runs at once), how many of this gateway's requests it can run beside the other
gateways': what it runs now, plus its part of what is free (capacity less everything
scheduled and waiting, split between the live gateway processes, `engine_limit`; at least
one). The pool keeps this gateway's requests within it, so the gateways together keep
about what the engine runs even when all of them get a burst between two scrapes, and the
fair queue, not the engine's FIFO, orders the rest. A scrape that fails drops the limits
(REPLICA_MAX_INFLIGHT alone). The live processes are counted in Redis (GatewayPresence)
at each scrape.

The loads and limits are used only while this gateway sends requests: with none of its
requests on any replica, it scrapes every IDLE_S only (a restart's empty cache is still
noticed), and again at once when a request takes a replica slot."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.protocol.redis_keys import GATEWAYS_KEY
from gateway.server.replicas import ReplicaPool

log = logging.getLogger(__name__)

# How often an idle gateway (none of its requests on a replica) scrapes.
IDLE_S = 5.0


@dataclass
class ReplicaLoad:
    requests: float = 0.0  # the engine's active + waiting requests (all gateways)
    used_blocks: float = 0.0
    max_blocks: float = 0.0
    reused_blocks: float = 0.0
    pending: dict[str, float] = field(default_factory=dict)  # Triton model -> queued requests
    # Triton model -> requests its engine runs at once, and those it has (scheduled + waiting).
    capacity: dict[str, float] = field(default_factory=dict)
    engine_requests: dict[str, float] = field(default_factory=dict)
    scraped_at: float = 0.0
    # This gateway's own requests on the replica, exact and at once (routed minus ended);
    # the scrape tells what the other gateways add: what it saw beyond our own then.
    own_requests: int = 0
    own_blocks: int = 0
    others_requests: float = 0.0
    others_blocks: float = 0.0

    @property
    def load(self) -> float:
        return self.others_requests + self.own_requests

    @property
    def blocks(self) -> float:
        return self.others_blocks + self.own_blocks


_FAMILIES = ("nv_trt_llm_request_metrics{", "nv_trt_llm_kv_cache_block_metrics{", "nv_inference_pending_request_count{")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of the lines of the families routing reads; every other line
    of Triton's metrics (hundreds, for every model) is skipped without being parsed."""
    for line in text.splitlines():
        if not line.startswith(_FAMILIES):
            continue
        name, _, rest = line.partition("{")
        labels, _, value = rest.rpartition("}")
        try:
            yield name, dict(_LABEL.findall(labels)), float(value.split()[0])
        except (ValueError, IndexError):
            continue


def parse(text: str) -> ReplicaLoad:
    load = ReplicaLoad(scraped_at=time.monotonic())
    requests: dict[str, float] = {}
    per_model: dict[str, dict[str, float]] = {}
    for name, labels, value in samples(text):
        if name == "nv_trt_llm_request_metrics":
            kind = labels.get("request_type", "")
            requests[kind] = requests.get(kind, 0.0) + value
            if "model" in labels:
                per_model.setdefault(labels["model"], {})[kind] = value
        elif name == "nv_trt_llm_kv_cache_block_metrics":
            block = labels.get("kv_cache_block_type")
            if block == "used":
                load.used_blocks += value
            elif block == "max":
                load.max_blocks += value
            elif block == "reused":
                load.reused_blocks += value
        elif name == "nv_inference_pending_request_count" and "model" in labels:
            load.pending[labels["model"]] = value
    load.requests = _in_engine(requests)
    for model, kinds in per_model.items():
        if kinds.get("max", 0.0) > 0:
            load.capacity[model] = kinds["max"]
            load.engine_requests[model] = _in_engine(kinds)
    return load


def _in_engine(kinds: dict[str, float]) -> float:
    """Requests in an engine: scheduled (context and generation) plus waiting to be."""
    if "scheduled" in kinds or "waiting" in kinds:
        return kinds.get("scheduled", 0.0) + kinds.get("waiting", 0.0)
    return kinds.get("active", 0.0)


def engine_limit(capacity: float, in_engine: float, own: int, gateways: int) -> int:
    """How many of this gateway's requests an engine may hold: those it holds, plus its
    part of what is free (capacity less all the engine's requests, split between the live
    gateways: all of them may get a burst before the next scrape); at least one."""
    free = max(0.0, capacity - max(in_engine, own))
    return max(1, own + int(free // max(1, gateways)))


class GatewayPresence:
    """The live gateway processes, in one sorted set of Redis (member: a process's
    consumer name, score: when it last said so): each counts itself in and the others
    still fresh, at every scrape."""

    def __init__(self, redis: Any, name: str, *, key: str = GATEWAYS_KEY, fresh_s: float = 30.0) -> None:
        self.redis, self.name, self.key, self.fresh_s = redis, name, key, fresh_s

    async def count(self) -> int:
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(self.key, {self.name: now})
            pipe.zremrangebyscore(self.key, "-inf", now - self.fresh_s)
            pipe.zcard(self.key)
            *_, count = await pipe.execute()
        return max(1, int(count))

    async def leave(self) -> None:
        await self.redis.zrem(self.key, self.name)


class LoadTracker:
    def __init__(
        self,
        pool: ReplicaPool,
        metrics_url: Callable[[str], str | None],
        *,
        interval_s: float,
        on_reset: Callable[[str], Awaitable[None]],
        presence: GatewayPresence | None = None,
    ) -> None:
        self.pool = pool
        self.presence = presence
        self.gateways = 1  # live gateway processes, this one included (presence's count)
        self.metrics_url = metrics_url
        self.interval_s = interval_s
        self.on_reset = on_reset
        self.loads: dict[str, ReplicaLoad] = {}
        self._http = httpx.AsyncClient(timeout=max(0.5, interval_s * 4))
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.scrape_all()
        self._task = asyncio.create_task(self._run(), name="replica-load")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._http.aclose()
        if self.presence is not None:
            try:  # the others count without it at once rather than when it goes stale
                await self.presence.leave()
            except Exception as exc:
                log.debug("leaving the gateways' count failed: %s", exc)

    def get(self, replica: str) -> ReplicaLoad:
        return self.loads.setdefault(replica, ReplicaLoad())

    def routed(self, replica: str, blocks: int) -> None:
        load = self.get(replica)
        load.own_requests += 1
        load.own_blocks += blocks

    def finished(self, replica: str, blocks: int) -> None:
        load = self.get(replica)
        load.own_requests -= 1
        load.own_blocks -= blocks

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.pool.used.clear()
            if not any(replica.inflight for replica in self.pool.replicas):
                try:  # idle: wait for the next request to take a slot (or IDLE_S)
                    await asyncio.wait_for(self.pool.used.wait(), max(0.0, IDLE_S - self.interval_s))
                except TimeoutError:
                    pass
            try:
                await self.scrape_all()
            except Exception as exc:  # keep the last figures; try again next time
                log.debug("scraping replica metrics failed: %s", exc)

    async def scrape_all(self) -> None:
        if self.presence is not None:
            try:
                self.gateways = await self.presence.count()
            except Exception as exc:  # keep the last count
                log.debug("counting the gateways failed: %s", exc)
        await asyncio.gather(*(self._scrape(r.url) for r in list(self.pool.replicas) if r.healthy))

    async def _scrape(self, replica: str) -> None:
        url = self.metrics_url(replica)
        if url is None:
            return
        pooled = self.pool.get(replica)
        own = dict(pooled.busy) if pooled is not None else {}  # ours in flight as the engine counts
        try:
            response = await self._http.get(url)
            response.raise_for_status()
            fresh = parse(response.text)
        except Exception:
            if pooled is not None and pooled.engine_limits:
                pooled.engine_limits = {}
                await self.pool.limits_changed()
            return
        if pooled is not None:
            limits = {
                model: engine_limit(capacity, fresh.engine_requests.get(model, 0.0), own.get(model, 0), self.gateways)
                for model, capacity in fresh.capacity.items()
            }
            if limits != pooled.engine_limits:
                pooled.engine_limits = limits
                await self.pool.limits_changed()
        previous = self.loads.get(replica)
        if previous is not None:
            fresh.own_requests, fresh.own_blocks = previous.own_requests, previous.own_blocks
        # (Our requests still on their way to the engine make this a slight underestimate.)
        fresh.others_requests = max(0.0, fresh.requests - fresh.own_requests)
        fresh.others_blocks = max(0.0, fresh.used_blocks - fresh.own_blocks)
        self.loads[replica] = fresh
        # A reuse counter that went down, or blocks all free after a restart: an empty cache.
        if previous is not None and fresh.reused_blocks < previous.reused_blocks:
            await self.on_reset(replica)
