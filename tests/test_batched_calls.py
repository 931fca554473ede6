"""Embedding requests of one model that are ready together share Triton calls (one
ModelInfer with a batch dimension, gateway/server/replicas/batching.py): fewer calls than
requests, each request its own vector, and one bad input in a shared call fails only
itself. Against the local stack's Triton, counted by Triton's own metrics."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np

from tests.gateway_calls import submit, wait_result
from tests.triton_requests import bytes_tensor, png_bytes


def triton_counts(stack, model: str) -> tuple[float, float]:
    """(requests Triton answered, inferences it ran) for the model: a call of 8 rows is one
    request and 8 inferences."""
    text = httpx.get(f"http://127.0.0.1:{stack.s.triton_metrics_port}/metrics", timeout=10).text
    found = {"nv_inference_request_success": 0.0, "nv_inference_count": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in found and f'model="{model}"' in line:
            found[name] += float(line.rsplit(" ", 1)[1])
    return found["nv_inference_request_success"], found["nv_inference_count"]


async def test_embedding_requests_ready_together_share_triton_calls(stack, http) -> None:
    calls_before, rows_before = triton_counts(stack, "text_embed")
    bodies = [{"model": "text_embed", "inputs": {"text": f"sentence number {i}"}} for i in range(32)]
    ids = await asyncio.gather(*(submit(http, body) for body in bodies))
    records = await asyncio.gather(*(wait_result(http, rid) for rid in ids))
    assert {r["status"] for r in records} == {"succeeded"}
    calls_after, rows_after = triton_counts(stack, "text_embed")
    assert rows_after - rows_before == 32
    assert calls_after - calls_before < 32, "every request went in a call of its own"


async def test_each_request_of_a_shared_call_gets_its_own_vector(stack, http, triton) -> None:
    texts = [f"a distinct text, number {i}" for i in range(16)]
    ids = await asyncio.gather(*(submit(http, {"model": "text_embed", "inputs": {"text": t}}) for t in texts))
    records = await asyncio.gather(*(wait_result(http, rid) for rid in ids))
    for text, record in zip(texts, records, strict=True):
        alone = await triton.infer("text_embed", [bytes_tensor("text", text.encode())])
        expected = alone.as_numpy("embedding").reshape(-1)
        assert np.allclose(record["outputs"]["embedding"], expected, atol=1e-5), text


async def test_one_bad_image_in_a_shared_call_fails_only_itself(stack, http) -> None:
    good = [base64.b64encode(png_bytes((10 * i, 40, 90))).decode() for i in range(6)]
    broken = base64.b64encode(png_bytes()[:40]).decode()  # a PNG's signature, then nothing
    images = [*good[:3], broken, *good[3:]]
    ids = await asyncio.gather(*(submit(http, {"model": "clip_image", "inputs": {"image": i}}) for i in images))
    records = await asyncio.gather(*(wait_result(http, rid) for rid in ids))
    assert [r["status"] for r in records] == ["succeeded"] * 3 + ["failed"] + ["succeeded"] * 3
    assert records[3]["error"]["code"] == "invalid_input"


async def test_a_64_input_clip_text_call_is_one_triton_call(stack, http) -> None:
    """clip_text takes 64 rows a call (its ensemble, tokenizer and text tower), so a 64-input
    embeddings call is one ModelInfer, not four of 16."""
    calls_before, rows_before = triton_counts(stack, "clip_text")
    body = {"model": "clip_text", "input": [f"a photo of thing number {i}" for i in range(64)]}
    response = await http.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == 64
    calls_after, rows_after = triton_counts(stack, "clip_text")
    assert (calls_after - calls_before, rows_after - rows_before) == (1, 64)
