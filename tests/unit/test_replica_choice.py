"""The replica choice's arithmetic, pure logic: the cache-aware cost of
gateway/server/routing/router.py (prefill_weight * blocks to prefill + decode_weight * blocks
in use, and the imbalance rule), the load read from Triton's metrics
(gateway/server/routing/load.py) and a replica's per-model limit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from gateway.server.replicas import Replica
from gateway.server.routing.load import ReplicaLoad, parse, samples
from gateway.server.routing.router import Router, RoutingSettings


@dataclass
class _Loads:
    """A LoadTracker's `get`, over loads set by the test."""

    loads: dict[str, ReplicaLoad] = field(default_factory=dict)

    def get(self, replica: str) -> ReplicaLoad:
        return self.loads.setdefault(replica, ReplicaLoad())


def _router(loads: dict[str, ReplicaLoad], **settings: Any) -> Router:
    return Router(None, None, _Loads(loads), RoutingSettings(**settings), CollectorRegistry())  # type: ignore[arg-type]


def _replica(url: str, inflight: int = 0) -> Replica:
    return Replica(url=url, client=None, max_inflight=8, inflight=inflight)  # type: ignore[arg-type]


def _load(requests: float = 0, blocks: float = 0) -> ReplicaLoad:
    return ReplicaLoad(others_requests=requests, others_blocks=blocks)


A, B, C = "a:8001", "b:8001", "c:8001"


# -- the cache-aware cost ------------------------------------------------------------------------


def test_the_replica_holding_more_of_the_prompt_is_chosen() -> None:
    router = _router({A: _load(), B: _load()})
    replica, reason = router._cache_aware([_replica(A), _replica(B)], {B: 6}, prompt_blocks=8)
    assert (replica.url, reason) == (B, "prefix")


def test_without_a_match_the_replica_with_fewer_blocks_in_use_is_chosen() -> None:
    router = _router({A: _load(requests=1, blocks=12), B: _load(requests=1, blocks=4)})
    replica, reason = router._cache_aware([_replica(A), _replica(B)], {}, prompt_blocks=8)
    assert (replica.url, reason) == (B, "load")


def test_a_prefix_wins_until_its_replicas_decode_load_outweighs_the_prefill_it_saves() -> None:
    """Cost = 1.0 * blocks to prefill + 0.25 * blocks in use. A holds 8 of 10 blocks: it
    saves 8 blocks of prefill, worth 32 blocks in use."""
    candidates = [_replica(A), _replica(B)]
    below = _router({A: _load(requests=2, blocks=31), B: _load(requests=2, blocks=0)})
    assert below._cache_aware(candidates, {A: 8}, prompt_blocks=10)[0].url == A  # 2 + 7.75 < 10
    above = _router({A: _load(requests=2, blocks=33), B: _load(requests=2, blocks=0)})
    assert above._cache_aware(candidates, {A: 8}, prompt_blocks=10) == (candidates[1], "load")  # 2 + 8.25 > 10


def test_the_weights_of_the_cost_are_the_settings() -> None:
    loads = {A: _load(requests=2, blocks=8), B: _load(requests=2, blocks=0)}
    candidates = [_replica(A), _replica(B)]
    # Prefill weighs nothing: only the blocks in use count, and B has none.
    assert _router(loads, prefill_weight=0.0)._cache_aware(candidates, {A: 4}, prompt_blocks=4)[0].url == B
    # Decode weighs nothing: only the prefill counts, and A holds the prompt.
    assert _router(loads, decode_weight=0.0)._cache_aware(candidates, {A: 4}, prompt_blocks=4)[0].url == A


def test_equal_costs_go_to_the_less_loaded_replica() -> None:
    router = _router({A: _load(requests=3), B: _load(requests=1)})
    assert router._cache_aware([_replica(A), _replica(B)], {}, prompt_blocks=4)[0].url == B


def test_equal_costs_and_loads_go_round_the_replicas() -> None:
    router = _router({A: _load(), B: _load(), C: _load()})
    candidates = [_replica(A), _replica(B), _replica(C)]
    chosen = [router._cache_aware(candidates, {}, prompt_blocks=4)[0].url for _ in range(6)]
    assert sorted(chosen) == [A, A, B, B, C, C]


def test_a_badly_imbalanced_load_goes_to_the_least_loaded_replica_whatever_it_holds() -> None:
    """More than balance_abs (8) requests over the least loaded and more than balance_rel
    (1.5) times as many."""
    router = _router({A: _load(requests=20), B: _load(requests=2), C: _load(requests=5)})
    candidates = [_replica(A), _replica(B), _replica(C)]
    assert router._cache_aware(candidates, {A: 8}, prompt_blocks=8) == (candidates[1], "imbalance")


