"""OpenAI's list paging (limit, after, order -> first_id, last_id, has_more), written once:
the list object of every /v1 list (files, batches, a conversation's items, a response's
input items), and the paging parameters and pages of the lists of items."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import Query

from gateway.server.api.errors import ApiError


def listing(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A page as OpenAI's list object: its items, the ids of its first and last, and
    whether more follow."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


@dataclass(frozen=True)
class ItemsPage:
    """Which page of a list of items a call asks for."""

    after: str | None
    limit: int
    descending: bool


def items_page(
    after: Annotated[str | None, Query(max_length=256)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> ItemsPage:
    """The paging parameters of a list of items (a route's dependency): newest first
    unless order=asc, 20 at a time unless told."""
    return ItemsPage(after=after, limit=limit, descending=order == "desc")


def following(items: list[dict[str, Any]], after: str) -> list[dict[str, Any]] | None:
    """The items after the one whose id is `after` (None: no such item)."""
    ids = [item.get("id") for item in items]
    return items[ids.index(after) + 1 :] if after in ids else None


def page_after(
    items: list[dict[str, Any]],
    *,
    limit: int,
    after: str | None,
    descending: bool,
    missing: Callable[[str], ApiError],
) -> dict[str, Any]:
    """The page of `items` (in ascending order; newest first when descending) after item
    `after`, at most `limit` of them; `missing(after)` is raised when no item has that id."""
    ordered = items[::-1] if descending else list(items)
    if after is not None:
        rest = following(ordered, after)
        if rest is None:
            raise missing(after)
        ordered = rest
    return listing(ordered[:limit], len(ordered) > limit)
