"""Numbers storage cannot hold (gateway.protocol.storable), found in free-form JSON and
refused at validation: by the walker, by the OpenAI bodies' free-form fields, by the
engine's tool definitions, and in the error each API answers."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import bson
import pytest
from pydantic import ValidationError
from pymongo import AsyncMongoClient
from pymongo.errors import BulkWriteError, OperationFailure

from gateway.common.result_store import RESULT_UNSTORABLE, ResultStore, Unstorable
from gateway.protocol import ResultRecord, State, new_request_id, utc
from gateway.protocol.storable import (
    INT64_MAX,
    INT64_MIN,
    NESTING_MOST,
    UNSTORABLE_NESTING,
    UNSTORABLE_NUMBER,
    first_unstorable,
)
from gateway.server.api.errors import ErrorRenderer
from gateway.server.models.base import InvalidInput, check
from gateway.server.models.llm_engine import LOGPROBS_BUDGET_BYTES, EngineInputs, EngineLlmAdapter, logprobs_bound
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


def test_a_value_nested_past_the_most_is_refused_at_its_first_container_too_deep() -> None:
    value: Any = {"leaf": 1}
    for _ in range(NESTING_MOST):
        value = {"a": value}
    found = first_unstorable(value)
    assert found is not None and found.code == UNSTORABLE_NESTING
    assert len(found.loc) == NESTING_MOST


def test_a_value_nested_to_the_most_is_storable() -> None:
    value: Any = 1
    for _ in range(NESTING_MOST):
        value = [value]
    assert first_unstorable(value) is None


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


# -- storing: a document's own error against an outage (gateway.common.result_store) ------


class _Failing:
    """A collection whose insert_many raises what it is given."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def insert_many(self, documents: list[Any], ordered: bool) -> None:
        raise self.error


def _store(error: Exception) -> ResultStore:
    store = ResultStore(AsyncMongoClient("mongodb://127.0.0.1:1", connect=False), "unused", retention_s=3600)
    store.collection = _Failing(error)  # type: ignore[assignment]
    return store


def _records(count: int) -> list[ResultRecord]:
    now = time.time()
    return [
        ResultRecord(request_id=new_request_id(now), model="llm", status=State.SUCCEEDED, created_at=utc(now))
        for _ in range(count)
    ]


async def test_an_error_of_the_whole_insert_that_is_no_connection_failure_is_an_outage() -> None:
    records = _records(2)
    outcome = await _store(OperationFailure("not primary", code=10107)).insert(records)
    # The old code counted it as the records' failure: retried until dead-lettered.
    assert outcome.unavailable and outcome.stored == [] and not outcome.refused
    assert set(outcome.failed) == {r.request_id for r in records}


async def test_a_document_mongodb_refuses_is_refused_alone_and_a_server_error_is_an_outage() -> None:
    records = _records(3)
    refused = BulkWriteError({"writeErrors": [{"index": 1, "code": 10334, "errmsg": "object too large"}]})
    outcome = await _store(refused).insert(records)
    assert not outcome.unavailable
    assert list(outcome.refused) == [records[1].request_id] and outcome.refused[records[1].request_id][0] == "refused"
    assert outcome.stored == [records[0].request_id, records[2].request_id]
    stepped_down = BulkWriteError({"writeErrors": [{"index": 0, "code": 10107, "errmsg": "not primary"}]})
    outcome = await _store(stepped_down).insert(records)
    assert outcome.unavailable and not outcome.refused


def test_the_failed_record_of_an_unstorable_result_keeps_no_inputs_or_outputs() -> None:
    store = _store(RuntimeError("unused"))
    (record,) = _records(1)
    record = record.model_copy(update={"outputs": {"count": 2**70}, "metadata": {"api": "chat"}})
    with pytest.raises(Unstorable):
        store.encoded(record)
    failed = store.unstorable_record(record, "unencodable", "BSON cannot encode it")
    assert failed.status == State.FAILED and failed.outputs is None and failed.inputs == {}
    assert failed.error is not None and failed.error.code == RESULT_UNSTORABLE
    assert failed.metadata == {"api": "chat"}


# -- log-probabilities a record can hold (models/llm_engine.py) ----------------------------


def test_the_logprobs_bound_holds_for_the_worst_tokens_as_bson_stores_them() -> None:
    token = bytes([0xE2]) * 40  # parts of characters: each byte's text is U+FFFD (3 bytes)
    alternative = {"token": token.decode("utf-8", errors="replace"), "logprob": -1.5, "bytes": list(token)}
    positions, top = 300, 20
    logprobs = [{**alternative, "top_logprobs": [alternative] * top} for _ in range(positions)]
    actual = len(bson.encode({"logprobs": logprobs}))
    assert actual <= logprobs_bound(positions, top, len(token)) < actual * 1.2


def _engine(longest: int) -> EngineLlmAdapter:
    adapter = object.__new__(EngineLlmAdapter)
    adapter.name = "llm"
    adapter.__dict__["longest_token_bytes"] = longest
    return adapter


def test_logprobs_that_could_outgrow_a_record_are_refused_saying_how_many_fit() -> None:
    adapter = _engine(longest=64)
    with pytest.raises(InvalidInput) as caught:
        adapter._check_logprobs_fit(4096, 20)  # ~85 MB of BSON at worst
    assert caught.value.code == "logprobs_too_large"
    most = caught.value.details["max_tokens"]
    assert logprobs_bound(most, 20, 64) <= LOGPROBS_BUDGET_BYTES < logprobs_bound(most + 1, 20, 64)
    adapter._check_logprobs_fit(most, 20)
    adapter._check_logprobs_fit(4096, 0)  # the chosen tokens alone fit
