"""Numbers storage cannot hold (gateway.protocol.storable), found in free-form JSON and
refused at validation: by the walker, by the OpenAI bodies' free-form fields, by the
engine's tool definitions, and in the error each API answers."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.protocol.storable import INT64_MAX, INT64_MIN, UNSTORABLE_NUMBER, first_unstorable
from gateway.server.api.errors import ErrorRenderer
from gateway.server.models.base import InvalidInput, check
from gateway.server.models.llm_engine import EngineInputs
from gateway.server.openai.errors import openai_error
from gateway.server.openai.schemas import BatchLine, ChatCompletionRequest, ResponseRequest

HUGE = 100000000000000000000  # the issue's `"maximum": 100000000000000000000`


def schema_with(value: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"count": {"type": "integer", "maximum": value}}}


def test_int64_bounds_are_storable_and_one_past_them_is_not() -> None:
    assert first_unstorable({"a": [INT64_MIN, INT64_MAX, 0, -1, 1.5e308, True, None, "9" * 30]}) is None
    above = first_unstorable({"a": [1, INT64_MAX + 1]})
    below = first_unstorable({"a": {"b": INT64_MIN - 1}})
    assert above is not None and above.path == "a[1]"
    assert below is not None and below.path == "a.b"


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_unstorable(value: float) -> None:
    found = first_unstorable(schema_with(value))
    assert found is not None and found.path == "properties.count.maximum"
    assert "not a finite number" in found.why


def test_json_lets_in_what_storage_cannot_hold() -> None:
    # Python's parser (FastAPI's, the hot route's fallback) reads them all without a word.
    parsed = json.loads('{"a": 100000000000000000000, "b": NaN, "c": 1e400}')
    assert first_unstorable({"a": parsed["a"]}) is not None
    assert first_unstorable({"b": parsed["b"]}) is not None
    assert first_unstorable({"c": parsed["c"]}) is not None


def test_the_first_unstorable_number_is_named_depth_first() -> None:
    found = first_unstorable({"x": [{"y": 1}, {"z": HUGE}], "w": HUGE})
    assert found is not None and found.path == "x[1].z"


def test_a_huge_integer_is_described_by_its_size() -> None:
    found = first_unstorable({"n": 10**5000})  # str() of it would raise
    assert found is not None and "bits" in found.why and len(found.why) < 200


def test_deep_nesting_is_walked_without_recursion() -> None:
    value: Any = HUGE
    for _ in range(5000):
        value = [value]
    found = first_unstorable({"deep": value})
    assert found is not None and found.path.startswith("deep[0][0]")


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "llm", "messages": [{"role": "user", "content": "hi"}], **extra}


def first_error(body: dict[str, Any], model: type[Any]) -> dict[str, Any]:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    return dict(caught.value.errors()[0])


def test_chat_tool_parameters_with_an_unstorable_number_are_refused() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema_with(HUGE)}}
    error = first_error(chat_body(tools=[tool]), ChatCompletionRequest)
    assert error["type"] == UNSTORABLE_NUMBER
    assert error["loc"] == ("tools", 0, "function", "parameters")
    assert "properties.count.maximum is 100000000000000000000" in error["msg"]


def test_chat_response_format_schema_with_an_unstorable_number_is_refused() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema_with(math.inf)}}
    error = first_error(chat_body(response_format=fmt), ChatCompletionRequest)
    assert error["type"] == UNSTORABLE_NUMBER and error["loc"][:3] == ("response_format", "json_schema", "schema")


def test_responses_tools_text_format_and_items_given_back_are_checked() -> None:
    base = {"model": "llm", "input": "hi"}
    tool = {"type": "function", "name": "f", "parameters": schema_with(HUGE)}
    assert first_error({**base, "tools": [tool]}, ResponseRequest)["loc"] == ("tools", 0, "parameters")
    text = {"format": {"type": "json_schema", "name": "x", "schema": schema_with(-HUGE)}}
    assert first_error({**base, "text": text}, ResponseRequest)["type"] == UNSTORABLE_NUMBER
    given_back = [
        {"role": "assistant", "content": [{"type": "output_text", "text": "a", "annotations": [{"index": HUGE}]}]}
    ]
    with pytest.raises(ValidationError) as caught:  # (input is a union: the text's error comes first)
        ResponseRequest.model_validate({**base, "input": given_back})
    assert any(e["type"] == UNSTORABLE_NUMBER for e in caught.value.errors())


def test_batch_line_bodies_are_checked() -> None:
    line = {"custom_id": "a", "url": "/v1/chat/completions", "body": chat_body(seed_extra=HUGE)}
    assert first_error(line, BatchLine)["type"] == UNSTORABLE_NUMBER


def test_storable_schemas_pass() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema_with(INT64_MAX)}}
    ChatCompletionRequest.model_validate(chat_body(tools=[tool]))


def test_engine_tool_parameters_refused_with_their_own_code() -> None:
    inputs = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema_with(HUGE)}}],
    }
    with pytest.raises(InvalidInput) as caught:
        check(EngineInputs, inputs, "llm", "invalid_inputs")
    assert caught.value.code == UNSTORABLE_NUMBER
    assert "tools.0.function.parameters: properties.count.maximum is 100000000000000000000" in caught.value.message


def test_an_unstorable_number_is_named_before_a_unions_other_complaints() -> None:
    given_back = [{"role": "user", "content": [{"type": "input_text", "text": "a", "logprobs": [HUGE]}]}]
    with pytest.raises(ValidationError) as caught:
        ResponseRequest.model_validate({"model": "llm", "input": given_back})
    errors = [{**e, "loc": ("body", *e["loc"])} for e in caught.value.errors()]
    assert errors[0]["type"] != UNSTORABLE_NUMBER
    renderer = ErrorRenderer(renderers={"/v1/": openai_error})
    body = json.loads(bytes(renderer.validation("/v1/responses", errors).body))["error"]
    assert body["code"] == UNSTORABLE_NUMBER and body["param"].endswith(".0.logprobs")


def test_the_validation_error_reads_unstorable_number_natively_and_under_v1() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema_with(HUGE)}}
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate(chat_body(tools=[tool]))
    errors = [{**e, "loc": ("body", *e["loc"])} for e in caught.value.errors()]
    renderer = ErrorRenderer(renderers={"/v1/": openai_error})
    native = json.loads(bytes(renderer.validation("/infer", errors).body))
    assert native["error"]["code"] == UNSTORABLE_NUMBER
    answer = renderer.validation("/v1/chat/completions", errors)
    body = json.loads(bytes(answer.body))["error"]
    assert answer.status_code == 400
    assert body["code"] == UNSTORABLE_NUMBER and body["param"] == "tools.0.function.parameters"
    assert "properties.count.maximum" in body["message"]
