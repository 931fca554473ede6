"""POST /v1/embeddings (text models of the registry: text_embed, clip_text) and the model
list. A call is one durable request, whatever its inputs: one id, one queue entry, one run
(its rows split into Triton calls of the model's max_batch_size), one record holding all
its vectors as float32 bytes (gateway.protocol.vectors), one MongoDB document, one FAISS
add of a row per input. The answer is written from those bytes as JSON text, the vectors put
between its fixed parts: a row's base64 is a slice of the stored block's where a row is
whole base64 groups (text_embed's 1,536 bytes), else encoded from its slice of the block's
bytes, decoded once (clip_text's 2,048); floats are rendered by numpy and pydantic-core a
row at a time, only when asked for. `dimensions` is refused: these models have a fixed
size. `input` takes strings (token arrays are refused by their type)."""

from __future__ import annotations

import binascii
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic_core import to_json

from gateway.protocol import ResultRecord
from gateway.protocol.http import InferRequest
from gateway.protocol.vectors import ITEM_BYTES, is_packed, packed_bytes, packed_shape
from gateway.server.api.errors import ApiError
from gateway.server.api.tenancy import Caller, caller
from gateway.server.calls import run
from gateway.server.models import InvalidInput
from gateway.server.models.embedding import MAX_INPUTS, EmbeddingAdapter
from gateway.server.openai.schemas import EmbeddingRequest, refuse_unsupported
from gateway.server.services import Services, services

router = APIRouter(prefix="/v1", tags=["OpenAI"])

CREATED = 1_700_000_000  # models have no creation time here; a fixed one keeps answers stable
CREATED_AT = "2023-11-14T22:13:20Z"  # the same, as Anthropic's model object writes it


def embedding_adapter(svc: Services, body: EmbeddingRequest) -> EmbeddingAdapter:
    try:
        adapter = svc.registry.get(body.model)
    except InvalidInput as exc:
        raise ApiError(404, "model_not_found", exc.message, details={"param": "model"}) from None
    if not isinstance(adapter, EmbeddingAdapter) or adapter.input_kind != "text":
        raise ApiError(400, "invalid_model", f"{body.model} does not embed text", details={"param": "model"})
    refuse_unsupported(body, "embeddings")
    if body.dimensions is not None:
        size = f"{adapter.dimensions} dimensions" if adapter.dimensions else "a fixed number of dimensions"
        raise ApiError(
            400,
            "unsupported_parameter",
            f"dimensions is not supported: {body.model} returns {size}",
            details={"param": "dimensions"},
        )
    return adapter


def embedding_requests(body: EmbeddingRequest, svc: Services) -> list[InferRequest]:
    """The one request behind an embeddings call (also for a batch's line): its inputs as
    the native list form of `POST /infer`."""
    embedding_adapter(svc, body)
    inputs = [body.input] if isinstance(body.input, str) else body.input
    if not inputs or len(inputs) > MAX_INPUTS:
        raise ApiError(400, "invalid_input", f"input takes 1 to {MAX_INPUTS} strings", details={"param": "input"})
    for index, text in enumerate(inputs):
        if not text:
            param = "input" if isinstance(body.input, str) else f"input[{index}]"
            raise ApiError(400, "invalid_input", f"{param}: input strings must not be empty", details={"param": param})
    labels = {"api": "embeddings", **({"user": body.user} if body.user else {})}
    return [InferRequest(model=body.model, inputs={"text": list(inputs)}, metadata=labels)]


def rendered(value: Any, encoding: str) -> list[Any]:
    """One answer's embedding per vector an output holds: packed float32 bytes (one per
    row) or, in records of the single-input form, one list of floats."""
    if encoding == "base64":
        return [bytes(row).decode("ascii") for row in base64_rows(value)]
    if not is_packed(value):
        return [value]
    rows, dim = packed_shape(value)
    return np.frombuffer(packed_bytes(value), dtype="<f4").reshape(rows, dim).tolist()


def base64_rows(value: Any) -> list[bytes | memoryview]:
    """Each vector's base64 (ASCII bytes): slices of the block's own base64 where each row is
    whole base64 groups, else each encoded from its slice of the block's bytes."""
    if not is_packed(value):
        return [binascii.b2a_base64(np.asarray(value, dtype="<f4").tobytes(), newline=False)]
    rows, dim = packed_shape(value)
    row_bytes = dim * ITEM_BYTES
    if isinstance(value["data"], str) and row_bytes % 3 == 0:
        # Each row is whole base64 groups: its base64 is a slice of the block's, no decoding.
        text, width = memoryview(value["data"].encode("ascii")), row_bytes // 3 * 4
        return [text[row * width : (row + 1) * width] for row in range(rows)]
    raw = memoryview(packed_bytes(value))
    return [binascii.b2a_base64(raw[row * row_bytes : (row + 1) * row_bytes], newline=False) for row in range(rows)]


