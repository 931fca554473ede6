"""OpenAI's Conversations API: POST /v1/conversations, GET/POST/DELETE
/v1/conversations/{id}, POST/GET /v1/conversations/{id}/items, GET/DELETE
/v1/conversations/{id}/items/{item_id}.

A conversation is kept in MongoDB with its tenant (store.ConversationStore): the
items added to it, and the responses made in it (`conversation` on POST /v1/responses),
whose input and output items are its items too, read from the responses as they ended
(so a response that ends on any gateway, or after a restart, is in it). A response in a
conversation is given the conversation's items before its own input. Items are text
messages, function calls and their outputs, as on /v1/responses (other types are refused
by their type).

Bounds (store.ConversationStore): a conversation holds at most
CONVERSATION_MAX_ITEMS items and CONVERSATION_MAX_BYTES bytes (400
conversation_items_limit / conversation_bytes_limit beyond); a tenant keeps at most
TENANT_MAX_CONVERSATIONS (403 conversation_count_quota_exceeded on a create beyond); a call
that creates or updates one or adds items counts as one request against the tenant's
requests per minute (429 beyond); it and its items
expire RESULT_RETENTION_S after it last changed, a response's items with the response
(then they are no longer in it). Lists and lookups read from MongoDB only the entries
they need (by position, by item id), never the whole conversation."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from gateway.server.api.errors import ApiError
from gateway.server.api.tenancy import Caller, caller
from gateway.server.openai.paging import ItemsPage, listing
from gateway.server.openai.responses.chains import conversation_of, conversation_page, entry_of
from gateway.server.openai.responses.items import check_include, items_list, items_of, with_ids
from gateway.server.openai.responses.store import ConversationStore, item_entry
from gateway.server.openai.schemas import Body, Metadata, ResponseInputItem, refuse_unsupported
from gateway.server.services import Services, services
from gateway.server.tenants.reservations import Over, now_ms, reserve

router = APIRouter(prefix="/v1", tags=["OpenAI"])

# Items one call may add (as OpenAI).
MAX_ADDED_ITEMS = 20


class ConversationCreate(Body):
    items: list[ResponseInputItem] | None = Field(default=None, max_length=MAX_ADDED_ITEMS)
    metadata: Metadata | None = None


class ConversationUpdate(Body):
    metadata: Metadata


class ItemsCreate(Body):
    items: list[ResponseInputItem] = Field(min_length=1, max_length=MAX_ADDED_ITEMS)


def _object(document: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": document["_id"],
        "object": "conversation",
        "created_at": int(document.get("created_at", 0)),
        "metadata": document.get("metadata") or {},
    }


async def _add(
    request: Request, who: Caller, conversation: str, given: list[Any], *, admitted: bool = False
) -> list[dict[str, Any]]:
    """Add items (as given, ids derived where none is given), counted as one request
    against the tenant's requests per minute (unless the call was: admitted); the items as kept."""
    svc = services(request)
    items = with_ids(items_of(given, param="items"), secrets.token_hex(16))
    if not admitted:
        who.headers |= await svc.quotas.admit(who.config, 1)
    await ConversationStore(svc).append(who.scope, conversation, [item_entry(item) for item in items])
    return items


# The conversations of a tenant being created now: they count against its quota beside
# those it keeps (gateway.server.tenants.reservations).
RESERVATIONS_KEY = "conversations:reserved:{{{tenant}}}"


@asynccontextmanager
async def _reserved(svc: Services, store: ConversationStore, tenant: str) -> AsyncIterator[None]:
    """A conversation reserved against TENANT_MAX_CONVERSATIONS (0: no limit) while the
    block creates it, atomically beside the other creates in flight: 403 when it does not
    fit beside those the tenant keeps, not expired."""
    limit = svc.settings.tenant_max_conversations
    if not limit:
        yield
        return
    counted_at_ms = now_ms()
    kept = await store.conversations.count_documents(
        {"tenant": tenant, "expires_at": {"$gt": datetime.now(UTC)}}, limit=limit
    )
    key = RESERVATIONS_KEY.format(tenant=tenant)
    reserved = await reserve(
        svc.redis, key, kept=kept, kept_bytes=0, counted_at_ms=counted_at_ms, size=0, max_count=limit, max_bytes=0
    )
    if isinstance(reserved, Over):
        raise ApiError(
            403,
            "conversation_count_quota_exceeded",
            f"tenant {tenant} keeps or is creating {reserved.used} conversations, its quota "
            f"(TENANT_MAX_CONVERSATIONS) is {limit}: delete some first",
            details={"quota": "TENANT_MAX_CONVERSATIONS", "limit": limit, "used": reserved.used},
        )
    try:
        yield
    finally:
        await reserved()


