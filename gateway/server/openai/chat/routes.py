"""The routes: POST /v1/chat/completions and POST /v1/completions, each queueing its
requests and answering with their chunks (stream) or in one piece."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from gateway.protocol.http import InferRequest
from gateway.server.api.sse import EventStream
from gateway.server.api.tenancy import Caller, caller
from gateway.server.calls import requests as call_requests
from gateway.server.calls import run, terms
from gateway.server.openai.chat.chunks import ChunkStream
from gateway.server.openai.chat.objects import chat_completion, text_completion
from gateway.server.openai.chat.requests import chat_request, completion_request
from gateway.server.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.server.services import services

router = APIRouter(prefix="/v1", tags=["OpenAI"])


@router.post("/chat/completions", summary="Create a chat completion (OpenAI)")
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, who: Annotated[Caller, Depends(caller)]
) -> Any:
    natives = chat_request(body, services(request), run.idempotency_key(request))
    return await _answer(request, who, body, natives)


@router.post("/completions", summary="Create a completion (OpenAI, legacy)")
async def create_completion(body: CompletionRequest, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    natives = completion_request(body, services(request), run.idempotency_key(request))
    return await _answer(request, who, body, natives)


async def _answer(
    request: Request, who: Caller, body: ChatCompletionRequest | CompletionRequest, natives: list[InferRequest]
) -> Any:
    """Queue the requests; stream their chunks, or wait for them and answer in one piece."""
    svc = services(request)
    run_as = terms.tier(body.service_tier)
    if body.stream:  # a stream past the tenant's share of followers: refused before anything is queued
        svc.events.admissible(who.tenant)
    request_ids = await run.start(svc, who, request, natives, flex=run_as.flex)
    headers = {"x-request-id": ",".join(request_ids)}
    tpb = call_requests.tokens_per_block(svc, body.model)
    if body.stream:
        stream = ChunkStream(request_ids, body, tpb, call_requests.tool_format(svc, body.model))
        return EventStream(stream.events(svc, who.tenant), ping=svc.settings.sse_ping_s, headers=headers)
    timeout = natives[0].timeout_s or svc.settings.default_timeout_s
    records = await run.wait_records(svc, who, request_ids, timeout)
    for record in records:
        run.raise_for_record(record)
    if isinstance(body, ChatCompletionRequest):
        return JSONResponse(
            chat_completion(records, body, tpb, call_requests.tool_format(svc, body.model)), headers=headers
        )
    return JSONResponse(text_completion(records, body, tpb), headers=headers)
