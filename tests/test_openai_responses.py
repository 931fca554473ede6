"""The Responses API as agents use it, with the official `openai` package and OpenAI's
Agents SDK, unmodified, against the real stack: response objects and streamed events with
every field, checked against the `openai` package's types and the Open Responses
specification's JSON schema (where the checkout has it: see _spec); function tools (forced
calls, streamed argument events, the caller's results given back with the earlier output);
conversation state kept in MongoDB (previous_response_id across gateways, input_items,
delete, store: false); what is not served refused by name; and an Agent with a function
tool running to its final output, streamed and not.

The LLM here is a tiny random GPT-2 whose text is noise: calls come from forced tool choices
(guided decoding) on the synthetic engine, whose 8192-token context fits tool prompts, and
what a prompt held is read back from llm_echo, which answers with its prompt."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from tests.conftest import AUTH


# The specification's published OpenAPI document, where this checkout has it: the steering
# repository's shared/openresponses/openapi.json (beside the project, as CI lays it), or
# OPENRESPONSES_SPEC. It is third-party material, so the project does not commit a copy;
# without it the shapes are checked against the `openai` package's types alone.
def _spec() -> dict[str, Any] | None:
    beside = Path(__file__).resolve().parents[2] / "shared" / "openresponses" / "openapi.json"
    for path in (os.environ.get("OPENRESPONSES_SPEC"), beside):
        if path and Path(path).exists():
            return json.loads(Path(path).read_text())
    return None


SPEC = _spec()
# The streamed event types of the specification: each type's schema.
EVENT_SCHEMAS = (
    {
        SPEC["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]["properties"]["type"]["enum"][0]: ref["$ref"]
        for ref in SPEC["paths"]["/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"][
            "oneOf"
        ]
    }
    if SPEC
    else {}
)
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)

TOOLS_MODEL = "llm_synthetic"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city now.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
QUESTION = "What is the weather in Paris?"
# The fields OpenAI's response object has that the gateway once left out.
ONCE_MISSING = (
    "completed_at",
    "previous_response_id",
    "instructions",
    "truncation",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "reasoning",
    "max_output_tokens",
    "max_tool_calls",
    "store",
    "safety_identifier",
    "prompt_cache_key",
)


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=stack.api_key, max_retries=0, timeout=120)


def _spec_validate(instance: dict[str, Any], schema: str) -> None:
    """Valid against a schema of the Open Responses specification."""
    if SPEC is None:
        return
    ref = schema if schema.startswith("#/") else f"#/components/schemas/{schema}"
    jsonschema.Draft202012Validator({"$ref": ref, "components": SPEC["components"]}).validate(instance)


def _raw(client: openai.OpenAI, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{client.base_url}{path}", headers=AUTH, json=body, timeout=120)


def _stream(client: openai.OpenAI, **body: Any) -> tuple[bytes, list[dict[str, Any]]]:
    """A streamed create's bytes and its events (as JSON)."""
    with httpx.stream(
        "POST", f"{client.base_url}responses", headers=AUTH, json={**body, "stream": True}, timeout=120
    ) as answer:
        assert answer.status_code == 200, answer.read()
        raw = answer.read()
    return raw, _events(raw)


def _events(raw: bytes) -> list[dict[str, Any]]:
    events = []
    for frame in raw.decode().split("\n\n"):
        data = [line.removeprefix("data: ") for line in frame.split("\n") if line.startswith("data: ")]
        if data:
            events.append(json.loads("\n".join(data)))
    return events


