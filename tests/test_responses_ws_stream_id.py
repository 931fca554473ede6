"""The Responses WebSocket's `stream_id` (the API's WebSocket lane, new since the door was
built): every event of a response created with one echoes it, a failed create's error event
too, and a namespace tool's call streams over the socket under its namespace, against the
real stack with the `openai` package's connection."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.test_openai_responses import NAMESPACE, TRIGGER

TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=stack.api_key, max_retries=0, timeout=120)


def _turn(connection: Any, create: dict[str, Any]) -> list[dict[str, Any]]:
    connection.send({"type": "response.create", **create})
    events: list[dict[str, Any]] = []
    while True:
        events.append(json.loads(connection.recv_bytes()))
        if events[-1]["type"] in TERMINAL:
            return events


def test_every_event_of_a_response_echoes_its_stream_id(client) -> None:
    with client.responses.connect() as connection:
        events = _turn(connection, {"model": "llm_echo", "input": "Hi", "store": False, "stream_id": "lane-1"})
    assert events[-1]["type"] == "response.completed"
    assert {event.get("stream_id") for event in events} == {"lane-1"}


def test_a_refused_create_answers_on_its_stream_id(client) -> None:
    with client.responses.connect() as connection:
        events = _turn(connection, {"model": "no-such-model", "input": "Hi", "stream_id": "lane-2"})
    assert [(event["type"], event.get("stream_id")) for event in events] == [("error", "lane-2")]


def test_a_namespace_call_streams_over_the_socket_under_its_namespace(client) -> None:
    create = {"model": "llm_agent", "input": TRIGGER, "tools": [NAMESPACE], "store": False}
    with client.responses.connect() as connection:
        events = _turn(connection, create)
    (done,) = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    assert (done["type"], done["name"], done["namespace"]) == ("function_call", "close_agent", "multi_agent_v1")
