"""WebSocket mode of the Responses API (GET /v1/responses upgraded), with the official
`openai` client's `client.responses.connect()` unmodified against the real stack: the same
events as SSE (checked against the openai package's types and the Open Responses
specification), responses one after another on one socket, store: false kept for the
connection only (continued there, previous_response_not_found elsewhere, evicted by a
failed continuation), one response in flight per socket, the key checked on the upgrade,
a reconnect resuming after the last sequence number, and the connection's time cap."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import websockets.sync.client as ws_client
from websockets.exceptions import ConnectionClosedOK, InvalidStatus

from tests.test_openai_responses import SPEC, _check_events, _spec_validate, _types

TERMINAL = ("response.completed", "response.incomplete", "response.failed")


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=stack.api_key, max_retries=0, timeout=120)


def _turn(connection: Any) -> list[dict[str, Any]]:
    """The events of one response (or one error event), as JSON."""
    events: list[dict[str, Any]] = []
    while True:
        event = json.loads(connection.recv_bytes())
        events.append(event)
        if event["type"] in TERMINAL or event["type"] == "error":
            return events


def _raw_socket(stack, query: str = "", key: str | None = None) -> ws_client.ClientConnection:
    url = stack.gateway_url.replace("http://", "ws://") + "/v1/responses" + query
    return ws_client.connect(url, additional_headers={"Authorization": f"Bearer {key or stack.api_key}"})


def _prompt(events: list[dict[str, Any]]) -> str:
    """What llm_echo was given (it answers with its prompt)."""
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def test_a_websocket_response_streams_the_same_events_as_sse(client) -> None:
    with client.responses.connect() as connection:
        connection.response.create(model="llm_echo", input="Count from 1 to 3.", max_output_tokens=200)
        events = _turn(connection)
    _check_events(events)
    kinds = _types(events)
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    final = events[-1]["response"]
    _spec_validate(final, "ResponseResource")
    assert final["output"][0]["content"][0]["text"] == _prompt(events)


def test_the_openai_client_parses_websocket_events(client) -> None:
    with client.responses.connect() as connection:
        connection.response.create(model="llm_echo", input="Typed events", max_output_tokens=50)
        types = []
        for event in connection:
            types.append(event.type)
            if event.type == "response.completed":
                assert event.response.output_text
                break
    assert types[0] == "response.created"


def test_responses_follow_one_another_on_one_socket(client) -> None:
    with client.responses.connect() as connection:
        finals = []
        for word in ("first", "second"):
            connection.response.create(
                model="llm_echo", store=False, input=f"Reply with exactly: {word}", max_output_tokens=200
            )
            events = _turn(connection)
            _check_events(events)
            finals.append(events[-1]["response"])
    assert [f["status"] for f in finals] == ["completed", "completed"]
    assert finals[0]["id"] != finals[1]["id"]


def test_a_store_false_response_continues_on_its_socket_only(client) -> None:
    with client.responses.connect() as connection:
        connection.response.create(
            model="llm_echo", store=False, input="The code word is cobalt.", max_output_tokens=300
        )
        first = _turn(connection)[-1]["response"]
        connection.response.create(
            model="llm_echo",
            store=False,
            previous_response_id=first["id"],
            input="What is the code word?",
            max_output_tokens=400,
        )
        second = _turn(connection)
    assert second[-1]["type"] == "response.completed"
    assert "cobalt" in _prompt(second) and "What is the code word?" in _prompt(second)
    # Not kept: unknown over HTTP, and on another socket.
    assert (
        httpx.get(
            f"{client.base_url}responses/{first['id']}", headers={"Authorization": f"Bearer {client.api_key}"}
        ).status_code
        == 404
    )
    with client.responses.connect() as fresh:
        fresh.response.create(
            model="llm_echo", store=False, previous_response_id=first["id"], input="Again?", max_output_tokens=20
        )
        lost = _turn(fresh)
        assert lost[-1]["type"] == "error"
        assert (lost[-1]["status"], lost[-1]["error"]["code"]) == (400, "previous_response_not_found")
        _spec_validate(lost[-1], "WebSocketErrorEvent")
        # The socket stays open: a new chain starts on it.
        fresh.response.create(model="llm_echo", store=False, input="Start over.", max_output_tokens=20)
        assert _turn(fresh)[-1]["type"] in ("response.completed", "response.incomplete")


def test_a_failed_continuation_evicts_the_response_it_named(client) -> None:
    with client.responses.connect() as connection:
        connection.response.create(model="llm_echo", store=False, input="Remember ember.", max_output_tokens=50)
        base = _turn(connection)[-1]["response"]["id"]
        stray = {"type": "function_call_output", "call_id": "call_missing", "output": "no such call"}
        connection.response.create(
            model="llm_echo", store=False, previous_response_id=base, input=[stray], max_output_tokens=20
        )
        failed = _turn(connection)[-1]
        assert failed["type"] == "error" and failed["error"]["param"] == "input[0].call_id"
        connection.response.create(
            model="llm_echo", store=False, previous_response_id=base, input="stale?", max_output_tokens=20
        )
        retry = _turn(connection)[-1]
    assert retry["type"] == "error" and retry["error"]["code"] == "previous_response_not_found"


def test_a_stored_response_continues_on_another_socket(client) -> None:
    with client.responses.connect() as connection:
        connection.response.create(model="llm_echo", input="The colour is teal.", max_output_tokens=200)
        first = _turn(connection)[-1]["response"]
    with client.responses.connect() as other:
        other.response.create(
            model="llm_echo", previous_response_id=first["id"], input="Which colour?", max_output_tokens=400
        )
        events = _turn(other)
    assert events[-1]["type"] == "response.completed" and "teal" in _prompt(events)


def test_one_response_is_in_flight_per_socket(stack) -> None:
    with _raw_socket(stack) as socket:
        create = {"type": "response.create", "model": "llm", "input": "Go on.", "max_output_tokens": 300}
        socket.send(json.dumps(create))
        socket.send(json.dumps(create))
        events = []
        while not any(e["type"] in TERMINAL for e in events):
            events.append(json.loads(socket.recv()))
    refusals = [e for e in events if e["type"] == "error"]
    assert [e["error"]["code"] for e in refusals] == ["response_in_progress"]
    assert sum(1 for e in events if e["type"] == "response.created") == 1


def test_background_and_unknown_events_are_refused_by_name(stack) -> None:
    with _raw_socket(stack) as socket:
        socket.send(json.dumps({"type": "response.create", "model": "llm", "input": "x", "background": True}))
        assert json.loads(socket.recv())["error"]["param"] == "background"
        socket.send(json.dumps({"type": "response.cancel"}))
        assert json.loads(socket.recv())["error"]["code"] == "unsupported_event"
        socket.send(json.dumps({"type": "response.create", "input": "no model"}))
        missing = json.loads(socket.recv())
        assert missing["type"] == "error" and missing["status"] in (400, 422)


def test_an_upgrade_without_a_valid_key_is_refused(stack) -> None:
    with pytest.raises(InvalidStatus) as caught:
        _raw_socket(stack, key="sk-not-a-key")
    assert caught.value.response.status_code == 401
    assert json.loads(caught.value.response.body)["error"]["code"] == "invalid_api_key"


def test_a_reconnect_with_the_last_sequence_number_gets_the_rest(stack) -> None:
    with _raw_socket(stack) as socket:
        socket.send(
            json.dumps(
                {"type": "response.create", "model": "llm_echo", "input": "Resume me " * 20, "max_output_tokens": 200}
            )
        )
        head = [json.loads(socket.recv()) for _ in range(5)]
    response, last = head[0]["response"]["id"], head[-1]["sequence_number"]
    with _raw_socket(stack, f"?response_id={response}&starting_after={last}") as socket:
        tail = []
        while not tail or tail[-1]["type"] not in TERMINAL:
            tail.append(json.loads(socket.recv()))
    events = head + tail
    _check_events(events)  # numbered 0.. without a gap or a repeat
    assert tail[-1]["type"] in ("response.completed", "response.incomplete")
    assert tail[-1]["response"]["output"][0]["content"][0]["text"] == _prompt(events)


WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city now.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
ECHOED = ("tools", "tool_choice", "parallel_tool_calls", "instructions", "temperature", "store")


def test_a_resumed_store_false_response_echoes_the_tools_and_settings_it_was_made_with(stack) -> None:
    asked = {
        "type": "response.create",
        "model": "llm_echo",
        "store": False,
        "tools": [WEATHER_TOOL],
        "tool_choice": "none",
        "parallel_tool_calls": False,
        "instructions": "Be brief.",
        "temperature": 0.5,
        "input": "Resume me " * 20,
        "max_output_tokens": 200,
    }
    with _raw_socket(stack) as socket:
        socket.send(json.dumps(asked))
        head = [json.loads(socket.recv()) for _ in range(5)]
    created = head[0]["response"]
    with _raw_socket(stack, f"?response_id={created['id']}&starting_after={head[-1]['sequence_number']}") as socket:
        tail = []
        while not tail or tail[-1]["type"] not in TERMINAL:
            tail.append(json.loads(socket.recv()))
    _check_events(head + tail)
    resumed = tail[-1]["response"]
    assert {name: resumed[name] for name in ECHOED} == {name: created[name] for name in ECHOED}
    assert resumed["tools"][0]["name"] == "get_weather" and resumed["tool_choice"] == "none"


def test_a_socket_is_closed_at_its_time_cap(stack) -> None:
    _, url = stack.start_gateway("ws-cap", RESPONSES_WS_MAX_S="1")
    socket = ws_client.connect(
        url.replace("http://", "ws://") + "/v1/responses",
        additional_headers={"Authorization": f"Bearer {stack.api_key}"},
    )
    with socket:
        notice = json.loads(socket.recv(timeout=60))
        assert notice["type"] == "error" and notice["error"]["code"] == "websocket_connection_limit_reached"
        with pytest.raises(ConnectionClosedOK):
            socket.recv(timeout=60)
    assert socket.close_code == 1000


def test_the_specification_declares_websocket_mode() -> None:
    if SPEC is None:
        pytest.skip("the Open Responses specification is not beside this checkout")
    assert "x-openresponses-websocket" in SPEC["paths"]["/responses"]
