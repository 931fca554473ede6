"""One embeddings call, one request: a many-input call (the /v1 list, the native list form
of POST /infer) is one durable request with one record holding all its vectors as float32
bytes, stored once in MongoDB and searchable one row each."""

from __future__ import annotations

import asyncio
import base64
import os
import time

import numpy as np
import pytest
from tritonclient.grpc import InferInput, InferRequestedOutput

from tests.gateway_calls import wait_result

SENTENCES = [f"sentence number {i} about {topic}" for i, topic in enumerate(["cats", "ships", "rain", "bread"] * 16)]


def _packed_rows(record: dict) -> np.ndarray:
    value = record["outputs"]["embedding"]
    assert value["dtype"] == "float32"
    rows, dim = value["shape"]
    return np.frombuffer(base64.b64decode(value["data"]), dtype="<f4").reshape(rows, dim)


async def test_a_64_input_embeddings_call_is_one_request_whose_record_holds_all_its_vectors(http) -> None:
    response = await http.post("/v1/embeddings", json={"model": "text_embed", "input": SENTENCES})
    assert response.status_code == 200, response.text
    (request_id,) = response.headers["x-request-id"].split(",")  # one request, not 64
    answer = response.json()
    assert [d["index"] for d in answer["data"]] == list(range(64))
    assert answer["usage"]["prompt_tokens"] > 64
    record = await wait_result(http, request_id)
    assert record["status"] == "succeeded" and record["inputs"]["text"] == SENTENCES
    rows = _packed_rows(record)
    assert rows.shape == (64, 384)  # more than text_embed's max_batch_size (32): split within the run
    assert np.allclose(np.asarray([d["embedding"] for d in answer["data"]]), rows, atol=1e-6)


async def test_a_many_input_calls_usage_is_the_sum_of_its_inputs_own_token_counts(http) -> None:
    texts = ["a cat", "sentence number 7 about ships and the rain over the harbour", "bread"]

    async def tokens(value: str | list[str]) -> int:
        response = await http.post("/v1/embeddings", json={"model": "text_embed", "input": value})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    alone = [await tokens(text) for text in texts]
    assert await tokens(texts) == sum(alone) and len(set(alone)) == 3


@pytest.mark.parametrize("model", ["text_embed", "clip_text"])
async def test_an_embeddings_calls_usage_is_the_models_own_count_of_its_texts_tokens(http, triton, model) -> None:
    """The model answers each text's tokens with its vector (num_tokens); the usage is theirs,
    a long text's too (truncated where the model truncates it, not where a tokenizer.json
    of the gateway's would), whether the call has one input or many."""
    texts = ["a cat", "word " * 400, "sentence number 7 about ships and the rain over the harbour"]
    batch = InferInput("text", [len(texts), 1], "BYTES")
    batch.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_).reshape(-1, 1))
    answer = await triton.infer(model, [batch], outputs=[InferRequestedOutput("num_tokens")])
    counts = answer.as_numpy("num_tokens").reshape(-1).tolist()

    async def usage(value: str | list[str]) -> int:
        response = await http.post("/v1/embeddings", json={"model": model, "input": value})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    assert [await usage(text) for text in texts] == counts
    assert await usage(texts) == sum(counts)


async def test_a_many_input_calls_vectors_are_each_inputs_own_as_a_call_of_one_gives_it(http) -> None:
    texts = SENTENCES[:40]
    many = (await http.post("/v1/embeddings", json={"model": "text_embed", "input": texts})).json()
    for index in (0, 17, 39):  # either side of a split at 32
        one = (await http.post("/v1/embeddings", json={"model": "text_embed", "input": texts[index]})).json()
        assert np.allclose(many["data"][index]["embedding"], one["data"][0]["embedding"], atol=1e-5)


async def test_base64_embeddings_are_the_records_float32_bytes_row_by_row(http) -> None:
    body = {"model": "text_embed", "input": SENTENCES[:5], "encoding_format": "base64"}
    response = await http.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    record = await wait_result(http, response.headers["x-request-id"])
    rows = _packed_rows(record)
    for index, item in enumerate(response.json()["data"]):
        assert base64.b64decode(item["embedding"]) == rows[index].tobytes()


async def test_the_native_list_form_of_infer_is_one_request_with_packed_vectors(http) -> None:
    body = {"model": "text_embed", "inputs": {"text": SENTENCES[:3]}}
    response = await http.post("/infer", json=body, headers={"Prefer": "wait=60"})
    assert response.status_code == 200, response.text
    record = response.json()
    assert record["status"] == "succeeded"
    assert _packed_rows(record).shape == (3, 384)


async def test_one_bad_input_of_a_list_refuses_the_call_at_validation_naming_it(http) -> None:
    native = await http.post("/infer", json={"model": "text_embed", "inputs": {"text": ["fine", ""]}})
    assert native.status_code in (400, 422), native.text
    assert "text.1" in native.json()["error"]["message"]
    v1 = await http.post("/v1/embeddings", json={"model": "text_embed", "input": ["fine", ""]})
    assert v1.status_code == 400 and v1.json()["error"]["param"] == "input[1]"


async def test_a_call_of_2048_inputs_is_accepted_and_one_more_is_refused(http) -> None:
    too_many = await http.post("/v1/embeddings", json={"model": "text_embed", "input": ["x"] * 2049})
    assert too_many.status_code == 400, too_many.text
    response = await http.post("/v1/embeddings", json={"model": "text_embed", "input": ["w"] * 2048}, timeout=300)
    assert response.status_code == 200, response.text[:300]
    assert len(response.json()["data"]) == 2048


async def test_each_input_of_a_many_input_call_is_searchable_naming_its_request_and_row(http) -> None:
    texts = [f"{topic}, run {time.time_ns()}" for topic in ("a red kite over a beach", "tax forms", "a jazz trio")]
    response = await http.post("/v1/embeddings", json={"model": "text_embed", "input": texts})
    request_id = response.headers["x-request-id"]
    deadline = time.monotonic() + 30
    for row, text in enumerate(texts):
        while True:
            hits = (await http.post("/search", json={"text": text, "k": 1})).json()["hits"]
            if hits and hits[0]["request_id"] == request_id:
                break
            assert time.monotonic() < deadline, f"row {row} of {request_id} not searchable"
            await asyncio.sleep(0.05)
        assert hits[0]["row"] == row
        assert hits[0]["record"]["request_id"] == request_id


async def test_the_record_is_one_mongodb_document_with_its_vectors_as_binary(http, mongo) -> None:
    response = await http.post("/v1/embeddings", json={"model": "text_embed", "input": SENTENCES[:4]})
    request_id = response.headers["x-request-id"]
    collection = mongo[os.environ.get("MONGO_DB", "triton_gateway")]["results"]
    deadline = time.monotonic() + 30
    while (document := await collection.find_one({"_id": request_id})) is None:
        assert time.monotonic() < deadline, f"{request_id} not stored after 30s"
        await asyncio.sleep(0.1)
    data = document["outputs"]["embedding"]["data"]
    assert isinstance(data, bytes) and len(data) == 4 * 384 * 4  # BSON binary, not base64 text
    assert await collection.count_documents({"metadata.api": "embeddings", "_id": request_id}) == 1