def float_rows(value: Any) -> list[bytes]:
    """Each vector's JSON array of floats (as numpy's tolist and pydantic-core write them)."""
    if not is_packed(value):
        return [to_json(value)]
    rows, dim = packed_shape(value)
    matrix = np.frombuffer(packed_bytes(value), dtype="<f4").reshape(rows, dim)
    return [to_json(row.tolist()) for row in matrix]


def embeddings_response(
    records: list[ResultRecord], adapter: EmbeddingAdapter, body: EmbeddingRequest
) -> dict[str, Any]:
    """The answer to an embeddings call from its request's record (or, for a call made
    before a call was one request, its requests' records), in input order (raises for a
    request that did not succeed)."""
    data: list[dict[str, Any]] = []
    tokens = 0
    for record in records:
        run.raise_for_record(record)
        value = (record.outputs or {}).get(adapter.output_name) or []
        for embedding in rendered(value, body.encoding_format):
            data.append({"object": "embedding", "index": len(data), "embedding": embedding})
        tokens += record.usage.prompt_tokens if record.usage else 0
    return {
        "object": "list",
        "data": data,
        "model": body.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def embeddings_answer(records: list[ResultRecord], adapter: EmbeddingAdapter, body: EmbeddingRequest) -> bytes:
    """embeddings_response's JSON, written directly: its fixed parts around each vector's
    base64 (ASCII that JSON needs no escape for: bytes of the stored block as they are, no
    string made of them) or floats, joined once (raises for a request that did not succeed)."""
    as_base64 = body.encoding_format == "base64"
    quote = b'"' if as_base64 else b""
    parts: list[bytes | memoryview] = [b'{"object":"list","data":[']
    tokens = index = 0
    for record in records:
        run.raise_for_record(record)
        value = (record.outputs or {}).get(adapter.output_name) or []
        for vector in base64_rows(value) if as_base64 else float_rows(value):
            parts += [b'{"object":"embedding","index":%d,"embedding":%b' % (index, quote), vector, quote + b"},"]
            index += 1
        tokens += record.usage.prompt_tokens if record.usage else 0
    if index:
        parts[-1] = quote + b"}"  # (no comma after the last)
    usage = b'{"prompt_tokens":%d,"total_tokens":%d}' % (tokens, tokens)
    parts.append(b'],"model":%b,"usage":%b}' % (to_json(body.model), usage))
    return b"".join(parts)


@router.post("/embeddings", summary="Create embeddings (OpenAI)")
async def create_embeddings(body: EmbeddingRequest, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    svc = services(request)
    adapter = embedding_adapter(svc, body)
    natives = embedding_requests(body, svc)
    ids = await run.start(svc, who, request, natives)
    records = await run.wait_records(svc, who, ids, svc.settings.default_timeout_s)
    answer = embeddings_answer(records, adapter, body)
    return Response(answer, media_type="application/json", headers={"x-request-id": ",".join(ids)})


def model_object(name: str, adapter: object = None) -> dict[str, Any]:
    """A model as OpenAI's and Anthropic's model objects both read (the two APIs share the
    path), with the numbers agent clients size their prompts by, for an LLM: its context
    (`context_window`, prompt and answer together), the longest prompt it takes and the
    most tokens an answer has (Anthropic's `max_input_tokens` and `max_tokens`)."""
    found: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": CREATED,
        "owned_by": "triton-gateway",
        "type": "model",
        "display_name": name,
        "created_at": CREATED_AT,
        "lifecycle": "active",
    }
    context = getattr(adapter, "context_length", None)
    spec = getattr(adapter, "spec", None)
    if isinstance(context, int):
        found["context_window"] = context
        found["max_input_tokens"] = getattr(adapter, "max_input_tokens", context - 1)
        output_cap = getattr(spec, "max_output_tokens", None)
        found["max_tokens"] = min(context - 1, output_cap) if isinstance(output_cap, int) else context - 1
    return found


@router.get("/models", summary="The models served (OpenAI, Anthropic)")
async def list_models(request: Request, who: Annotated[Caller, Depends(caller)]) -> dict[str, Any]:
    registry = services(request).registry
    names = list(registry.names)
    data = [model_object(name, registry.adapters.get(name)) for name in names]
    # (has_more, first_id, last_id: Anthropic's page of one page)
    return {
        "object": "list",
        "data": data,
        "has_more": False,
        "first_id": names[0] if names else None,
        "last_id": names[-1] if names else None,
    }


@router.get("/models/{model_id}", summary="One model (OpenAI, Anthropic)")
async def get_model(model_id: str, request: Request, who: Annotated[Caller, Depends(caller)]) -> dict[str, Any]:
    registry = services(request).registry
    if model_id not in registry:
        raise ApiError(404, "model_not_found", f"the model {model_id!r} does not exist", details={"param": "model"})
    return model_object(model_id, registry.adapters.get(model_id))
