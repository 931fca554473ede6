"""Every field of OpenAI's request bodies is honoured or refused by name, never dropped.

The first test holds the gateway's schemas against the `openai` package's own create
parameters (chat, completions, embeddings, responses, batches): a field the SDK can send is
either declared (honoured) or listed with the reason it is refused. The second sends each
refused field, set to something that asks for it, to the real gateway."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai.types import batch_create_params, completion_create_params, embedding_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params
from pydantic import BaseModel

from gateway.server.openai import schemas
from tests.conftest import AUTH

# Each endpoint: the SDK's parameters, our schema, the path and a minimal valid body.
ENDPOINTS: dict[str, tuple[type, type[BaseModel], str, dict[str, Any]]] = {
    "chat": (
        chat_create_params.CompletionCreateParamsBase,
        schemas.ChatCompletionRequest,
        "/v1/chat/completions",
        {"model": "llm_echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    ),
    "completions": (
        completion_create_params.CompletionCreateParamsBase,
        schemas.CompletionRequest,
        "/v1/completions",
        {"model": "llm_echo", "prompt": "hi", "max_tokens": 1},
    ),
    "embeddings": (
        embedding_create_params.EmbeddingCreateParams,
        schemas.EmbeddingRequest,
        "/v1/embeddings",
        {"model": "text_embed", "input": "hi"},
    ),
    "responses": (
        response_create_params.ResponseCreateParamsBase,
        schemas.ResponseRequest,
        "/v1/responses",
        {"model": "llm_echo", "input": "hi", "max_output_tokens": 1},
    ),
    "batches": (
        batch_create_params.BatchCreateParams,
        schemas.BatchRequest,
        "/v1/batches",
        {"input_file_id": "file-none", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ),
}


def _sdk_fields(params: type) -> set[str]:
    return {name for cls in params.__mro__ for name in getattr(cls, "__annotations__", {})}


def _refused(endpoint: str) -> dict[str, str]:
    return {**schemas.UNSUPPORTED["*"], **schemas.UNSUPPORTED.get(endpoint, {})}


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_every_field_the_sdk_can_send_is_declared_or_refused_with_a_reason(endpoint) -> None:
    params, schema, _, _ = ENDPOINTS[endpoint]
    declared = set(schema.model_fields) | {f.alias for f in schema.model_fields.values() if f.alias}
    unaccounted = _sdk_fields(params) - declared - set(_refused(endpoint))
    assert not unaccounted, f"{endpoint}: fields of the openai package neither honoured nor refused"


REFUSED = [(endpoint, name) for endpoint in ENDPOINTS for name in sorted(_refused(endpoint))]


@pytest.mark.parametrize(("endpoint", "name"), REFUSED, ids=[f"{e}-{n}" for e, n in REFUSED])
def test_a_refused_field_that_asks_for_something_is_400_naming_it(stack, endpoint, name) -> None:
    _, _, path, body = ENDPOINTS[endpoint]
    response = httpx.post(f"{stack.gateway_url}{path}", headers=AUTH, json={**body, name: "asked-for"}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_parameter", name)