@router.post("/conversations", summary="Create a conversation")
async def create_conversation(
    body: ConversationCreate, request: Request, who: Annotated[Caller, Depends(caller)]
) -> Any:
    items = items_of(body.items or [], param="items")  # (refused before anything is kept)
    refuse_unsupported(body, "conversations")
    svc = services(request)
    store = ConversationStore(svc)
    who.headers |= await svc.quotas.admit(who.config, 1)  # a create is a request per minute
    async with _reserved(svc, store, who.scope):
        document = await store.create(who.scope, dict(body.metadata or {}))
    if items:
        await _add(request, who, document["_id"], body.items or [], admitted=True)
    return JSONResponse(_object(document))


@router.get("/conversations/{conversation}", summary="Get a conversation")
async def get_conversation(conversation: str, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    return JSONResponse(_object(await conversation_of(services(request), who, conversation)))


@router.post("/conversations/{conversation}", summary="Update a conversation's metadata")
async def update_conversation(
    conversation: str, body: ConversationUpdate, request: Request, who: Annotated[Caller, Depends(caller)]
) -> Any:
    svc = services(request)
    refuse_unsupported(body, "conversations")
    await conversation_of(svc, who, conversation)
    who.headers |= await svc.quotas.admit(who.config, 1)  # an update is a request per minute
    await ConversationStore(svc).update(who.scope, conversation, dict(body.metadata))
    return JSONResponse(_object(await conversation_of(svc, who, conversation)))


@router.delete("/conversations/{conversation}", summary="Delete a conversation (its responses stay)")
async def delete_conversation(conversation: str, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    svc = services(request)
    await conversation_of(svc, who, conversation)
    await ConversationStore(svc).delete(who.scope, conversation)
    return JSONResponse({"id": conversation, "object": "conversation.deleted", "deleted": True})


@router.post("/conversations/{conversation}/items", summary="Add items to a conversation")
async def create_items(
    conversation: str, body: ItemsCreate, request: Request, who: Annotated[Caller, Depends(caller)]
) -> Any:
    check_include(request)
    items_of(body.items, param="items")
    refuse_unsupported(body, "conversations")
    await conversation_of(services(request), who, conversation)
    return JSONResponse(listing(await _add(request, who, conversation, body.items), False))


@router.get("/conversations/{conversation}/items", summary="List a conversation's items")
async def list_items(
    conversation: str,
    request: Request,
    who: Annotated[Caller, Depends(caller)],
    page: Annotated[ItemsPage, Depends(items_list)],
) -> Any:
    svc = services(request)
    await conversation_of(svc, who, conversation)
    items, more = await conversation_page(
        svc, who, conversation, limit=page.limit, after=page.after, descending=page.descending
    )
    return JSONResponse(listing(items, more))


Found = tuple[dict[str, Any], dict[str, Any]]  # (its entry, the item)


async def _find(request: Request, who: Caller, conversation: str, item_id: str) -> Found:
    svc = services(request)
    await conversation_of(svc, who, conversation)
    found = await entry_of(svc, who, conversation, item_id)
    if found is None:
        raise ApiError(404, "not_found", f"no item {item_id} in {conversation}")
    entry, items = found
    return entry, next(item for item in items if item.get("id") == item_id)


@router.get("/conversations/{conversation}/items/{item}", summary="Get an item of a conversation")
async def get_item(conversation: str, item: str, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    check_include(request)
    _, found = await _find(request, who, conversation, item)
    return JSONResponse(found)


@router.delete("/conversations/{conversation}/items/{item}", summary="Delete an item of a conversation")
async def delete_item(conversation: str, item: str, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    svc = services(request)
    entry, _ = await _find(request, who, conversation, item)
    await ConversationStore(svc).remove(who.scope, entry, item)
    return JSONResponse(_object(await conversation_of(svc, who, conversation)))
