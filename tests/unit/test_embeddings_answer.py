"""The /v1/embeddings answer written directly from the record's bytes (embeddings_answer) is
the JSON pydantic-core writes of embeddings_response's dict, byte for byte, for rows of whole
base64 groups (sliced from the block's base64) and rows that are not (encoded from the block's
bytes), for base64 and floats, and for an older record's single vector; and the block's
base64 decodes as base64.b64decode decodes it."""

from __future__ import annotations

import base64
import os
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
from pydantic_core import to_json

from gateway.protocol import ResultRecord, State, Usage
from gateway.protocol.vectors import b64decode, packed
from gateway.server.models.embedding import EmbeddingAdapter
from gateway.server.openai.embeddings import embeddings_answer, embeddings_response
from gateway.server.openai.schemas import EmbeddingRequest

ADAPTER = EmbeddingAdapter("m", "m", input_kind="text", output_name="embedding", space=None)


def _record(value: Any, tokens: int) -> ResultRecord:
    return ResultRecord(
        request_id="0" * 36,
        model="m",
        status=State.SUCCEEDED,
        outputs={"embedding": value},
        usage=Usage(prompt_tokens=tokens),
        created_at=datetime.now(UTC),
    )


def _packed_record(rows: int, dim: int) -> ResultRecord:
    matrix = np.random.default_rng(dim).standard_normal((rows, dim)).astype(np.float32)
    stored = _record(packed(matrix.tobytes(), rows, dim), 17).model_dump_json()
    return ResultRecord.model_validate_json(stored)  # as the waiter reads it: base64 text


@pytest.mark.parametrize("encoding", ["base64", "float"])
@pytest.mark.parametrize("dim", [384, 512, 5])  # rows of 1,536 bytes (whole groups), 2,048, 20
def test_the_written_answer_is_pydantic_cores_json_of_the_answers_dict(encoding: str, dim: int) -> None:
    body = EmbeddingRequest(model="m", input=["a", "b", "c"], encoding_format=encoding)  # type: ignore[arg-type]
    records = [_packed_record(3, dim)]
    assert embeddings_answer(records, ADAPTER, body) == to_json(embeddings_response(records, ADAPTER, body))


@pytest.mark.parametrize("encoding", ["base64", "float"])
def test_an_older_records_single_vector_is_answered_as_before(encoding: str) -> None:
    body = EmbeddingRequest(model="m", input="a", encoding_format=encoding)  # type: ignore[arg-type]
    records = [_record([0.5, -1.25, 3.0], 2), _record([1.0, 2.0, 3.0], 3)]
    answer = embeddings_answer(records, ADAPTER, body)
    assert answer == to_json(embeddings_response(records, ADAPTER, body))


@pytest.mark.parametrize("size", [0, 1, 2, 3, 2048, 131072, 131073])
def test_a_blocks_base64_decodes_as_base64_decodes_it(size: int) -> None:
    raw = os.urandom(size)
    assert b64decode(base64.b64encode(raw).decode("ascii")) == raw
