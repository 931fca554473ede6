"""Group commit (gateway/common/redis.py GroupCommit) against a real Redis: a call made while
nothing is pending goes at once from its caller's task, the script calls made while one is
in flight go together as one pipeline, and each caller gets its own reply or error, as if
it had called alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import ResponseError

from gateway.common.redis import GroupCommit
from tests.conftest import lone_redis

ECHO = """
if ARGV[1] == 'bad' then return redis.error_reply('refused: ' .. ARGV[1]) end
redis.call('INCR', KEYS[1])
return ARGV[1]
"""


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with lone_redis(tmp_path_factory, "group-redis") as url:
        yield url


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url, decode_responses=True, client_name="group-test", max_connections=100)
    yield client
    await client.aclose()


async def connections(client: Redis) -> int:
    """The connections Redis has from the client under test (CLIENT LIST, by name)."""
    return sum(1 for c in await client.client_list() if c.get("name") == "group-test")


async def test_the_calls_of_one_turn_go_in_two_pipelines_at_most(client: Redis) -> None:
    group = GroupCommit(client)
    echo = AsyncScript(client, ECHO)
    replies = await asyncio.gather(*(group.call(echo, ["counter"], [str(i)]) for i in range(50)))
    assert replies == [str(i) for i in range(50)]
    # The first alone (nothing was pending), the 49 made while it was in flight together.
    assert await connections(client) <= 2
    assert await client.get("counter") == "50"


async def test_calls_alone_take_a_connection_each(client: Redis) -> None:
    # The reference: the same calls without a group commit, each a round trip of its own.
    echo = AsyncScript(client, ECHO)
    await asyncio.gather(*(echo(keys=["alone"], args=[str(i)]) for i in range(50)))
    assert await connections(client) > 1


async def test_each_caller_gets_its_own_reply_or_error(client: Redis) -> None:
    group = GroupCommit(client)
    echo = AsyncScript(client, ECHO)
    answers = await asyncio.gather(
        group.call(echo, ["mixed"], ["one"]),
        group.call(echo, ["mixed"], ["bad"]),
        group.call(echo, ["mixed"], ["three"]),
        return_exceptions=True,
    )
    assert answers[0] == "one" and answers[2] == "three"
    assert isinstance(answers[1], ResponseError) and "refused: bad" in str(answers[1])


async def test_a_script_redis_forgot_is_loaded_and_sent_again(client: Redis) -> None:
    group = GroupCommit(client)
    echo = AsyncScript(client, ECHO)
    assert await group.call(echo, ["flushed"], ["before"]) == "before"
    await client.script_flush()  # as after a restart
    assert await asyncio.gather(group.call(echo, ["flushed"], ["a"]), group.call(echo, ["flushed"], ["b"])) == [
        "a",
        "b",
    ]
    assert await client.get("flushed") == "3"


async def test_replicated_calls_end_with_one_wait_for_all(client: Redis) -> None:
    # This Redis has no replicas: WAIT answers 0 after its timeout, for every caller.
    group = GroupCommit(client, wait_replicas=1, wait_timeout_ms=50)
    echo = AsyncScript(client, ECHO)
    answers = await asyncio.gather(*(group.call(echo, ["waited"], [str(i)], wait=True) for i in range(5)))
    assert answers == [(str(i), 0) for i in range(5)]


async def test_a_caller_that_stops_waiting_leaves_the_others_their_replies(client: Redis) -> None:
    group = GroupCommit(client)
    echo = AsyncScript(client, ECHO)
    gone = asyncio.ensure_future(group.call(echo, ["left"], ["gone"]))
    staying = asyncio.ensure_future(group.call(echo, ["left"], ["staying"]))
    gone.cancel()
    assert await staying == "staying"
    assert gone.cancelled()


# A script made for many items: KEYS[1] and ARGV[1] shared (the head), then one key and one
# argument an item; it answers per item, and counts its calls in `calls`.
MANY = """
redis.call('INCR', 'calls')
local out = {}
for i = 2, #KEYS do
  redis.call('RPUSH', KEYS[i], ARGV[1] .. ARGV[i])
  out[#out + 1] = ARGV[1] .. ARGV[i]
end
return out
"""


def many_script(client: Redis, most: int = 64) -> AsyncScript:
    script = AsyncScript(client, MANY)
    script.head, script.most = (1, 1), most  # type: ignore[attr-defined]
    return script


async def test_calls_of_a_many_items_script_ready_together_become_one_call(client: Redis) -> None:
    await client.delete("calls")
    group = GroupCommit(client)
    many = many_script(client)
    replies = await asyncio.gather(*(group.call(many, ["shared", f"item{i}"], ["x:", str(i)]) for i in range(10)))
    assert replies == [[f"x:{i}"] for i in range(10)]  # each its own item's reply, as if alone
    assert await client.get("calls") == "2"  # the first alone (nothing was pending), then 9 in one
    assert [await client.lrange(f"item{i}", 0, -1) for i in range(10)] == [[f"x:{i}"] for i in range(10)]


async def test_only_calls_with_the_same_head_are_merged(client: Redis) -> None:
    await client.delete("calls")
    group = GroupCommit(client)
    many = many_script(client)
    replies = await asyncio.gather(
        *(group.call(many, ["shared", f"h{i}"], [head, str(i)]) for i, head in enumerate(["a:", "b:", "a:", "b:"]))
    )
    assert replies == [["a:0"], ["b:1"], ["a:2"], ["b:3"]]
    assert await client.get("calls") == "3"  # a:0 alone (nothing was pending); then b:1 b:3, and a:2


async def test_a_merged_call_carries_at_most_its_scripts_most_items(client: Redis) -> None:
    await client.delete("calls")
    group = GroupCommit(client)
    many = many_script(client, most=4)
    replies = await asyncio.gather(*(group.call(many, ["shared", f"m{i}"], ["y:", str(i)]) for i in range(10)))
    assert replies == [[f"y:{i}"] for i in range(10)]
    assert await client.get("calls") == "4"  # 1 alone (nothing was pending), then 4 + 4 + 1


async def test_merged_replicated_calls_each_get_the_waits_count(client: Redis) -> None:
    group = GroupCommit(client, wait_replicas=1, wait_timeout_ms=50)
    many = many_script(client)
    answers = await asyncio.gather(
        *(group.call(many, ["shared", f"w{i}"], ["z:", str(i)], wait=True) for i in range(3))
    )
    assert answers == [([f"z:{i}"], 0) for i in range(3)]


async def test_a_caller_that_stops_waiting_leaves_the_others_of_its_merged_call_their_replies(client: Redis) -> None:
    group = GroupCommit(client)
    many = many_script(client)
    gone = asyncio.ensure_future(group.call(many, ["shared", "g0"], ["v:", "gone"]))
    staying = asyncio.ensure_future(group.call(many, ["shared", "g1"], ["v:", "staying"]))
    gone.cancel()
    assert await staying == ["v:staying"]
    assert gone.cancelled()


async def test_a_call_whose_caller_stopped_waiting_before_the_flush_is_not_sent(client: Redis) -> None:
    await client.delete("abandoned", "kept")
    group = GroupCommit(client)
    echo = AsyncScript(client, ECHO)
    first = asyncio.ensure_future(group.call(echo, ["kept"], ["first"]))  # in flight: the next gathers
    gone = asyncio.ensure_future(group.call(echo, ["abandoned"], ["gone"]))
    await asyncio.sleep(0)  # both calls are made: the first sent, the other waiting for the flush
    gone.cancel()
    assert await first == "first"
    assert await group.call(echo, ["kept"], ["staying"]) == "staying"
    assert await client.get("abandoned") is None


async def test_merged_calls_carry_at_most_a_megabyte_of_arguments(client: Redis) -> None:
    await client.delete("calls")
    group = GroupCommit(client)
    many = many_script(client)
    payload = "p" * (300 * 1024)
    replies = await asyncio.gather(*(group.call(many, ["shared", f"big{i}"], ["", payload]) for i in range(8)))
    assert all(reply == [payload] for reply in replies)
    # 1 alone (nothing was pending), then 3 + 3 + 1 items of 300 KB, not one call of 2.1 MB
    assert await client.get("calls") == "4"


async def test_a_lone_call_is_sent_from_its_callers_task(client: Redis) -> None:
    group = GroupCommit(client)
    echo = AsyncScript(client, ECHO)
    assert await group.call(echo, ["lone"], ["warm"]) == "warm"  # its connection made
    loop = asyncio.get_running_loop()
    made: list[str] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        made.append(coro.__qualname__)
        return asyncio.Task(coro, loop=loop, **kwargs)

    previous = loop.get_task_factory()
    loop.set_task_factory(factory)
    try:
        assert await group.call(echo, ["lone"], ["alone"]) == "alone"
    finally:
        loop.set_task_factory(previous)
    assert made == []  # no sender task: it went out from this one