def test_an_imbalance_within_balance_abs_requests_is_not_one() -> None:
    router = _router({A: _load(requests=10), B: _load(requests=2)})  # 8 more: not more than 8
    assert router._cache_aware([_replica(A), _replica(B)], {A: 8}, prompt_blocks=8)[1] == "prefix"


def test_an_imbalance_within_balance_rel_times_is_not_one() -> None:
    router = _router({A: _load(requests=30), B: _load(requests=21)})  # 9 more, but 30 < 1.5 * 21
    assert router._cache_aware([_replica(A), _replica(B)], {A: 8}, prompt_blocks=8)[1] == "prefix"


def test_among_the_least_loaded_the_imbalance_rule_takes_the_one_with_fewer_in_flight() -> None:
    router = _router({A: _load(requests=20), B: _load(requests=1), C: _load(requests=1)})
    candidates = [_replica(A), _replica(B, inflight=3), _replica(C, inflight=1)]
    assert router._cache_aware(candidates, {}, prompt_blocks=8) == (candidates[2], "imbalance")


def test_one_candidate_is_chosen_by_cost_never_by_imbalance() -> None:
    router = _router({A: _load(requests=50)})
    assert router._cache_aware([_replica(A)], {}, prompt_blocks=8)[1] == "load"


def test_a_replicas_load_is_its_own_requests_and_blocks_plus_the_other_gateways() -> None:
    load = ReplicaLoad(own_requests=2, own_blocks=10, others_requests=3.0, others_blocks=7.0)
    assert (load.load, load.blocks) == (5.0, 17.0)


# -- the load read from Triton's metrics ---------------------------------------------------------

METRICS = """\
# HELP nv_trt_llm_request_metrics TRT LLM request metrics
nv_trt_llm_request_metrics{model="llm_engine",request_type="scheduled",version="1"} 3
nv_trt_llm_request_metrics{model="llm_engine",request_type="waiting",version="1"} 2
nv_trt_llm_request_metrics{model="llm_engine",request_type="active",version="1"} 4
nv_trt_llm_request_metrics{model="llm_engine",request_type="max",version="1"} 8
nv_trt_llm_request_metrics{model="other_engine",request_type="active",version="1"} 1
nv_trt_llm_request_metrics{model="other_engine",request_type="max",version="1"} 0
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="llm_engine",version="1"} 40
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="llm_engine",version="1"} 256
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="reused",model="llm_engine",version="1"} 12
nv_inference_pending_request_count{model="text_embed",version="1"} 5
nv_inference_request_success{model="text_embed",version="1"} 1000
nv_trt_llm_request_metrics{model="broken",request_type="max",version="1"} not-a-number
"""


def test_requests_in_an_engine_are_the_scheduled_and_waiting_ones_when_it_reports_them() -> None:
    load = parse(METRICS)
    assert load.engine_requests == {"llm_engine": 5.0}  # 3 scheduled + 2 waiting, not the 4 active


def test_an_engines_capacity_counts_only_when_it_reports_one_above_zero() -> None:
    assert parse(METRICS).capacity == {"llm_engine": 8.0}


def test_kv_blocks_and_pending_requests_are_read_per_kind() -> None:
    load = parse(METRICS)
    assert (load.used_blocks, load.max_blocks, load.reused_blocks) == (40.0, 256.0, 12.0)
    assert load.pending == {"text_embed": 5.0}


def test_an_engine_reporting_only_active_requests_counts_those() -> None:
    text = 'nv_trt_llm_request_metrics{model="m",request_type="active",version="1"} 6\n'
    assert parse(text).requests == 6.0


def test_lines_of_other_families_and_unreadable_values_are_skipped() -> None:
    names = {name for name, _, _ in samples(METRICS)}
    assert "nv_inference_request_success" not in names
    assert all(labels.get("model") != "broken" for _, labels, _ in samples(METRICS))


# -- a replica's limit ---------------------------------------------------------------------------


def test_a_replicas_limit_is_its_own_unless_the_engine_runs_fewer() -> None:
    replica = _replica(A)
    assert replica.limit("llm_engine") == 8
    replica.engine_limits = {"llm_engine": 3}
    assert (replica.limit("llm_engine"), replica.limit("text_embed")) == (3, 8)
    replica.engine_limits = {"llm_engine": 20}
    assert replica.limit("llm_engine") == 8


def test_an_engines_free_capacity_is_split_between_the_live_gateways() -> None:
    from gateway.server.routing.load import engine_limit

    # 64 slots, 4 used by others, none by us: alone we may take 60; one of four, 15 each.
    assert engine_limit(64, in_engine=4, own=0, gateways=1) == 60
    assert engine_limit(64, in_engine=4, own=0, gateways=4) == 15
    # What we run now stays ours; a full engine still lets one through.
    assert engine_limit(64, in_engine=40, own=20, gateways=2) == 32
    assert engine_limit(8, in_engine=8, own=0, gateways=3) == 1
