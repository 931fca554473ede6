"""The replica choice for each request.

LLMs on the engine path (policy cache_aware, the default): for each candidate replica,
    cost = prefill_weight * (prompt blocks it would have to prefill)
         + decode_weight * (KV blocks of the requests it is running)
(the form of NVIDIA Dynamo's KV router), where the blocks it already holds come from
the shared prefix index and its active blocks from its scraped metrics plus what this
gateway routed since. When load is badly imbalanced (the most loaded replica has more
than balance_abs requests over the least and more than balance_rel times as many; the
SGLang gateway's rule) the least loaded replica is chosen instead. least_outstanding and
round_robin are there to compare against.

A request with a prompt_cache_key (OpenAI's routing hint for prompts that share a long
prefix) also counts as holding its whole prompt on the replica that last served that key
(per engine model, remembered in the same shared index), so requests with the same key
prefer the same replica unless load is badly imbalanced; its route says reason
"cache_key".

Other models: the replica with the fewest requests in flight from this gateway plus
Triton's queued requests for the model."""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import Counter, Histogram

from gateway.protocol import Route
from gateway.protocol.records import replica_name
from gateway.server.models import ModelAdapter
from gateway.server.models.llm_engine import EngineLlmAdapter, EngineRequest
from gateway.server.replicas import Replica, ReplicaPool
from gateway.server.routing.load import LoadTracker
from gateway.server.routing.prefix_index import PrefixIndex

Policy = Literal["cache_aware", "least_outstanding", "round_robin"]


@dataclass
class RoutingSettings:
    policy: Policy = "cache_aware"
    prefill_weight: float = 1.0
    # With in-flight batching a running request slows a new one far less than prefilling
    # a block does: a replica holding the prefix wins until its decode load is several
    # times the prefill it saves (the imbalance rule takes over beyond that).
    decode_weight: float = 0.25
    balance_abs: float = 8.0
    balance_rel: float = 1.5


@dataclass
class Plan:
    """One request's choice: `choose` picks among the candidates when a slot is free;
    `route` then says why."""

    choose: Callable[[list[Replica]], Replica]
    route: Callable[[], Route | None]
    # Called once the request has left the replica (its load goes with it).
    release: Callable[[], None] = lambda: None


