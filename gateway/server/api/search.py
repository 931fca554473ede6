"""POST /search: the stored results nearest a text or an image (the caller's own)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from gateway.protocol.http import SearchRequest, SearchResponse
from gateway.server.api.tenancy import Caller, caller
from gateway.server.services import services

router = APIRouter()


@router.post(
    "/search",
    response_model=SearchResponse,
    summary="Find the stored results nearest a text or image",
    responses={
        422: {"description": "invalid_query, unknown_space"},
        429: {
            "description": "The tenant runs its share of searches (tenant_share_exceeded) or spent its "
            "requests per minute (rate_limited); retry after `Retry-After` seconds"
        },
        503: {"description": "no_replica, binder_unavailable"},
    },
)
async def search(body: SearchRequest, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    """Charged to the caller's tenant: one of its requests per minute, one of its searches
    running at once, counted in its usage (`searches`)."""
    found, headers = await services(request).search.search(body, who.scope, who.config)
    who.headers |= headers  # (the edge adds them to the answer: x-ratelimit-*)
    return found
