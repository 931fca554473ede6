"""OpenAI's list paging, written once (gateway/server/openai/paging.py): the page after an
item, in either order, with first_id, last_id and has_more; an unknown `after` refused."""

from __future__ import annotations

import pytest

from gateway.server.api.errors import ApiError
from gateway.server.openai.paging import following, listing, page_after

ITEMS = [{"id": f"msg_{n}"} for n in range(5)]


def _missing(after: str) -> ApiError:
    return ApiError(400, "invalid_request", f"no item {after}", details={"param": "after"})


def test_a_page_names_its_first_and_last_items_and_whether_more_follow() -> None:
    page = page_after(ITEMS, limit=2, after=None, descending=False, missing=_missing)
    assert page == {
        "object": "list",
        "data": ITEMS[:2],
        "first_id": "msg_0",
        "last_id": "msg_1",
        "has_more": True,
    }


def test_a_descending_page_after_an_item_starts_below_it() -> None:
    page = page_after(ITEMS, limit=2, after="msg_3", descending=True, missing=_missing)
    assert [item["id"] for item in page["data"]] == ["msg_2", "msg_1"] and page["has_more"] is True


def test_the_last_page_has_no_more() -> None:
    page = page_after(ITEMS, limit=10, after="msg_2", descending=False, missing=_missing)
    assert [item["id"] for item in page["data"]] == ["msg_3", "msg_4"] and page["has_more"] is False


def test_an_after_that_names_no_item_is_refused() -> None:
    with pytest.raises(ApiError) as refused:
        page_after(ITEMS, limit=2, after="msg_9", descending=False, missing=_missing)
    assert refused.value.status == 400


def test_an_empty_page_has_no_ids() -> None:
    assert listing([], False) == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    assert following(ITEMS, "msg_4") == [] and following(ITEMS, "nope") is None