def _types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def _check_events(events: list[dict[str, Any]]) -> None:
    """Numbered from 0, each valid for the specification and the openai package."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        if SPEC is not None:
            _spec_validate(event, EVENT_SCHEMAS[event["type"]])
        STREAM_EVENT.validate_python(event)


def _prompt_of(response) -> str:
    """What llm_echo was given (it answers with its prompt)."""
    return response.output_text


def _until(check, timeout: float = 60, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} not reached in time"
        time.sleep(0.05)


def _tenant_client(stack, name: str) -> openai.OpenAI:
    tenant = f"{name}-{time.time_ns()}"
    created = httpx.post(f"{stack.gateway_url}/admin/keys", headers=AUTH, json={"tenant": tenant}, timeout=30)
    assert created.status_code == 201, created.text
    key = created.json()["key"]
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=key, max_retries=0, timeout=120)


# -- the response object and its events -------------------------------------------------------------


def test_a_response_has_every_field_of_openai_and_the_specification(client) -> None:
    raw = _raw(
        client, "responses", model="llm_echo", input="Say hello.", instructions="Be brief.", max_output_tokens=200
    )
    assert raw.status_code == 200, raw.text
    body = raw.json()
    assert set(ONCE_MISSING) <= set(body)
    assert set(Response.model_fields) <= set(body)  # every field, null where it does not apply
    _spec_validate(body, "ResponseResource")
    response = Response.model_validate(body)
    assert response.status == "completed" and response.completed_at is not None
    assert response.instructions == "Be brief." and response.store is True and response.truncation == "disabled"
    assert (response.temperature, response.top_p, response.max_output_tokens) == (1.0, 1.0, 200)
    assert body["presence_penalty"] == body["frequency_penalty"] == 0.0
    assert response.previous_response_id is None and response.reasoning is None and response.background is False


def test_sampling_settings_are_echoed_as_given(client) -> None:
    response = client.responses.create(
        model="llm",
        input="Hi",
        max_output_tokens=3,
        temperature=0.4,
        top_p=0.9,
        safety_identifier="user-42",
        prompt_cache_key="session-7",
        metadata={"job": "echo"},
    )
    assert (response.temperature, response.top_p) == (0.4, 0.9)
    assert (response.safety_identifier, response.prompt_cache_key) == ("user-42", "session-7")
    assert response.metadata == {"job": "echo"}
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()


def test_a_foreground_stream_is_the_full_event_sequence_with_whole_objects(client) -> None:
    _, events = _stream(client, model="llm_echo", input="Stream me", max_output_tokens=200)
    _check_events(events)
    kinds = _types(events)
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    created, final = events[0]["response"], events[-1]["response"]
    assert (created["status"], created["background"]) == ("in_progress", False)  # never queued, never background
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == text
    assert events[-2]["item"] == final["output"][0]


def test_streamed_events_end_their_lines_with_lf(client) -> None:
    raw, events = _stream(client, model="llm_echo", input="Line ends", max_output_tokens=50)
    assert events and b"\r" not in raw
    assert raw.endswith(b"\n\n")


def test_a_background_create_answers_queued_and_its_stream_says_so_until_it_runs(client) -> None:
    created = client.responses.create(model="llm_echo", input="Later", background=True, max_output_tokens=50)
    assert (created.status, created.background) == ("queued", True)
    _spec_validate(created.model_dump(mode="json"), "ResponseResource")
    _until(lambda: client.responses.retrieve(created.id).status == "completed", what="completed")
    with httpx.stream("GET", f"{client.base_url}responses/{created.id}?stream=true", headers=AUTH) as replay:
        events = _events(replay.read())
    _check_events(events)
    assert _types(events)[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert [e["response"]["status"] for e in events[:3]] == ["queued", "queued", "in_progress"]
    assert all(e["response"]["background"] for e in events if "response" in e)


def test_a_response_cut_by_max_output_tokens_is_incomplete(client) -> None:
    _, events = _stream(client, model="llm_echo", input="one two three four five six", max_output_tokens=3)
    _check_events(events)
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"
    assert client.responses.retrieve(final["response"]["id"]).status == "incomplete"


def test_a_response_cut_by_the_default_cap_names_that_cap(client) -> None:
    # No max_output_tokens: the gateway's default (512) applies, and the response says so.
    response = client.responses.create(model=TOOLS_MODEL, input="Go on and on.", temperature=0)
    assert response.max_output_tokens == 512
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.usage.output_tokens == 512
    assert client.responses.retrieve(response.id).max_output_tokens == 512


def test_a_response_cut_by_the_models_context_names_that_cap(client) -> None:
    # llm's context is 256 tokens: the room after the prompt is the cap that applies.
    response = client.responses.create(model="llm", input="Go on and on.", temperature=0, max_output_tokens=1000)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.max_output_tokens == response.usage.output_tokens < 1000


def test_image_input_is_refused_saying_no_image_model_is_served(client) -> None:
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    answer = _raw(client, "responses", model="llm", input=[{"role": "user", "content": [image]}])
    assert answer.status_code == 400, answer.text
    assert "no model that reads images is served" in answer.json()["error"]["message"]


def test_a_function_call_output_without_its_call_is_refused_naming_it(client) -> None:
    stray = {"type": "function_call_output", "call_id": "call_nowhere", "output": "{}"}
    answer = _raw(client, "responses", model="llm", input=[{"role": "user", "content": "Hi"}, stray])
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "input[1].call_id"


def test_a_json_schema_text_format_is_honoured_and_echoed(client) -> None:
    schema = {
        "type": "object",
        "properties": {"sky": {"type": "string", "enum": ["clear", "rain"]}},
        "required": ["sky"],
        "additionalProperties": False,
    }
    text_format = {"type": "json_schema", "name": "sky", "schema": schema, "strict": True}
    response = client.responses.create(
        model=TOOLS_MODEL, input="The sky?", text={"format": text_format}, max_output_tokens=40
    )
    assert response.text.format.model_dump(by_alias=True, exclude_none=True) == text_format
    jsonschema.validate(json.loads(response.output_text), schema)


# -- function tools -----------------------------------------------------------------------------------


def test_a_forced_function_call_is_a_function_call_output_item(client) -> None:
    response = client.responses.create(
        model=TOOLS_MODEL, input=QUESTION, tools=[WEATHER], tool_choice="required", max_output_tokens=60
    )
    _spec_validate(response.model_dump(mode="json"), "ResponseResource")
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert response.tool_choice == "required" and response.tools[0].name == "get_weather"
    assert response.tools[0].strict is True


def test_a_streamed_function_call_sends_its_arguments_events(client) -> None:
    _, events = _stream(
        client,
        model=TOOLS_MODEL,
        input=QUESTION,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
    )
    _check_events(events)
    assert _types(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done, final = events[2]["item"], events[5]["item"], events[-1]["response"]
    assert (added["type"], added["status"], added["arguments"]) == ("function_call", "in_progress", "")
    assert done["arguments"] == events[4]["arguments"] == events[3]["delta"]
    assert final["output"] == [done] and final["tool_choice"] == {"type": "function", "name": "get_weather"}


def test_the_history_with_the_output_and_the_tools_result_is_valid_input(client) -> None:
    history: list[Any] = [{"role": "user", "content": QUESTION}]
    first = client.responses.create(
        model=TOOLS_MODEL, input=history, tools=[WEATHER], tool_choice="required", max_output_tokens=60
    )
    call = first.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21}'}
    second = client.responses.create(
        model=TOOLS_MODEL,
        input=history + [item.model_dump(exclude_none=True) for item in first.output] + [result],
        tools=[WEATHER],
        max_output_tokens=8,
    )
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its result were in the prompt


def test_function_calls_and_results_are_rendered_into_the_prompt(client) -> None:
    call = {
        "type": "function_call",
        "id": "fc_given",
        "status": "completed",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    result = {"type": "function_call_output", "call_id": "call_1", "output": '{"sky": "clear"}'}
    echoed = client.responses.create(
        model="llm_echo", input=[{"role": "user", "content": QUESTION}, call, result], max_output_tokens=400
    )
    prompt = _prompt_of(echoed)
    block = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    assert f"<|im_start|>assistant\n<tool_call>\n{block}\n</tool_call><|im_end|>" in prompt
    assert '<tool_response>\n{"sky": "clear"}\n</tool_response>' in prompt


def test_max_tool_calls_and_parallel_tool_calls_are_echoed(client) -> None:
    response = client.responses.create(
        model=TOOLS_MODEL,
        input=QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tool_calls=1,
        max_output_tokens=60,
    )
    assert (response.parallel_tool_calls, response.max_tool_calls) == (False, 1)
    assert [item.type for item in response.output] == ["function_call"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "web_search", "external_web_access": True}]}, "tools[0].type"),
        (
            {
                "tools": [
                    {"type": "namespace", "name": "ns", "description": "d", "tools": [{"type": "custom", "name": "c"}]}
                ]
            },
            "tools[0].tools[0].type",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
            "tool_choice.type",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "item_reference", "id": "fc_1"}]}, "input[0].type"),
    ],
)
def test_what_tools_cannot_do_is_refused_naming_it(client, extra, param) -> None:
    answer = _raw(client, "responses", **{"model": TOOLS_MODEL, "input": QUESTION, **extra})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


# -- conversation state ------------------------------------------------------------------------------


def test_previous_response_id_continues_the_conversation_without_its_instructions(client) -> None:
    first = client.responses.create(
        model="llm_echo", input="My name is Ada.", instructions="Rule one.", max_output_tokens=200
    )
    second = client.responses.create(
        model="llm_echo", input="What is my name?", previous_response_id=first.id, max_output_tokens=400
    )
    prompt = _prompt_of(second)
    assert "My name is Ada." in prompt and "What is my name?" in prompt
    # A previous response's instructions do not carry over: "Rule one." is only in the first
    # answer (llm_echo's: its whole prompt), not a system message of the second prompt.
    assert prompt.count("Rule one.") == 1 and _prompt_of(first).startswith("<|im_start|>system\nRule one.")
    assert second.previous_response_id == first.id
    assert prompt.index("My name is Ada.") < prompt.index("What is my name?")


def test_input_items_list_the_chain_then_the_input_newest_first(client) -> None:
    first = client.responses.create(model="llm_echo", input="First.", max_output_tokens=100)
    second = client.responses.create(
        model="llm_echo", input="Second.", previous_response_id=first.id, max_output_tokens=200
    )
    items = client.responses.input_items.list(second.id, order="asc")
    roles = [(item.type, item.role) for item in items.data]
    assert roles == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert items.data[1].id == first.output[0].id
    newest = client.responses.input_items.list(second.id, limit=1)
    assert newest.data[0].content[0].text == "Second." and newest.has_more
    rest = client.responses.input_items.list(second.id, after=newest.last_id)
    assert [item.id for item in rest.data] == [item.id for item in reversed(items.data[:2])]


def test_both_item_lists_refuse_an_include_other_than_the_logprobs(client) -> None:
    response = client.responses.create(model="llm_echo", input="First.", max_output_tokens=10)
    conversation = client.conversations.create(items=[{"role": "user", "content": "Keep me."}])
    for path in (f"responses/{response.id}/input_items", f"conversations/{conversation.id}/items"):
        url = f"{client.base_url}{path}"
        refused = httpx.get(url, headers=AUTH, params={"include[]": "file_search_call.results"}, timeout=60)
        assert refused.status_code == 400, refused.text
        assert (refused.json()["error"]["code"], refused.json()["error"]["param"]) == (
            "unsupported_parameter",
            "include[0]",
        )
        listed = httpx.get(url, headers=AUTH, params={"include[]": "message.output_text.logprobs"}, timeout=60)
        assert listed.status_code == 200, listed.text


def test_a_chain_outlives_the_gateway_that_made_it(stack, client) -> None:
    process, url = stack.start_gateway("responses-restart")
    other = openai.OpenAI(base_url=f"{url}/v1", api_key=stack.api_key, max_retries=0, timeout=120)
    try:
        first = other.responses.create(model="llm_echo", input="Remember 1234.", max_output_tokens=200)
    finally:
        stack.stop(process)
    second = client.responses.create(
        model="llm_echo", input="What number?", previous_response_id=first.id, max_output_tokens=400
    )
    assert "Remember 1234." in _prompt_of(second)
    assert [item.id for item in client.responses.input_items.list(second.id, order="asc").data][:2] == [
        client.responses.input_items.list(first.id).data[0].id,
        first.output[0].id,
    ]


def test_store_false_keeps_nothing(client) -> None:
    response = client.responses.create(model="llm_echo", input="Forget me", store=False, max_output_tokens=50)
    assert response.store is False and response.status == "completed"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(response.id)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="llm_echo", input="Again", previous_response_id=response.id)
    assert caught.value.code == "previous_response_not_found" and caught.value.body["param"] == "previous_response_id"


def test_store_false_leaves_no_inputs_or_outputs_in_the_stored_record(stack, client) -> None:
    from pymongo import MongoClient

    response = client.responses.create(model="llm_echo", input="Forget me too", store=False, max_output_tokens=50)
    request_id = response.id.removeprefix("resp_")
    with MongoClient(stack.mongo_url) as mongo:
        results = mongo[os.environ.get("MONGO_DB", "triton_gateway")]["results"]
        _until(lambda: results.find_one({"_id": request_id}) is not None, what="the record stored")
        document = results.find_one({"_id": request_id})
    assert document["status"] == "succeeded" and document["usage"]["completion_tokens"] > 0  # accounting stays
    assert not document.get("inputs") and not document.get("parameters") and document.get("outputs") is None
    assert "Forget me too" not in json.dumps(document, default=str)


def test_a_deleted_response_can_neither_be_read_nor_continued(client) -> None:
    response = client.responses.create(model="llm_echo", input="Delete me", max_output_tokens=50)
    deleted = _delete(client, response.id)
    assert deleted == {"id": response.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="llm_echo", input="Again", previous_response_id=response.id)
    assert caught.value.code == "previous_response_not_found"


def _delete(client: openai.OpenAI, response_id: str) -> dict[str, Any]:
    answer = httpx.delete(f"{client.base_url}responses/{response_id}", headers=AUTH, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()  # (the SDK's responses.delete answers None: the body is read here)


def test_another_tenants_response_cannot_be_continued(stack, client) -> None:
    mine = client.responses.create(model="llm_echo", input="Private", max_output_tokens=20)
    other = _tenant_client(stack, "responses-other")
    with pytest.raises(openai.BadRequestError) as caught:
        other.responses.create(model="llm_echo", input="Peek", previous_response_id=mine.id)
    assert caught.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(mine.id)


def test_a_conversation_gives_its_items_to_a_response_and_keeps_the_responses_items(client) -> None:
    conversation = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "My name is Ada."}], metadata={"topic": "names"}
    )
    assert conversation.metadata == {"topic": "names"}
    response = client.responses.create(
        model="llm_echo", input="What is my name?", conversation=conversation.id, max_output_tokens=400
    )
    assert "My name is Ada." in _prompt_of(response) and response.conversation.id == conversation.id
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [(item.type, item.role) for item in items] == [
        ("message", "user"),
        ("message", "user"),
        ("message", "assistant"),
    ]
    assert items[-1].id == response.output[0].id
    then = client.responses.create(
        model="llm_echo", input="And now?", conversation=conversation.id, max_output_tokens=400
    )
    assert _prompt_of(response) in _prompt_of(then)  # the first answer is in the conversation


def test_a_conversations_items_can_be_read_and_deleted(client) -> None:
    conversation = client.conversations.create(items=[{"role": "user", "content": "Keep me."}])
    response = client.responses.create(
        model="llm_echo", input="Drop me.", conversation=conversation.id, max_output_tokens=200
    )
    kept, dropped, answer = client.conversations.items.list(conversation.id, order="asc").data
    assert client.conversations.items.retrieve(kept.id, conversation_id=conversation.id).content[0].text == "Keep me."
    client.conversations.items.delete(dropped.id, conversation_id=conversation.id)
    client.conversations.items.delete(answer.id, conversation_id=conversation.id)
    assert [item.id for item in client.conversations.items.list(conversation.id).data] == [kept.id]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(answer.id, conversation_id=conversation.id)
    assert client.responses.retrieve(response.id).output[0].id == answer.id  # the response itself stays


def test_a_deleted_conversation_is_gone(client) -> None:
    conversation = client.conversations.create()
    deleted = client.conversations.delete(conversation.id)
    assert (deleted.id, deleted.deleted) == (conversation.id, True)
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="llm_echo", input="Hi", conversation=conversation.id)
    assert caught.value.body["param"] == "conversation"


def test_conversation_and_previous_response_id_cannot_both_be_given(client) -> None:
    first = client.responses.create(model="llm_echo", input="One", max_output_tokens=20)
    conversation = client.conversations.create()
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model="llm_echo", input="Two", conversation=conversation.id, previous_response_id=first.id
        )
    assert caught.value.body["param"] == "conversation"


# -- what is not served --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
            "input[0].content[0].type",
        ),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["file_search_call.results"]}, "include[0]"),
    ],
)
def test_what_is_not_served_is_refused_in_openais_error_shape(client, extra, param) -> None:
    answer = _raw(client, "responses", **{"model": "llm", "input": "Hi", "max_output_tokens": 2, **extra})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "unsupported_parameter", param)


# The Codex CLI's optional asks (../shared/agent-requests/codex-0.171.0-first-call.json): served
# without them, named in the answer's Warning header where one is not applied.
@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"reasoning": {"summary": "auto"}}, "reasoning"),
        ({"include": ["reasoning.encrypted_content"]}, "include reasoning.encrypted_content"),
        ({"tools": [WEATHER, {"type": "web_search", "external_web_access": False}]}, "web_search"),
        ({"client_metadata": {"session_id": "s-1", "x-codex-turn-metadata": "{}"}}, None),
        ({"prompt_cache_key": "a-uuid"}, None),
    ],
)
def test_an_optional_ask_is_served_without_it_and_named_in_a_warning(client, extra, named) -> None:
    raw = client.responses.with_raw_response.create(
        model=TOOLS_MODEL, input="Hi", max_output_tokens=2, store=False, extra_body=extra
    )
    response = raw.parse()
    assert response.status in ("completed", "incomplete")
    assert all(item.type != "reasoning" for item in response.output)  # (the include honoured as empty)
    if named is None:
        assert "warning" not in raw.headers
    else:
        assert (
            raw.headers["warning"].startswith('299 - "accepted and not applied: ') and named in raw.headers["warning"]
        )


def test_a_web_search_the_client_can_do_without_is_not_offered_to_the_model(client) -> None:
    search = {"type": "web_search", "external_web_access": False}
    response = client.responses.create(model=TOOLS_MODEL, input="Hi", max_output_tokens=2, tools=[WEATHER, search])
    assert [tool.type for tool in response.tools] == ["function"]


# The stand-in that calls the first tool it is offered (model_repo/local/llm_agent).
AGENT = "llm_agent"
TRIGGER = "[call the first tool]"
NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [{**WEATHER, "name": "close_agent", "strict": False}],
}


def test_a_namespaces_function_is_called_under_its_namespace_and_its_result_read(client) -> None:
    first = client.responses.create(model=AGENT, input=TRIGGER, tools=[NAMESPACE, WEATHER], store=False)
    (call,) = first.output
    assert (call.type, call.name, call.namespace) == ("function_call", "close_agent", "multi_agent_v1")
    given_back = [
        {"role": "user", "content": TRIGGER},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "namespace": call.namespace,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "closed"},
    ]
    second = client.responses.create(model=AGENT, input=given_back, tools=[NAMESPACE, WEATHER], store=False)
    assert second.output_text == "The tool answered."


def test_a_streamed_namespace_call_carries_its_namespace(client) -> None:
    _, events = _stream(client, model=AGENT, input=TRIGGER, tools=[NAMESPACE], store=False)
    (done,) = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    assert (done["name"], done["namespace"]) == ("close_agent", "multi_agent_v1")


def test_the_tools_offered_may_change_between_turns(client) -> None:
    first = client.responses.create(model=AGENT, input=TRIGGER, tools=[WEATHER], store=False)
    (call,) = first.output
    given_back = [
        {"role": "user", "content": TRIGGER},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    second = client.responses.create(model=AGENT, input=given_back, tools=[NAMESPACE], store=False)
    assert second.output_text == "The tool answered."


def test_a_tool_description_of_claude_codes_length_is_taken(client) -> None:
    long = {**WEATHER, "description": "Say what the weather is. " * 1700}  # (~42k characters)
    response = client.responses.create(model=AGENT, input=TRIGGER, tools=[long], store=False)
    assert [item.name for item in response.output] == ["get_weather"]


def test_a_reasoning_that_asks_for_nothing_is_accepted(client) -> None:
    response = client.responses.create(model="llm", input="Hi", max_output_tokens=2, reasoning={"effort": None})
    assert response.status in ("completed", "incomplete")


# -- the Agents SDK ------------------------------------------------------------------------------------


class Forecast(BaseModel):
    """The agent's final output: a structured output (guided decoding ends it, where the
    random model's free text would run to max_output_tokens, which the SDK takes as a failure)."""

    city: Literal["Paris", "London", "Tokyo"]
    sky: Literal["clear", "cloudy", "rain"]


