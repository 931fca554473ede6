"""OpenAI's list paging (limit, after, order -> first_id, last_id, has_more), written once
for the lists of items: a conversation's items and a response's input items."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
