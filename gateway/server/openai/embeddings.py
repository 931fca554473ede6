"""POST /v1/embeddings (text models of the registry: text_embed, clip_text) and the model
list. Each input is an ordinary durable request (its vector goes into the index like
any other), admitted together with the call's other inputs or not at all; the answer
gathers them in order. `dimensions` is refused: these models
have a fixed size. `input` takes strings (token arrays are refused by their type)."""

from __future__ import annotations

import asyncio
import base64
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from gateway.protocol import ResultRecord
from gateway.protocol.http import InferRequest
from gateway.server.api.errors import ApiError
from gateway.server.api.tenancy import Caller, caller
from gateway.server.models import InvalidInput
from gateway.server.models.embedding import EmbeddingAdapter
from gateway.server.openai import common
from gateway.server.openai.schemas import EmbeddingRequest, refuse_unsupported
from gateway.server.services import Services, services

router = APIRouter(prefix="/v1", tags=["OpenAI"])

MAX_INPUTS = 256
CREATED = 1_700_000_000  # models have no creation time here; a fixed one keeps answers stable


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
    """The ordinary requests behind an embeddings call, one per input (also for batches)."""
    embedding_adapter(svc, body)
    inputs = [body.input] if isinstance(body.input, str) else body.input
    if not inputs or len(inputs) > MAX_INPUTS:
        raise ApiError(400, "invalid_input", f"input takes 1 to {MAX_INPUTS} strings", details={"param": "input"})
    if any(not text for text in inputs):
        raise ApiError(400, "invalid_input", "input strings must not be empty", details={"param": "input"})
    labels = {"api": "embeddings", **({"user": body.user} if body.user else {})}
    return [InferRequest(model=body.model, inputs={"text": text}, metadata=labels) for text in inputs]


def encode(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def embeddings_response(
    records: list[ResultRecord], adapter: EmbeddingAdapter, body: EmbeddingRequest
) -> dict[str, Any]:
    """The answer to an embeddings call from its requests' records, in input order
    (raises for a request that did not succeed)."""
    data = []
    tokens = 0
    for index, record in enumerate(records):
        common.raise_for_record(record)
        vector = (record.outputs or {}).get(adapter.output_name) or []
        data.append({"object": "embedding", "index": index, "embedding": encode(vector, body.encoding_format)})
        tokens += record.usage.prompt_tokens if record.usage else 0
    return {
        "object": "list",
        "data": data,
        "model": body.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


@router.post("/embeddings", summary="Create embeddings (OpenAI)")
async def create_embeddings(body: EmbeddingRequest, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    svc = services(request)
    adapter = embedding_adapter(svc, body)
    natives = embedding_requests(body, svc)
    ids = await common.start(svc, who, request, natives)
    records = await asyncio.gather(*(common.wait_record(svc, who, rid, svc.settings.default_timeout_s) for rid in ids))
    return JSONResponse(embeddings_response(list(records), adapter, body), headers={"x-request-id": ",".join(ids)})


def model_object(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": CREATED, "owned_by": "triton-gateway"}


@router.get("/models", summary="The models served (OpenAI)")
async def list_models(request: Request, who: Annotated[Caller, Depends(caller)]) -> dict[str, Any]:
    return {"object": "list", "data": [model_object(name) for name in services(request).registry.names]}


@router.get("/models/{model_id}", summary="One model (OpenAI)")
async def get_model(model_id: str, request: Request, who: Annotated[Caller, Depends(caller)]) -> dict[str, Any]:
    if model_id not in services(request).registry:
        raise ApiError(404, "model_not_found", f"the model {model_id!r} does not exist", details={"param": "model"})
    return model_object(model_id)
