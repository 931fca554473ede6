"""A many-input embeddings request is one request: its rows split into Triton calls of the
model's max_batch_size within its one run, its vectors packed as float32 bytes in its record,
rendered for the API from those bytes, stored in MongoDB as binary and indexed one row each."""

from __future__ import annotations

import asyncio
import base64
from datetime import UTC, datetime, timedelta
from typing import Any

import bson
import numpy as np
import pytest

from binder.index.follower import item_from_document, item_of
from binder.index.vectors import VectorIndex, hit_of
from gateway.common.result_store import record_from_document, record_to_document
from gateway.protocol import IndexRef, ResultRecord, State
from gateway.protocol.vectors import float_rows, is_packed, packed, packed_bytes, vector_rows
from gateway.server.models import InvalidInput
from gateway.server.models.base import BatchRow
from gateway.server.models.embedding import EmbeddingAdapter, TextListInputs
from gateway.server.openai.embeddings import rendered
from gateway.server.replicas.batching import BatchedInfer

DIM = 6


class _Result:
    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def as_numpy(self, name: str) -> np.ndarray:
        return self.rows


class _Client:
    """A Triton client whose model embeds a text as DIM copies of its number."""

    def __init__(self, max_batch: int, fail_on: bytes | None = None) -> None:
        self.max_batch, self.fail_on = max_batch, fail_on
        self.calls: list[list[bytes]] = []

    async def get_model_config(self, model: str, as_json: bool = True, **options: Any) -> dict[str, Any]:
        return {"config": {"max_batch_size": self.max_batch}}

    async def infer(self, model: str, inputs: list[Any], **options: Any) -> _Result:
        values = self._values(inputs[0])
        self.calls.append(values)
        await asyncio.sleep(0)
        if len(values) > self.max_batch:
            raise RuntimeError("batch larger than max_batch_size")
        if self.fail_on is not None and self.fail_on in values:
            raise RuntimeError("bad input")
        return _Result(np.array([[float(v)] * DIM for v in values], dtype=np.float32))

    @staticmethod
    def _values(tensor: Any) -> list[bytes]:
        raw = tensor._raw_content  # BYTES: 4-byte little-endian length, then the bytes, per element
        values, at = [], 0
        while at < len(raw):
            size = int.from_bytes(raw[at : at + 4], "little")
            values.append(raw[at + 4 : at + 4 + size])
            at += 4 + size
        return values


class _Replica:
    def __init__(self, client: _Client) -> None:
        self.client, self.url = client, "replica:1"


def _row(texts: list[str]) -> BatchRow:
    rows = tuple(t.encode() for t in texts)
    return BatchRow("text", rows[0], "embedding", rows if len(rows) > 1 else ())


async def test_a_request_larger_than_max_batch_size_is_split_into_calls_within_its_one_answer() -> None:
    client = _Client(max_batch=32)
    batched = BatchedInfer(2)
    texts = [str(i) for i in range(70)]
    result = await batched.infer(_Replica(client), "m", _row(texts), "r1", 10)  # type: ignore[arg-type]
    rows = result.as_numpy("embedding")
    assert rows is not None and rows.shape == (70, DIM)
    assert rows[:, 0].tolist() == [float(i) for i in range(70)]  # in input order
    assert sorted(len(c) for c in client.calls) == [6, 32, 32]


async def test_a_many_input_request_and_single_requests_share_calls_without_splitting_sharing() -> None:
    client = _Client(max_batch=8)
    batched = BatchedInfer(1)
    replica = _Replica(client)
    many = batched.infer(replica, "m", _row([str(i) for i in range(10)]), "r1", 10)  # type: ignore[arg-type]
    one = batched.infer(replica, "m", _row(["100"]), "r2", 10)  # type: ignore[arg-type]
    got_many, got_one = await asyncio.gather(many, one)
    assert got_many.as_numpy("embedding")[:, 0].tolist() == [float(i) for i in range(10)]  # type: ignore[index]
    assert got_one.as_numpy("embedding").shape == (1, DIM)  # type: ignore[union-attr]
    assert all(len(c) <= 8 for c in client.calls)


async def test_without_shared_calls_a_many_input_request_is_still_split() -> None:
    client = _Client(max_batch=4)
    batched = BatchedInfer(1, shared=False)
    result = await batched.infer(_Replica(client), "m", _row([str(i) for i in range(9)]), "r1", 10)  # type: ignore[arg-type]
    assert result.as_numpy("embedding").shape == (9, DIM)  # type: ignore[union-attr]
    assert [len(c) for c in client.calls] == [4, 4, 1]


async def test_a_failed_shared_call_fails_only_the_request_whose_input_failed() -> None:
    client = _Client(max_batch=16, fail_on=b"bad")
    batched = BatchedInfer(1)
    replica = _Replica(client)
    good = batched.infer(replica, "m", _row(["1", "2", "3"]), "r1", 10)  # type: ignore[arg-type]
    bad = batched.infer(replica, "m", _row(["4", "bad"]), "r2", 10)  # type: ignore[arg-type]
    got_good, got_bad = await asyncio.gather(good, bad, return_exceptions=True)
    assert not isinstance(got_good, BaseException) and got_good.as_numpy("embedding").shape == (3, DIM)  # type: ignore[union-attr]
    assert isinstance(got_bad, RuntimeError)


def _adapter() -> EmbeddingAdapter:
    return EmbeddingAdapter("text_embed", "text_embed", input_kind="text", output_name="embedding", space="minilm")


