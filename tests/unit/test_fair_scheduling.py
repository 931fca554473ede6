"""The dispatcher's side of the scheduling policy (gateway/server/dispatch/scheduler.py),
pure logic: the headroom kept for light tenants (step 5) and the rotation over shards. The
fair queue itself (steps 1-4: bands, virtual time growing by 1/weight) runs inside Redis, in
the TAKE script: tests/test_queue.py tests it against a Redis."""

from __future__ import annotations

from gateway.protocol.redis_keys import Shard
from gateway.server.dispatch.scheduler import Headroom, ShardPlan

WINDOW = 5.0


def _headroom(*tenants: str, model: str = "llm", at: float = 0.0, fraction: float = 0.25) -> Headroom:
    headroom = Headroom(window_s=WINDOW, fraction=fraction)
    for tenant in tenants:
        headroom.touch(model, tenant, now=at)
    return headroom


# -- headroom ------------------------------------------------------------------------------------


def test_a_tenant_alone_keeps_no_slot_back() -> None:
    assert _headroom("heavy").reserve("llm", 8, now=1.0) == 0


def test_one_slot_is_kept_for_each_other_recent_tenant() -> None:
    assert _headroom("heavy", "light").reserve("llm", 8, now=1.0) == 1
    assert _headroom("heavy", "light-1", "light-2").reserve("llm", 8, now=1.0) == 2


def test_the_slots_kept_are_at_most_the_fraction_of_the_models_slots() -> None:
    many = _headroom("heavy", *(f"light-{i}" for i in range(10)))
    assert many.reserve("llm", 8, now=1.0) == 2  # 25 % of 8
    assert many.reserve("llm", 40, now=1.0) == 10  # one per other tenant, below 25 % of 40


def test_a_model_of_a_few_slots_still_keeps_one_for_a_light_tenant() -> None:
    """25 % of 2 or 3 slots rounds down to none: one is kept all the same, or a light
    tenant would wait behind every heavy run. (reserve's docstring says "at most
    `fraction` of the model's slots"; with 2 or 3 slots the code keeps one.)"""
    assert _headroom("heavy", "light").reserve("llm", 2, now=1.0) == 1
    assert _headroom("heavy", "light").reserve("llm", 3, now=1.0) == 1


def test_a_model_of_one_slot_keeps_nothing_back() -> None:
    assert _headroom("heavy", "light").reserve("llm", 1, now=1.0) == 0


def test_a_tenant_not_seen_within_the_window_no_longer_counts() -> None:
    headroom = _headroom("heavy", "light", at=0.0)
    headroom.touch("llm", "heavy", now=WINDOW + 1)
    assert headroom.recent("llm", now=WINDOW + 1) == 1
    assert headroom.reserve("llm", 8, now=WINDOW + 1) == 0


def test_seeing_a_tenant_again_keeps_it_recent_while_those_seen_before_it_expire() -> None:
    headroom = _headroom("a", at=0.0)
    headroom.touch("llm", "b", now=1.0)
    headroom.touch("llm", "a", now=2.0)  # a is now the latest seen
    assert headroom.recent("llm", now=WINDOW + 0.5) == 2  # a at 2.0 and b at 1.0 both within 5 s
    assert headroom.recent("llm", now=WINDOW + 1.5) == 1  # b has expired, a has not
    assert headroom.recent("llm", now=WINDOW + 2.5) == 0


def test_tenants_of_one_model_keep_no_slot_of_another() -> None:
    headroom = _headroom("heavy", "light", model="llm")
    headroom.touch("text_embed", "heavy", now=0.0)
    assert headroom.reserve("llm", 8, now=1.0) == 1
    assert headroom.reserve("text_embed", 8, now=1.0) == 0
    assert headroom.recent("clip", now=1.0) == 0


# -- the rotation over shards ------------------------------------------------------------------


def _plan(count: int = 3) -> ShardPlan:
    return ShardPlan([Shard(index) for index in range(count)])


def _asked(plan: ShardPlan, model: str, times: int) -> list[int | None]:
    """The shards `next` names in `times` calls (None: none)."""
    return [shard.index if (shard := plan.next(model)) is not None else None for _ in range(times)]


def test_no_shard_is_asked_before_work_is_announced_there() -> None:
    plan = _plan()
    assert plan.next("llm") is None
    assert plan.models() == []


def test_only_marked_shards_are_asked() -> None:
    plan = _plan()
    plan.mark(2, "llm")
    assert _asked(plan, "llm", 3) == [2, 2, 2]


def test_marked_shards_are_asked_in_turn_so_a_backlog_starves_none() -> None:
    plan = _plan()
    for shard in (0, 1, 2):
        plan.mark(shard, "llm")
    assert _asked(plan, "llm", 7) == [0, 1, 2, 0, 1, 2, 0]


def test_the_turn_goes_on_after_the_shard_last_asked() -> None:
    plan = _plan(4)
    plan.mark(1, "llm")
    assert _asked(plan, "llm", 1) == [1]
    plan.mark(0, "llm")
    plan.mark(3, "llm")
    assert _asked(plan, "llm", 3) == [3, 0, 1]


def test_a_shard_cleared_after_an_empty_take_is_no_longer_asked() -> None:
    plan = _plan()
    plan.mark(0, "llm")
    plan.mark(1, "llm")
    plan.clear(0, "llm")
    assert _asked(plan, "llm", 2) == [1, 1]
    plan.clear(1, "llm")
    assert plan.next("llm") is None
    assert plan.models() == []


def test_each_model_has_its_own_marks_and_turn() -> None:
    plan = _plan()
    plan.mark_all(["llm", "text_embed"])
    assert _asked(plan, "llm", 2) == [0, 1]
    assert _asked(plan, "text_embed", 1) == [0]
    plan.forget("llm")
    assert plan.next("llm") is None
    assert plan.models() == ["text_embed"]
