"""POST /v1/chat/completions and POST /v1/completions.

Messages are rendered with the model's chat template by the engine adapter; `stream`
answers with `data:` chunks then `data: [DONE]`, with a usage chunk when
stream_options.include_usage is set; a client that disconnects from a stream cancels
the generation. n > 1 is refused (send n requests)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from gateway.protocol import State
from gateway.protocol.http import InferRequest
from gateway.server.api.errors import ApiError
from gateway.server.api.tenancy import Caller, caller
from gateway.server.openai import common
from gateway.server.openai.schemas import ChatCompletionRequest, CompletionRequest, unsupported
from gateway.server.services import Services, services

router = APIRouter(prefix="/v1", tags=["OpenAI"])


def chat_request(body: ChatCompletionRequest, svc: Services) -> InferRequest:
    """The ordinary request behind a chat completion (also used by the Batch API)."""
    common.llm(svc, body.model, chat=True)
    common.refuse_n(body)
    inputs: dict[str, Any] = {
        "messages": common.messages(body.messages),
        "max_tokens": body.max_completion_tokens or body.max_tokens or common.DEFAULT_MAX_TOKENS,
        "stop_words": body.stop_words(),
    }
    return InferRequest(
        model=body.model,
        inputs=inputs,
        parameters=common.parameters(body),
        stream=body.stream,
        metadata=common.metadata(body, "chat.completions"),
    )


def completion_request(body: CompletionRequest, svc: Services) -> InferRequest:
    common.llm(svc, body.model, chat=False)
    common.refuse_n(body)
    field = unsupported(body, {"echo": False, "suffix": None})
    if field:
        raise ApiError(400, "unsupported_parameter", f"{field} is not supported", details={"param": field})
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
        raise ApiError(400, "unsupported_parameter", "send one prompt per request", details={"param": "prompt"})
    inputs = {"text_input": prompts[0], "max_tokens": body.max_tokens or 16, "stop_words": body.stop_words()}
    return InferRequest(
        model=body.model,
        inputs=inputs,
        parameters=common.parameters(body),
        stream=body.stream,
        metadata=common.metadata(body, "completions"),
    )


def chat_completion(record: Any, model: str) -> dict[str, Any]:
    text = (record.outputs or {}).get("text_output", "")
    return {
        "id": f"chatcmpl-{record.request_id}",
        "object": "chat.completion",
        "created": common.created(record),
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "finish_reason": common.finish_reason(record),
                "logprobs": None,
            }
        ],
        "usage": common.usage(record),
    }


def text_completion(record: Any, model: str) -> dict[str, Any]:
    text = (record.outputs or {}).get("text_output", "")
    return {
        "id": f"cmpl-{record.request_id}",
        "object": "text_completion",
        "created": common.created(record),
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "text": text, "finish_reason": common.finish_reason(record), "logprobs": None}],
        "usage": common.usage(record),
    }


@router.post("/chat/completions", summary="Create a chat completion (OpenAI)")
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, who: Annotated[Caller, Depends(caller)]
) -> Any:
    return await _answer(request, who, body, chat_request(body, services(request)), chat=True)


@router.post("/completions", summary="Create a completion (OpenAI, legacy)")
async def create_completion(body: CompletionRequest, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    return await _answer(request, who, body, completion_request(body, services(request)), chat=False)


async def _answer(
    request: Request, who: Caller, body: ChatCompletionRequest | CompletionRequest, native: InferRequest, *, chat: bool
) -> Any:
    """Queue the request; stream its chunks, or wait for it and answer in one piece."""
    svc = services(request)
    (request_id,) = await common.start(svc, who, request, [native])
    headers = {"x-request-id": request_id}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventSourceResponse(
            _chunks(svc, request_id, body.model, chat=chat, include_usage=include_usage),
            ping=svc.settings.sse_ping_s,
            headers=headers,
        )
    record = await common.wait_record(svc, who, request_id, svc.settings.default_timeout_s)
    common.raise_for_record(record)
    shape = chat_completion if chat else text_completion
    return JSONResponse(shape(record, body.model), headers=headers)


async def _chunks(
    svc: Services, request_id: str, model: str, *, chat: bool, include_usage: bool
) -> AsyncIterator[ServerSentEvent]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    base = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
        "object": kind,
        "created": common.created(),
        "model": model,
        "system_fingerprint": None,
    }

    def chunk(text: str | None, finish: str | None = None, first: bool = False) -> ServerSentEvent:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        payload = {**base, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return ServerSentEvent(data=json.dumps(payload, ensure_ascii=False))

    if chat:
        yield chunk(None, first=True)
    async for event in common.follow(svc, request_id):
        if event.kind == "token":
            yield chunk(common.token_text(event))
        elif event.terminal:
            record = common.record_of(event)
            if record.status != State.SUCCEEDED:
                code = record.error.code if record.error else record.status.value
                message = record.error.message if record.error else f"the request was {record.status.value}"
                error = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
                yield ServerSentEvent(data=json.dumps(error))
            else:
                yield chunk(None if chat else "", finish=common.finish_reason(record))
                if include_usage:
                    yield ServerSentEvent(data=json.dumps({**base, "choices": [], "usage": common.usage(record)}))
            yield ServerSentEvent(data="[DONE]")
