"""Synthetic result records, as the dispatcher publishes them to the results stream."""

from __future__ import annotations

import time

import numpy as np

from gateway.protocol import IndexRef, ResultRecord, State, WebhookSpec, new_request_id, utc
from gateway.protocol.redis_keys import Shard

RESULTS_STREAM = Shard(0).results  # the local stack has one shard


def unit_vectors(count: int, dim: int, seed: int = 0) -> np.ndarray:
    vectors = np.random.default_rng(seed).standard_normal((count, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def embedding_record(
    vector: list[float], model: str = "text_embed", text: str = "", *, tenant: str = "default", age_s: float = 0.0
) -> ResultRecord:
    """age_s: how long ago the request finished (its result expires that much sooner)."""
    space, output = {
        "text_embed": ("minilm", "embedding"),
        "clip_text": ("clip", "text_embeds"),
        "clip_image": ("clip", "image_embeds"),
    }[model]
    now = time.time() - age_s
    return ResultRecord(
        request_id=new_request_id(now),
        model=model,
        status=State.SUCCEEDED,
        tenant=tenant,
        inputs={"text": text},
        outputs={output: [float(x) for x in vector]},
        created_at=utc(now - 0.05),
        started_at=utc(now - 0.04),
        finished_at=utc(now),
        attempts=1,
        index=IndexRef(space=space, output=output),
    )


def text_record(text: str = "generated text", *, webhook: str | None = None) -> ResultRecord:
    now = time.time()
    return ResultRecord(
        request_id=new_request_id(now),
        model="llm",
        status=State.SUCCEEDED,
        inputs={"text_input": "prompt"},
        outputs={"text_output": text},
        created_at=utc(now - 0.05),
        finished_at=utc(now),
        attempts=1,
        webhook=WebhookSpec(url=webhook) if webhook else None,
    )


def mixed_records(count: int, dim: int = 384, seed: int = 0) -> list[ResultRecord]:
    """Three in four carry an embedding, the rest are llm text."""
    vectors = unit_vectors(count, dim, seed)
    return [embedding_record(vectors[i].tolist()) if i % 4 else text_record(f"text {i}") for i in range(count)]


async def publish(redis, records: list[ResultRecord]) -> None:
    async with redis.pipeline(transaction=False) as pipe:
        for record in records:
            pipe.xadd(RESULTS_STREAM, {"id": record.request_id, "record": record.model_dump_json()})
        await pipe.execute()
