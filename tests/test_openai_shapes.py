"""The OpenAI API's response bodies, built by hand as dicts (gateway/server/openai/), checked
STRICTLY against the `openai` package's own types: each raw JSON body validates as its type,
and holds no key that the type does not define, at any depth (the package's types accept
unknown keys, so `model_validate` alone would let a misspelt or invented field through).
Where the gateway sends a field on purpose that the package does not define, it is named in
EXTENSIONS with the reason. One stack for the whole run (the session's `stack`)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai.pagination import SyncPage
from openai.types import Batch, Completion, CreateEmbeddingResponse, FileObject, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from tests import test_openai_responses as responses
from tests.conftest import AUTH
from tests.test_openai_api import MESSAGES
from tests.test_openai_batches import chat_line, jsonl
from tests.test_openai_features import FORCED, QUESTION, TOOLS_MODEL, WEATHER

# Fields the gateway sends that the openai package's types do not define, by the name of the
# type and the path ("[]" stands for any list index).
EXTENSIONS: dict[str, set[str]] = {
    # Completions take service_tier and stream_options "as on chat" (README, Completions):
    # the answer says which tier ran, and streamed chunks carry `obfuscation` (random padding)
    # unless stream_options.include_obfuscation is false. OpenAI's legacy Completion object
    # (which the package also uses for streamed chunks) has neither field.
    "Completion": {"$.service_tier", "$.obfuscation"},
}
# store, presence_penalty and frequency_penalty are fields of the Open Responses
# specification's ResponseResource (README, Responses; tests/test_openai_responses.py requires
# them), which the openai package's Response does not define.
_RESPONSE_EXTRAS = ("store", "presence_penalty", "frequency_penalty")
EXTENSIONS["Response"] = {f"$.{name}" for name in _RESPONSE_EXTRAS}
# /v1/models serves OpenAI's and Anthropic's model objects at once (README, Models): the
# Anthropic SDK's ModelInfo (type, display_name, created_at, lifecycle) and page (has_more,
# first_id, last_id), and the context the agent CLIs read (context_window, max_input_tokens,
# max_tokens).
_MODEL_EXTRAS = ("type", "display_name", "created_at", "lifecycle", "context_window", "max_input_tokens", "max_tokens")
EXTENSIONS["Model"] = {f"$.{name}" for name in _MODEL_EXTRAS}
EXTENSIONS["SyncPage[Model]"] = {f"$.data[].{name}" for name in _MODEL_EXTRAS} | {
    "$.has_more",
    "$.first_id",
    "$.last_id",
}
for _event in ("Created", "Queued", "InProgress", "Completed", "Incomplete", "Failed"):
    EXTENSIONS[f"Response{_event}Event"] = {f"$.response.{name}" for name in _RESPONSE_EXTRAS}
# Streamed deltas carry `obfuscation` (random padding) unless stream_options.include_obfuscation
# is false, on the Responses API as on chat (README, Responses); the package defines it on
# ChatCompletionChunk only.
EXTENSIONS["ResponseTextDeltaEvent"] = {"$.obfuscation"}
EXTENSIONS["ResponseFunctionCallArgumentsDeltaEvent"] = {"$.obfuscation"}


def undeclared(value: Any, raw: Any, path: str = "$") -> list[str]:
    """The keys of `raw` that the type it was validated into (`value`) does not define, at
    any depth: walks the validated model beside the raw dict, so a union resolves to the
    member that was chosen."""
    if isinstance(value, BaseModel) and isinstance(raw, dict):
        fields = {(field.alias or name): name for name, field in type(value).model_fields.items()}
        found = []
        for key, item in raw.items():
            if key in fields:
                found += undeclared(getattr(value, fields[key]), item, f"{path}.{key}")
            else:
                found.append(f"{path}.{key}")
        return found
    if isinstance(value, list) and isinstance(raw, list):
        return [key for v, r in zip(value, raw, strict=True) for key in undeclared(v, r, f"{path}[]")]
    if isinstance(value, dict) and isinstance(raw, dict):
        return [key for name, r in raw.items() if name in value for key in undeclared(value[name], r, f"{path}.{name}")]
    return []


def strictly(kind: Any, raw: Any) -> Any:
    """`raw` validated as `kind`, failing on any key that the type it validates into does
    not define (but for the EXTENSIONS named for that type)."""
    value = TypeAdapter(kind).validate_python(raw)
    name = type(value).__name__
    extra = set(undeclared(value, raw)) - EXTENSIONS.get(name, set())
    assert not extra, f"keys that the openai package's {name} does not define: {sorted(extra)}"
    return value


@pytest.fixture(scope="module")
def api(stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{stack.gateway_url}/v1", headers=dict(AUTH), timeout=120) as client:
        yield client


def _ok(response: httpx.Response) -> Any:
    assert response.is_success, response.text
    return response.json()


def _sse(api: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    """The JSON of each `data:` of a streamed answer ("[DONE]" left out)."""
    with api.stream("POST", path, json={**body, "stream": True}) as answer:
        assert answer.status_code == 200, answer.read()
        raw = answer.read().decode()
    events = []
    for frame in raw.split("\n\n"):
        data = "\n".join(line.removeprefix("data: ") for line in frame.split("\n") if line.startswith("data: "))
        if data and data != "[DONE]":
            events.append(json.loads(data))
    assert events
    return events


def test_undeclared_finds_unknown_keys_at_any_depth() -> None:
    raw = {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "invented": 1,
        "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi", "mood": "ok"}}
        ],
    }
    value = ChatCompletion.model_validate(raw)
    assert undeclared(value, raw) == ["$.invented", "$.choices[].message.mood"]


def test_a_chat_completion(api) -> None:
    raw = _ok(api.post("/chat/completions", json={"model": "llm_echo", "messages": MESSAGES, "max_tokens": 50}))
    strictly(ChatCompletion, raw)


def test_each_chunk_of_a_streamed_chat_completion(api) -> None:
    body = {"model": "llm_echo", "messages": MESSAGES, "max_tokens": 50, "stream_options": {"include_usage": True}}
    chunks = _sse(api, "/chat/completions", body)
    for chunk in chunks:
        strictly(ChatCompletionChunk, chunk)
    assert chunks[-1]["usage"] is not None


LOGPROBS_CHAT = {"model": "llm", "messages": QUESTION, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}


def test_a_chat_completion_with_logprobs(api) -> None:
    raw = _ok(api.post("/chat/completions", json=LOGPROBS_CHAT))
    assert raw["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    strictly(ChatCompletion, raw)


def test_the_chunks_of_a_streamed_chat_completion_with_logprobs(api) -> None:
    chunks = _sse(api, "/chat/completions", LOGPROBS_CHAT)
    assert any(chunk["choices"] and chunk["choices"][0]["logprobs"] for chunk in chunks)
    for chunk in chunks:
        strictly(ChatCompletionChunk, chunk)


def test_a_chat_completion_with_a_tool_call_streamed_and_not(api) -> None:
    body = {"model": TOOLS_MODEL, "messages": QUESTION, "tools": [WEATHER], "tool_choice": FORCED, "max_tokens": 60}
    raw = _ok(api.post("/chat/completions", json=body))
    assert raw["choices"][0]["message"]["tool_calls"]
    strictly(ChatCompletion, raw)
    chunks = _sse(api, "/chat/completions", body)
    assert any(chunk["choices"] and chunk["choices"][0]["delta"].get("tool_calls") for chunk in chunks)
    for chunk in chunks:
        strictly(ChatCompletionChunk, chunk)


def test_a_legacy_completion_streamed_and_not(api) -> None:
    body = {"model": "llm_echo", "prompt": "one two three", "max_tokens": 3}
    strictly(Completion, _ok(api.post("/completions", json=body)))
    chunks = _sse(api, "/completions", body)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    for chunk in chunks:
        # OpenAI streams legacy completions as Completion objects whose finish_reason is null
        # until the last chunk (as the gateway does), but the package's Completion types it
        # as never null (its client reads chunks without validating them): the null is
        # checked here, then the rest of the chunk strictly.
        choices = [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]
        strictly(Completion, {**chunk, "choices": choices})


def test_a_legacy_completion_with_logprobs(api) -> None:
    raw = _ok(api.post("/completions", json={"model": "llm", "prompt": "Once upon", "max_tokens": 3, "logprobs": 2}))
    assert raw["choices"][0]["logprobs"]["tokens"]
    strictly(Completion, raw)


def test_an_embeddings_response(api) -> None:
    raw = _ok(api.post("/embeddings", json={"model": "text_embed", "input": ["a cat", "a dog"]}))
    strictly(CreateEmbeddingResponse, raw)


def test_the_model_list_and_a_model(api) -> None:
    strictly(SyncPage[Model], _ok(api.get("/models")))
    strictly(Model, _ok(api.get("/models/llm")))


def test_a_responses_api_response(api) -> None:
    body = {"model": "llm_echo", "input": "Say hello.", "instructions": "Be brief.", "max_output_tokens": 50}
    strictly(Response, _ok(api.post("/responses", json=body)))


def test_each_event_of_a_streamed_response(api) -> None:
    events = _sse(api, "/responses", {"model": "llm_echo", "input": "Stream me", "max_output_tokens": 50})
    for event in events:
        strictly(ResponseStreamEvent, event)


def test_a_response_with_logprobs_and_its_events(api) -> None:
    body = {
        "model": "llm",
        "input": "Once upon",
        "max_output_tokens": 4,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    raw = _ok(api.post("/responses", json=body))
    assert raw["output"][0]["content"][0]["logprobs"][0]["top_logprobs"]
    strictly(Response, raw)
    for event in _sse(api, "/responses", body):
        strictly(ResponseStreamEvent, event)


def test_a_response_with_a_function_call_and_its_events(api) -> None:
    body = {
        "model": responses.TOOLS_MODEL,
        "input": responses.QUESTION,
        "tools": [responses.WEATHER],
        "tool_choice": "required",
        "max_output_tokens": 60,
    }
    raw = _ok(api.post("/responses", json=body))
    assert [item["type"] for item in raw["output"]] == ["function_call"]
    strictly(Response, raw)
    events = _sse(api, "/responses", body)
    assert "response.function_call_arguments.delta" in {event["type"] for event in events}
    for event in events:
        strictly(ResponseStreamEvent, event)


def test_a_file_object(api) -> None:
    created = _ok(api.post("/files", files={"file": ("input.jsonl", b"{}\n")}, data={"purpose": "batch"}))
    strictly(FileObject, created)
    strictly(FileObject, _ok(api.get(f"/files/{created['id']}")))


def test_a_batch_object_created_and_completed(api) -> None:
    upload = {"file": ("input.jsonl", jsonl([chat_line("one", "Hi", max_tokens=8)]))}
    file_id = _ok(api.post("/files", files=upload, data={"purpose": "batch"}))["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    created = _ok(api.post("/batches", json=body))
    strictly(Batch, created)
    for _ in range(600):
        batch = _ok(api.get(f"/batches/{created['id']}"))
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            break
        time.sleep(0.2)
    assert batch["status"] == "completed", batch
    strictly(Batch, batch)