def test_a_list_of_texts_is_one_request_and_a_bad_input_is_refused_naming_its_index() -> None:
    adapter = _adapter()
    prepared = adapter.validate({"text": ["a", "b"]}, {})
    assert isinstance(prepared, TextListInputs) and adapter.inputs_count(prepared) == 2
    with pytest.raises(InvalidInput) as refused:
        adapter.validate({"text": ["a", ""]}, {})
    assert "text.1" in refused.value.message
    with pytest.raises(InvalidInput):
        adapter.validate({"text": []}, {})


def test_a_many_input_run_packs_its_vectors_as_float32_bytes() -> None:
    adapter = _adapter()
    run = adapter.new_run(adapter.validate({"text": ["a", "b", "c"]}, {}))
    matrix = np.arange(3 * DIM, dtype=np.float32).reshape(3, DIM)
    run.take(_Result(matrix))  # type: ignore[arg-type]
    outputs, _ = run.final()
    value = outputs["embedding"]
    assert is_packed(value) and value["shape"] == [3, DIM] and vector_rows(value) == 3
    assert np.array_equal(np.frombuffer(packed_bytes(value), dtype="<f4").reshape(3, DIM), matrix)
    single = adapter.new_run(adapter.validate({"text": "a"}, {}))
    single.take(_Result(matrix[:1]))  # type: ignore[arg-type]
    assert single.final()[0]["embedding"] == matrix[0].tolist()  # the single-input form: floats


@pytest.mark.parametrize("dim", [384, 512, 5])
def test_base64_rows_are_the_rows_bytes_and_floats_their_values(dim: int) -> None:
    matrix = np.random.default_rng(dim).standard_normal((4, dim)).astype(np.float32)
    value = packed(matrix.tobytes(), 4, dim)
    for row, text in enumerate(rendered(value, "base64")):
        assert base64.b64decode(text) == matrix[row].tobytes()
    assert np.array_equal(np.asarray(rendered(value, "float"), dtype=np.float32), matrix)
    assert rendered(matrix[0].tolist(), "float") == [matrix[0].tolist()]  # an older record's one vector


def _record(value: Any, request_id: str = "0" * 36) -> ResultRecord:
    now = datetime.now(UTC)
    return ResultRecord(
        request_id=request_id,
        model="text_embed",
        status=State.SUCCEEDED,
        tenant="t",
        outputs={"embedding": value},
        created_at=now,
        finished_at=now,
        index=IndexRef(space="minilm", output="embedding"),
    )


def test_packed_vectors_are_bson_binary_in_mongodb_and_read_back_as_they_were() -> None:
    matrix = np.ones((3, DIM), dtype=np.float32)
    record = _record(packed(matrix.tobytes(), 3, DIM))
    document = bson.decode(bson.encode(record_to_document(record)))
    assert isinstance(document["outputs"]["embedding"]["data"], bytes)  # BSON binary, not base64 text
    assert record_from_document(document).outputs == record.outputs
    old = _record([0.5] * DIM)  # a record of one vector, as stored before
    assert record_from_document(bson.decode(bson.encode(record_to_document(old)))).outputs == old.outputs


class _Store:
    retention = timedelta(days=1)


def test_each_row_of_a_many_input_record_is_indexed_once_and_a_hit_names_its_request_and_row(tmp_path) -> None:
    rng = np.random.default_rng(1)
    matrix = rng.standard_normal((3, DIM)).astype(np.float32)
    matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
    record = _record(packed(matrix.tobytes(), 3, DIM), "A" * 36)
    items = item_of(record, _Store())  # type: ignore[arg-type]
    assert [i.request_id for i in items] == [f"{'A' * 36}#{row}" for row in range(3)]
    document = record_to_document(record) | {"expires_at": datetime.now(UTC) + timedelta(days=1)}
    assert [i.request_id for i in item_from_document(bson.decode(bson.encode(document)))] == [
        i.request_id for i in items
    ]
    index = VectorIndex(tmp_path, use_gpu=False)
    assert index.add(items) == 3 and index.add(items) == 0  # delivered again: nothing added
    key, score = index.search("minilm", matrix[2].tolist(), 1, "t")[0]
    assert hit_of(key, score) == {"request_id": "A" * 36, "score": pytest.approx(1.0, abs=1e-5), "row": 2}
    assert hit_of("B" * 36, 0.5) == {"request_id": "B" * 36, "score": 0.5}  # a one-vector record: no row


def test_usage_counts_a_texts_own_tokens_not_the_padding_of_its_tokenizer() -> None:
    from gateway.stack.stack import minilm_dir

    adapter = EmbeddingAdapter(
        "text_embed",
        "text_embed",
        input_kind="text",
        output_name="embedding",
        space="minilm",
        tokenizer_dir=str(minilm_dir()),
    )
    one = adapter.count_tokens(adapter.validate({"text": "a cat"}, {}))
    assert one is not None and one < 10  # [CLS] a cat [SEP]; MiniLM's tokenizer.json pads to 128
    many = adapter.count_tokens(adapter.validate({"text": ["a cat", "a cat sits on the mat"]}, {}))
    assert many is not None and one < many < 2 * 10


def test_a_client_without_numpy_reads_either_form_of_vectors_as_floats() -> None:
    matrix = np.arange(2 * DIM, dtype=np.float32).reshape(2, DIM)
    assert float_rows(packed(matrix.tobytes(), 2, DIM)) == matrix.tolist()
    assert float_rows([0.5, 0.25]) == [[0.5, 0.25]]