def _agent(stack) -> tuple[Any, Any, list[str]]:
    from agents import Agent, ModelSettings, OpenAIProvider, RunConfig, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "London", "Tokyo"]) -> str:
        """The weather in a city now."""
        asked.append(city)
        return json.dumps({"city": city, "temperature_c": 21, "sky": "clear"})

    client = openai.AsyncOpenAI(base_url=f"{stack.gateway_url}/v1", api_key=stack.api_key, max_retries=0, timeout=120)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        output_type=Forecast,
        model=TOOLS_MODEL,
        # The model's text is noise: the first turn's call is forced (then reset to auto).
        model_settings=ModelSettings(tool_choice="required", max_tokens=80),
    )
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client, use_responses=True), tracing_disabled=True)
    return agent, config, asked


async def test_an_agent_with_a_function_tool_runs_to_its_final_output(stack) -> None:
    from agents import Runner

    agent, config, asked = _agent(stack)
    result = await Runner.run(agent, QUESTION, run_config=config)
    assert asked and asked[0] in ("Paris", "London", "Tokyo")
    assert isinstance(result.final_output, Forecast)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


async def test_a_streamed_agent_run_reaches_its_final_output(stack) -> None:
    from agents import Runner

    agent, config, asked = _agent(stack)
    result = Runner.run_streamed(agent, QUESTION, run_config=config)
    kinds = [event.type async for event in result.stream_events()]
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert asked and result.is_complete and isinstance(result.final_output, Forecast)
    assert [item.type for item in result.new_items][-1] == "message_output_item"


async def test_an_agent_keeps_its_conversation_on_the_server(stack, client) -> None:
    from agents import Runner

    agent, config, asked = _agent(stack)
    conversation = client.conversations.create()
    result = await Runner.run(agent, QUESTION, run_config=config, conversation_id=conversation.id)
    assert asked and isinstance(result.final_output, Forecast)
    # Each turn sent only its new items: the server's conversation has them all.
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [item.type for item in items] == ["message", "function_call", "function_call_output", "message"]
    assert items[2].call_id == items[1].call_id


def test_max_output_tokens_over_the_models_room_is_served_up_to_it(client) -> None:
    # The echo engine (8,192 tokens of context) says the prompt again: a prompt of more than
    # half the context fills it before the answer ends; the cap asked for is not refused.
    def tokens(words: int) -> int:
        return client.responses.create(model="llm_echo", input="hello " * words, max_output_tokens=1).usage.input_tokens

    base, more = tokens(100), tokens(200)
    words = 100 + (4300 - base) * 100 // (more - base)
    response = client.responses.create(model="llm_echo", input="hello " * words, max_output_tokens=32000)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens > 4096
    assert response.usage.input_tokens + response.usage.output_tokens == 8192