class Router:
    def __init__(
        self,
        pool: ReplicaPool,
        index: PrefixIndex,
        loads: LoadTracker,
        settings: RoutingSettings,
        registry_metrics: Any,
    ) -> None:
        self.pool = pool
        self.index = index
        self.loads = loads
        self.settings = settings
        self._rotation = itertools.count()
        self.decisions = Counter(
            "gateway_route_decisions_total",
            "Replica choices, by reason",
            ["model", "policy", "reason"],
            registry=registry_metrics,
        )
        self.matched = Histogram(
            "gateway_route_prefix_match_ratio",
            "Share of the prompt's blocks the chosen replica held",
            ["model"],
            buckets=(0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
            registry=registry_metrics,
        )

    async def plan(self, adapter: ModelAdapter, prepared: Any, tenant: str = "") -> Plan:
        """tenant: whose request it is (its prompt_cache_key is its own: _cache_key)."""
        if isinstance(adapter, EngineLlmAdapter) and isinstance(prepared, EngineRequest):
            return await self._llm_plan(adapter, prepared, tenant)
        return self._load_plan(adapter)

    # -- LLMs -------------------------------------------------------------------------

    async def _llm_plan(self, adapter: EngineLlmAdapter, prepared: EngineRequest, tenant: str) -> Plan:
        policy = self.settings.policy
        keys = prepared.keys
        prompt_blocks = max(1, math.ceil(len(prepared.prompt_ids) / adapter.tokens_per_block))
        serving = [r.url for r in self.pool.serving(adapter.triton_model)]
        model = adapter.triton_model
        matches = await self.index.matches(model, keys, serving) if policy == "cache_aware" else {}
        cache_key = _cache_key(prepared.parameters.prompt_cache_key, tenant)
        affine: set[str] = set()
        if cache_key is not None and policy == "cache_aware":
            affine = {url for url, n in (await self.index.matches(model, [cache_key], serving)).items() if n}
        chosen: dict[str, Route] = {}
        held: dict[str, int] = {}

        def release() -> None:
            for url, blocks in held.items():
                self.loads.finished(url, blocks)
            held.clear()

        def choose(candidates: list[Replica]) -> Replica:
            if policy == "round_robin":
                ordered = sorted(candidates, key=lambda r: r.url)
                replica = ordered[next(self._rotation) % len(ordered)]
                reason = "rotation"
            elif policy == "least_outstanding":
                replica, reason = self.pool.least_outstanding(candidates), "load"
            else:
                boosted = {**matches, **dict.fromkeys(affine, prompt_blocks)}
                replica, reason = self._cache_aware(candidates, boosted, prompt_blocks)
                if replica.url in affine and reason == "prefix":
                    reason = "cache_key"
            load = self.loads.get(replica.url)
            chosen["route"] = Route(
                replica=replica_name(replica.url),
                policy=policy,
                reason=reason,
                matched_blocks=matches.get(replica.url, 0),
                prompt_blocks=prompt_blocks,
                load=round(load.load, 2),
            )
            blocks = prompt_blocks + prepared.max_tokens // adapter.tokens_per_block
            self.loads.routed(replica.url, blocks)
            held[replica.url] = blocks
            self.index.record(model, keys + ([cache_key] if cache_key is not None else []), replica.url)
            self.decisions.labels(adapter.name, policy, reason).inc()
            self.matched.labels(adapter.name).observe(matches.get(replica.url, 0) / prompt_blocks)
            return replica

        return Plan(choose, lambda: chosen.get("route"), release)

    def _cache_aware(
        self, candidates: list[Replica], matches: dict[str, int], prompt_blocks: int
    ) -> tuple[Replica, str]:
        loads = {r.url: self.loads.get(r.url).load for r in candidates}
        busiest, idlest = max(loads.values()), min(loads.values())
        s = self.settings
        if len(candidates) > 1 and busiest - idlest > s.balance_abs and busiest > s.balance_rel * max(idlest, 1e-9):
            return min(candidates, key=lambda r: (loads[r.url], r.inflight)), "imbalance"

        def cost(replica: Replica) -> tuple[float, float]:
            prefill = prompt_blocks - matches.get(replica.url, 0)
            active = self.loads.get(replica.url).blocks
            return s.prefill_weight * prefill + s.decode_weight * active, loads[replica.url]

        offset = next(self._rotation) % len(candidates)
        rotated = candidates[offset:] + candidates[:offset]  # ties go round
        replica = min(rotated, key=cost)
        return replica, "prefix" if matches.get(replica.url, 0) > 0 else "load"

    # -- other models ---------------------------------------------------------------

    def _load_plan(self, adapter: ModelAdapter) -> Plan:
        chosen: dict[str, Route] = {}

        def choose(candidates: list[Replica]) -> Replica:
            def load(replica: Replica) -> float:
                return replica.inflight + self.loads.get(replica.url).pending.get(adapter.triton_model, 0.0)

            offset = next(self._rotation) % len(candidates)
            rotated = candidates[offset:] + candidates[:offset]
            replica = min(rotated, key=load)
            chosen["route"] = Route(
                replica=replica_name(replica.url), policy="load", reason="load", load=round(load(replica), 2)
            )
            self.decisions.labels(adapter.name, "load", "load").inc()
            return replica

        return Plan(choose, lambda: chosen.get("route"))


def _cache_key(value: str | None, tenant: str) -> bytes | None:
    """The prefix-index key of a tenant's prompt_cache_key (apart from every block key:
    those hash token blocks, this one a tagged string). Keyed by the tenant: another
    tenant sending the same string gets another key, so it can neither tell from its
    route's reason whether the string was used nor steer load onto the replica it names."""
    if not value:
        return None
    return hashlib.blake2b(
        value.encode("utf-8"), digest_size=16, key=tenant.encode("utf-8")[:64], person=b"prompt_cache_key"
    ).digest()
