"""Search over stored results, and results read back from MongoDB."""

from __future__ import annotations

import asyncio
import base64
import time
from datetime import datetime, timedelta

from tests.gateway_calls import submit, wait_result
from tests.triton_requests import png_bytes

TEXTS = [
    "The violinist tuned her instrument before the evening concert",
    "Quarterly revenue of the regional bank rose by eight percent",
    "The volcano erupted and covered the village in grey ash",
    "A toddler stacked wooden blocks into a wobbly tower",
]


async def _embed_all(http, model: str, inputs: list[dict]) -> list[str]:
    ids = [await submit(http, {"model": model, "inputs": item}) for item in inputs]
    for request_id in ids:
        assert (await wait_result(http, request_id))["status"] == "succeeded"
    return ids


async def _search(http, **query) -> dict:
    response = await http.post("/search", json=query)
    assert response.status_code == 200, response.text
    return response.json()


async def _until_searchable(http, found_by: list[tuple[str, dict]], timeout: float = 30) -> None:
    """Until each stored result is in the index: its own input, as the query, finds it."""
    deadline = time.monotonic() + timeout
    for request_id, query in found_by:
        while request_id not in [hit["request_id"] for hit in (await _search(http, **query, k=10))["hits"]]:
            assert time.monotonic() < deadline, f"{request_id} not searchable after {timeout}s"
            await asyncio.sleep(0.05)


async def test_a_text_query_finds_its_matching_stored_text_first(http) -> None:
    ids = await _embed_all(http, "text_embed", [{"text": t} for t in TEXTS])
    await _until_searchable(http, [(i, {"text": t}) for i, t in zip(ids, TEXTS, strict=True)])
    result = await _search(http, text="a musician getting her violin ready for a performance", k=3)
    assert result["space"] == "minilm"
    top = result["hits"][0]
    assert top["request_id"] == ids[0]
    assert top["record"]["inputs"]["text"] == TEXTS[0]
    assert top["score"] > result["hits"][1]["score"]


async def test_a_stored_result_is_searchable_within_one_second(http) -> None:
    text = f"A lighthouse keeper counted ships at dawn, run {time.time_ns()}"
    request_id = await submit(http, {"model": "text_embed", "inputs": {"text": text}})
    record = await wait_result(http, request_id)
    finished = time.time()
    while True:
        hits = (await _search(http, text=text, k=1))["hits"]
        if hits and hits[0]["request_id"] == request_id:
            break
        assert time.time() - finished < 1.0, "not searchable within 1 s"
        await asyncio.sleep(0.05)
    assert record["status"] == "succeeded"


async def test_clip_search_by_image_finds_the_same_image_first(http) -> None:
    images = [base64.b64encode(png_bytes(color)).decode() for color in ((250, 10, 10), (10, 10, 250), (10, 250, 10))]
    ids = await _embed_all(http, "clip_image", [{"image": image} for image in images])
    await _until_searchable(http, [(i, {"image": image}) for i, image in zip(ids, images, strict=True)])
    result = await _search(http, image=images[1], k=2)
    assert result["space"] == "clip"
    assert result["hits"][0]["request_id"] == ids[1]
    assert result["hits"][0]["score"] > 0.999


async def test_clip_text_search_returns_clip_records(http) -> None:
    [request_id] = await _embed_all(http, "clip_text", [{"text": "a blue square"}])
    await _until_searchable(http, [(request_id, {"text": "a blue square", "space": "clip"})])
    result = await _search(http, text="a blue square", space="clip", k=3)
    assert result["hits"]
    assert {h["record"]["model"] for h in result["hits"]} <= {"clip_text", "clip_image"}


async def test_a_search_with_both_text_and_image_is_422(http) -> None:
    response = await http.post("/search", json={"text": "x", "image": "eA=="})
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_query"


async def test_an_image_search_outside_the_clip_space_is_422(http) -> None:
    response = await http.post("/search", json={"image": base64.b64encode(png_bytes()).decode(), "space": "minilm"})
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "unknown_space"


async def _until_stored(http, request_id: str) -> dict:
    await wait_result(http, request_id)
    deadline = time.monotonic() + 10
    while not (record := (await http.get(f"/results/{request_id}")).json())["stored"]:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    return record


async def test_a_stored_result_reads_as_stored_and_mongodb_holds_it(http, mongo, stack) -> None:
    request_id = await submit(http, {"model": "clip_text", "inputs": {"text": "stored"}})
    record = await _until_stored(http, request_id)
    assert record["expires_at"] is not None
    document = await mongo["triton_gateway"]["results"].find_one({"_id": request_id})
    assert document["status"] == "succeeded" and document["stored"] is True


async def test_polls_of_a_result_just_stored_read_redis_not_mongodb(http, mongo) -> None:
    request_id = await submit(http, {"model": "clip_text", "inputs": {"text": "polled after storing"}})
    await _until_stored(http, request_id)
    results = mongo["triton_gateway"]["results"]
    document = await results.find_one({"_id": request_id})
    # A mark only MongoDB's copy has: a poll that read MongoDB would show it.
    await results.update_one({"_id": request_id}, {"$set": {"metadata": {"read_from": "mongodb"}}})
    for params in ({}, {"wait": "5"}):  # a poll and a long-poll
        record = (await http.get(f"/results/{request_id}", params=params)).json()
        assert record["metadata"] == {}, params
        assert record["stored"] is True and record["status"] == document["status"] == "succeeded"
        expires_at = datetime.fromisoformat(record["expires_at"])  # as MongoDB holds it (to its ms)
        assert abs(expires_at - document["expires_at"]) < timedelta(milliseconds=1)
