"""The routes of the Responses API: POST /v1/responses, GET /v1/responses/{id}
(optionally streamed, resuming with starting_after), GET /v1/responses/{id}/input_items,
DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel (the package docstring says
what they do)."""

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from sse_starlette import ServerSentEvent

from gateway.server import spine
from gateway.server.api.errors import ApiError
from gateway.server.api.sse import EventStream
from gateway.server.api.tenancy import Caller, caller
from gateway.server.calls import requests as call_requests
from gateway.server.calls import run, terms
from gateway.server.calls.terms import warning
from gateway.server.openai.paging import ItemsPage, page_after
from gateway.server.openai.responses.call import keep, response_call
from gateway.server.openai.responses.chains import (
    chain_items,
    conversation_items,
    kept,
    read,
)
from gateway.server.openai.responses.events import response_events
from gateway.server.openai.responses.items import items_list
from gateway.server.openai.responses.objects import response_object
from gateway.server.openai.responses.settings import (
    invalid,
    request_id_of,
)
from gateway.server.openai.responses.store import ConversationStore, ResponseStore
from gateway.server.openai.schemas import (
    ResponseRequest,
)
from gateway.server.services import services

router = APIRouter(prefix="/v1", tags=["OpenAI"])


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[ServerSentEvent]:
    """A response's events (response_events) as Server-Sent Events."""
    async for payload in events:
        yield ServerSentEvent(data=json.dumps(payload, ensure_ascii=False), event=payload["type"])


# -- routes -------------------------------------------------------------------------------------


@router.post("/responses", summary="Create a response (OpenAI Responses API)")
async def create_response(body: ResponseRequest, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    svc = services(request)
    call = await response_call(body, svc, who)
    settings = call.settings
    if body.stream:  # a stream past the tenant's share of followers: refused before anything is queued
        svc.events.admissible(who.tenant)
    (request_id,) = await run.start(svc, who, request, [call.native], flex=terms.tier(body.service_tier).flex)
    headers = {"x-request-id": request_id, **warning(call.ignored)}
    await keep(svc, who, call, request_id, body.model)
    tpb = call_requests.tokens_per_block(svc, body.model)
    fmt = call_requests.tool_format(svc, body.model)
    if body.stream:
        obfuscate = body.stream_options is None or body.stream_options.include_obfuscation
        # A background stream survives a disconnect (resume it with starting_after).
        events = response_events(
            svc,
            request_id,
            body.model,
            settings,
            -1,
            tenant=who.tenant,
            cancel_on_disconnect=not body.background,
            obfuscate=obfuscate,
        )
        return EventStream(_sse(events), ping=svc.settings.sse_ping_s, headers=headers)
    if body.background:
        outcome = await svc.results.get(request_id, who.scope)
        # Accepted just now: queued (unless an Idempotency-Key named one that has ended).
        status = None if outcome.status.terminal else "queued"
        return JSONResponse(response_object(outcome, settings, tpb, fmt, status=status), headers=headers)
    record = await run.wait_record(svc, who, request_id, call.native.timeout_s or svc.settings.default_timeout_s)
    return JSONResponse(response_object(record, settings, tpb, fmt), headers=headers)


@router.get("/responses/{response}", summary="Get a response; stream=true resumes its events")
async def get_response(
    response: str,
    request: Request,
    who: Annotated[Caller, Depends(caller)],
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=-1, le=10_000_000)] = None,
) -> Any:
    svc = services(request)
    outcome, settings = await read(svc, who, response)
    model = outcome.model
    if not stream:
        return JSONResponse(
            response_object(
                outcome, settings, call_requests.tokens_per_block(svc, model), call_requests.tool_format(svc, model)
            )
        )
    request_id = request_id_of(response)
    job = await svc.results.job(request_id, who.scope)
    if job is None:
        raise ApiError(410, "stream_expired", f"the events of {response} are no longer kept; GET it without stream")
    after = -1 if starting_after is None else starting_after
    events = response_events(svc, request_id, model, settings, after, tenant=who.tenant, cancel_on_disconnect=False)
    return EventStream(_sse(events), ping=svc.settings.sse_ping_s)


@router.get("/responses/{response}/input_items", summary="List the items a response was given")
async def list_input_items(
    response: str,
    request: Request,
    who: Annotated[Caller, Depends(caller)],
    page: Annotated[ItemsPage, Depends(items_list)],
) -> Any:
    svc = services(request)
    await read(svc, who, response)
    document = await kept(svc, who, response)
    if document is None:
        raise ApiError(404, "not_found", f"the input items of {response} were not kept")
    items = await chain_items(svc, who, list(document.get("chain", []))) + list(document.get("input", []))
    conversation = (document.get("settings") or {}).get("conversation")
    if conversation and await ConversationStore(svc).get(who.scope, conversation) is not None:
        items = await conversation_items(svc, who, conversation, document.get("position")) + items

    def missing(item: str) -> ApiError:
        return invalid("after", f"no item {item} in the input items of {response}")

    return JSONResponse(
        page_after(items, limit=page.limit, after=page.after, descending=page.descending, missing=missing)
    )


@router.delete("/responses/{response}", summary="Delete a stored response")
async def delete_response(response: str, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    svc = services(request)
    outcome, _ = await read(svc, who, response)
    if not outcome.status.terminal:
        await spine.cancel(svc.jobs, outcome.request_id)  # deleted: nobody could read what it makes
    await ResponseStore(svc).delete(who.scope, response)
    return JSONResponse({"id": response, "object": "response", "deleted": True})


@router.post("/responses/{response}/cancel", summary="Cancel a background response")
async def cancel_response(response: str, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    svc = services(request)
    outcome, settings = await read(svc, who, response)
    if not outcome.status.terminal:
        await spine.cancel(svc.jobs, outcome.request_id)
        outcome = await svc.results.wait(outcome.request_id, 5.0, who.scope)
    model = outcome.model
    return JSONResponse(
        response_object(
            outcome, settings, call_requests.tokens_per_block(svc, model), call_requests.tool_format(svc, model)
        )
    )
