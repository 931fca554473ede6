"""The Responses API (text in, text out): POST /v1/responses, GET /v1/responses/{id}
(optionally streamed, resuming with starting_after), POST /v1/responses/{id}/cancel.

With background=true the answer is immediate (status queued) and the work is an
ordinary durable request: it survives the client's disconnect and a gateway restart.
Streamed events get sequence numbers derived from the request's own event stream (which
only grows), so resuming after sequence number N gives exactly what followed N.

text.format json_object / json_schema is guided decoding on the engine; include
message.output_text.logprobs (and top_logprobs) puts each token's log-probability in the
output text; service_tier and prompt_cache_key work as on chat completions; usage has
input_tokens_details.cached_tokens. A background response that ends is announced to the
tenant's OpenAI webhook endpoint (the binder sends response.completed and the others)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from sse_starlette import ServerSentEvent

from gateway.protocol import ResultRecord, State, valid_request_id
from gateway.protocol.http import InferRequest, LiveStatus
from gateway.server.api.errors import ApiError
from gateway.server.api.sse import EventStream
from gateway.server.api.tenancy import Caller, caller
from gateway.server.openai import common
from gateway.server.openai.chat import parameters
from gateway.server.openai.schemas import INCLUDE_LOGPROBS, Message, ResponseRequest, refuse_unsupported, unsupported
from gateway.server.results.events import StreamEvent
from gateway.server.services import Services, services

router = APIRouter(prefix="/v1", tags=["OpenAI"])

_STATUS = {
    State.QUEUED: "queued",
    State.RUNNING: "in_progress",
    State.SUCCEEDED: "completed",
    State.FAILED: "failed",
    State.EXPIRED: "failed",
    State.CANCELED: "cancelled",
}


def response_id(request_id: str) -> str:
    return f"resp_{request_id}"


def request_id_of(value: str) -> str:
    request_id = value.removeprefix("resp_")
    if not valid_request_id(request_id):
        raise ApiError(404, "not_found", f"no response {value}")
    return request_id


def response_request(body: ResponseRequest, svc: Services) -> InferRequest:
    adapter = common.llm(svc, body.model, chat=True)
    refuse_unsupported(body, "responses")
    run_as = common.tier(body.service_tier)
    for index, item in enumerate(body.include or []):
        if item != INCLUDE_LOGPROBS:
            raise unsupported(f"include[{index}]", f"include {item} is not supported: only {INCLUDE_LOGPROBS}")
    # top_logprobs asks for log-probabilities as much as the include does.
    logprobs = INCLUDE_LOGPROBS in (body.include or []) or bool(body.top_logprobs)
    items = (
        [Message(role="user", content=body.input)]
        if isinstance(body.input, str)
        else [m.as_message() for m in body.input]
    )
    if body.instructions:
        items.insert(0, Message(role="system", content=body.instructions))
    inputs: dict[str, Any] = {
        "messages": common.messages(items),
        "max_tokens": body.max_output_tokens or common.DEFAULT_MAX_TOKENS,
    }
    text_format = body.text.format if body.text is not None else None
    labels = common.metadata(body, "responses", run_as) | {"background": "true" if body.background else "false"}
    if text_format is not None and text_format.type != "text":
        common.require(adapter, "guided_decoding", "text.format", f"text.format {text_format.type}")
        if text_format.type == "json_object":
            schema: dict[str, Any] = {"type": "object"}
        elif text_format.schema_:
            schema = text_format.schema_
        else:
            raise ApiError(
                400, "invalid_request", "json_schema needs a schema", details={"param": "text.format.schema"}
            )
        inputs["guided_decoding"] = {"guide_type": "json_schema", "guide": json.dumps(schema)}
        labels |= {"text_format": text_format.type, "text_format_name": (text_format.name or "")[:64]}
    native = parameters(
        body,
        adapter,
        logprobs=logprobs,
        top_logprobs=body.top_logprobs or 0,
        prompt_cache_key=body.prompt_cache_key,
    )
    return InferRequest(
        model=body.model,
        inputs=inputs,
        parameters=native,
        stream=bool(body.stream or body.background),
        metadata=labels,
        priority=run_as.priority,
        timeout_s=common.timeout_for(svc, run_as),
    )


def _message(request_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "id": f"msg_{request_id}",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}],
    }


# Labels the gateway keeps with a response's record (not the caller's metadata).
_OWN_LABELS = ("api", "background", "service_tier", "text_format", "text_format_name", "user", "safety_identifier")


def _text_config(labels: dict[str, str], inputs: dict[str, Any]) -> dict[str, Any]:
    kind = labels.get("text_format")
    if kind == "json_object":
        return {"format": {"type": "json_object"}}
    if kind == "json_schema":
        guide = (inputs.get("guided_decoding") or {}).get("guide") or "{}"
        name = labels.get("text_format_name") or "response"
        return {"format": {"type": "json_schema", "name": name, "schema": json.loads(guide), "strict": True}}
    return {"format": {"type": "text"}}


def response_object(outcome: ResultRecord | LiveStatus, tpb: int = 32) -> dict[str, Any]:
    request_id = outcome.request_id
    status = _STATUS[outcome.status]
    body: dict[str, Any] = {
        "id": response_id(request_id),
        "object": "response",
        "created_at": int(outcome.created_at.timestamp()),
        "status": status,
        "model": outcome.model,
        "output": [],
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
        "error": None,
        "incomplete_details": None,
        "usage": None,
        "metadata": {},
        "text": {"format": {"type": "text"}},
        "background": False,
    }
    labels = dict(outcome.metadata)
    body["background"] = labels.get("background", "false") == "true"
    body["service_tier"] = labels.get("service_tier", "default")
    if labels.get("user"):
        body["user"] = labels["user"]
    if labels.get("safety_identifier"):
        body["safety_identifier"] = labels["safety_identifier"]
    body["metadata"] = {k: v for k, v in labels.items() if k not in _OWN_LABELS}
    if isinstance(outcome, ResultRecord):
        body["text"] = _text_config(labels, outcome.inputs)
        body["top_logprobs"] = outcome.parameters.get("top_logprobs", 0)
        text = (outcome.outputs or {}).get("text_output")
        logprobs = common.logprobs_of(outcome)
        if outcome.status == State.SUCCEEDED:
            if common.finish_reason(outcome) == "length":
                body["status"] = "incomplete"
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            body["output"] = [_message(request_id, text or "", "completed", logprobs)]
        elif text:
            body["output"] = [_message(request_id, text, "incomplete", logprobs)]
        if outcome.error and outcome.status in (State.FAILED, State.EXPIRED):
            body["error"] = {"code": "server_error", "message": f"{outcome.error.code}: {outcome.error.message}"}
        usage = common.usage([outcome], tpb)
        body["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0},
        }
    return body


class ResponseEvents:
    """OpenAI's response events from the request's own events, numbered as they go."""

    def __init__(self, request_id: str, model: str, created_at: int, tpb: int = 32, obfuscate: bool = True) -> None:
        self.request_id = request_id
        self.model = model
        self.created_at = created_at
        self.tpb = tpb
        self.obfuscate = obfuscate
        self.sequence = -1
        self.started = False
        self.text: list[str] = []

    def _event(self, kind: str, **fields: Any) -> tuple[int, dict[str, Any]]:
        self.sequence += 1
        return self.sequence, {"type": kind, "sequence_number": self.sequence, **fields}

    def _live(self, status: str) -> dict[str, Any]:
        return {
            "id": response_id(self.request_id),
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": [],
            "parallel_tool_calls": False,
            "tool_choice": "auto",
            "tools": [],
            "background": True,
            "service_tier": "default",
        }

    def of(self, event: StreamEvent) -> Iterator[tuple[int, dict[str, Any]]]:
        item_id = f"msg_{self.request_id}"
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        if event.kind == "queued":
            yield self._event("response.created", response=self._live("queued"))
            yield self._event("response.queued", response=self._live("queued"))
        elif event.kind == "running" and not self.started:
            self.started = True
            yield self._event("response.in_progress", response=self._live("in_progress"))
            yield self._event(
                "response.output_item.added",
                output_index=0,
                item={**_message(self.request_id, "", "in_progress"), "content": []},
            )
            yield self._event(
                "response.content_part.added",
                **where,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            )
        elif event.kind == "token":
            delta = common.token_text(event)
            self.text.append(delta)
            extra = {"obfuscation": common.obfuscation(delta)} if self.obfuscate else {}
            yield self._event("response.output_text.delta", **where, delta=delta, logprobs=[], **extra)
        elif event.terminal:
            record = common.record_of(event)
            final = response_object(record, self.tpb)
            if record.status == State.SUCCEEDED:
                text = "".join(self.text) or (record.outputs or {}).get("text_output", "")
                logprobs = common.logprobs_of(record)
                part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
                yield self._event("response.output_text.done", **where, text=text, logprobs=logprobs)
                yield self._event("response.content_part.done", **where, part=part)
                item = _message(self.request_id, text, "completed", logprobs)
                yield self._event("response.output_item.done", output_index=0, item=item)
                kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                yield self._event(kind, response=final)
            else:
                yield self._event("response.failed", response=final)


async def _stream(
    svc: Services,
    request_id: str,
    model: str,
    created_at: int,
    after: int,
    *,
    cancel_on_disconnect: bool,
    obfuscate: bool = True,
) -> AsyncIterator[ServerSentEvent]:
    tpb = common.tokens_per_block(svc, model)
    numbering = ResponseEvents(request_id, model, created_at, tpb, obfuscate)
    events = common.follow(svc, request_id) if cancel_on_disconnect else svc.events.follow(request_id, "0-0")
    async for event in events:
        for sequence, payload in numbering.of(event):
            if sequence > after:
                yield ServerSentEvent(data=json.dumps(payload, ensure_ascii=False), event=payload["type"])


@router.post("/responses", summary="Create a response (OpenAI Responses API)")
async def create_response(body: ResponseRequest, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    svc = services(request)
    native = response_request(body, svc)
    run_as = common.tier(body.service_tier)
    (request_id,) = await common.start(svc, who, request, [native], flex=run_as.flex)
    headers = {"x-request-id": request_id}
    tpb = common.tokens_per_block(svc, body.model)
    if body.stream:
        created = common.created()
        obfuscate = body.stream_options is None or body.stream_options.include_obfuscation
        # A background stream survives a disconnect (resume it with starting_after).
        stream = _stream(
            svc, request_id, body.model, created, -1, cancel_on_disconnect=not body.background, obfuscate=obfuscate
        )
        return EventStream(stream, ping=svc.settings.sse_ping_s, headers=headers)
    if body.background:
        outcome = await svc.results.get(request_id, who.scope)
        answer = response_object(outcome, tpb)
        answer["background"] = True
        return JSONResponse(answer, headers=headers)
    record = await common.wait_record(svc, who, request_id, native.timeout_s or svc.settings.default_timeout_s)
    return JSONResponse(response_object(record, tpb), headers=headers)


@router.get("/responses/{response}", summary="Get a response; stream=true resumes its events")
async def get_response(
    response: str,
    request: Request,
    who: Annotated[Caller, Depends(caller)],
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=-1, le=10_000_000)] = None,
) -> Any:
    svc = services(request)
    request_id = request_id_of(response)
    outcome = await svc.results.get(request_id, who.scope)
    if not stream:
        return JSONResponse(response_object(outcome, common.tokens_per_block(svc, outcome.model)))
    job = await svc.results.job(request_id, who.scope)
    if job is None:
        raise ApiError(410, "stream_expired", f"the events of {response} are no longer kept; GET it without stream")
    created = int(outcome.created_at.timestamp())
    after = -1 if starting_after is None else starting_after
    return EventStream(
        _stream(svc, request_id, outcome.model, created, after, cancel_on_disconnect=False),
        ping=svc.settings.sse_ping_s,
    )


@router.post("/responses/{response}/cancel", summary="Cancel a background response")
async def cancel_response(response: str, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    svc = services(request)
    request_id = request_id_of(response)
    outcome = await svc.results.get(request_id, who.scope)
    if not outcome.status.terminal:
        await svc.jobs.cancel(request_id)
        outcome = await svc.results.wait(request_id, 5.0, who.scope)
    return JSONResponse(response_object(outcome, common.tokens_per_block(svc, outcome.model)))
