"""The structural budget of a lone request (issue 61 item 7), counted by the gateway itself
(REQUEST_COUNTS, gateway/common/counts.py) into the answer's x-gateway-counts header:
tasks created, event-loop iterations it ran in, Redis round trips, gRPC calls, JSON
encodes. Counts are structure, not time: the same at any load, so they are pinned exactly
(a change that adds a task or a round trip to the hot path fails here, and says by how
much)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from gateway.common.counts import parse
from tests.conftest import AUTH

# The targets of docs/DESIGN (issue 61): a lone single-input POST /infer with Prefer: wait
# started in this process: <= 2 tasks, <= 8 loop iterations, 2 Redis round trips, 1 gRPC call.
TARGET = {"tasks": 2, "iterations": 8, "redis": 2, "grpc": 1}
# What it costs now (the header of such a request, tasks counting the HTTP server's own).
# Before issue 61's changes: 9 tasks (GroupCommit._send x2, redis-py's _send_packed_command
# x2, Dispatcher._hold, the runner's BatchedInfer.infer, BatchedInfer._call, grpc.aio's
# UnaryUnaryCall._invoke), 32 iterations, 2 round trips, 1 gRPC call, 5 JSON encodes. With
# lone calls sent from their callers' tasks (the group commit, the shared Triton call):
# 6 tasks, 21-24 iterations; with the runner awaiting the Triton call in the run's own task
# (no task for it): 5 tasks, 19-22 iterations. With the request carried by the call's own
# task (no Dispatcher._hold task, no notifier future between) and Redis writes bounded in
# the writer's task (no wait_for task a write): 2 tasks (the call's, grpc.aio's
# UnaryUnaryCall._invoke), 12-13 iterations; with a call made while nothing is pending
# sent at once (no yield for the turn) and a pooled connection checked without a turn of
# the loop (redis-py's timeout of 0): 6-7 iterations (7 where a reply arrives in two reads).
NOW = {"tasks": 2, "iterations": 7, "json": 5}


@pytest.fixture(scope="module")
def counted(stack) -> Iterator[str]:
    gateway, url = stack.start_gateway("gateway-counts", REQUEST_COUNTS="true")
    try:
        yield url
    finally:
        stack.stop(gateway)


def _lone(url: str, text: str, **headers: str) -> httpx.Response:
    body = {"model": "clip_text", "inputs": {"text": text}}
    return httpx.post(f"{url}/infer", headers={**AUTH, **headers}, json=body, timeout=60)


def _counts_of_lone_waits(url: str) -> list[dict[str, int]]:
    for i in range(3):  # connections, the model's batch size, the key: read once, then kept
        assert _lone(url, f"warm {i}", Prefer="wait=30").status_code == 200
    found = []
    for i in range(3):
        response = _lone(url, f"counted {i}", Prefer="wait=30")
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "succeeded"
        found.append(parse(response.headers["x-gateway-counts"]))
        print(response.headers["x-gateway-counts"], "tasks made:", response.headers["x-gateway-tasks"])
    return found


def test_a_lone_waited_infer_makes_the_redis_round_trips_and_grpc_call_of_its_budget(counted: str) -> None:
    for counts in _counts_of_lone_waits(counted):
        assert counts["redis"] == TARGET["redis"], counts  # SUBMIT (started at once), FINISH
        assert counts["grpc"] == TARGET["grpc"], counts


def test_a_lone_waited_infer_makes_no_more_tasks_and_loop_iterations_than_pinned(counted: str) -> None:
    for counts in _counts_of_lone_waits(counted):
        assert counts["tasks"] <= NOW["tasks"], counts
        assert counts["iterations"] <= NOW["iterations"], counts
        assert counts["json"] <= NOW["json"], counts


def test_a_lone_waited_infer_runs_in_its_budget_of_tasks_and_loop_iterations(counted: str) -> None:
    for counts in _counts_of_lone_waits(counted):
        assert counts["tasks"] <= TARGET["tasks"], counts
        assert counts["iterations"] <= TARGET["iterations"], counts


def test_the_counts_header_is_absent_when_counting_is_off(stack) -> None:
    response = _lone(stack.gateway_url, "uncounted")
    assert response.status_code == 202, response.text
    assert "x-gateway-counts" not in response.headers
