"""Embeddings as bytes: how a record holds the vectors of a many-input call.

A many-input embeddings call (the /v1 list, the native `POST /infer` with a list) is one
request, and its record's output holds all its vectors as one block of little-endian
float32, row after row, as Triton returned them:

    {"dtype": "float32", "shape": [rows, dim], "data": "<base64 of rows x dim x 4 bytes>"}

In JSON (Redis, the HTTP API) `data` is base64; in MongoDB it is BSON binary. A
single-input native request keeps the older form, one vector as a list of floats, as do
the records stored before the packed form existed: readers take both (`vector_rows`).

Pure data (no numpy): the gateway and the binder make arrays of the bytes themselves. The
base64 is decoded by pydantic-core (Rust; a 64 x 512 block in ~1/5 of binascii's time)."""

from __future__ import annotations

import base64
import sys
from array import array
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

DTYPE = "float32"
ITEM_BYTES = 4
# bytes from a JSON string of their base64 (standard or URL-safe alphabet, padded or not).
_BASE64 = TypeAdapter(bytes, config=ConfigDict(val_json_bytes="base64"))


def packed(data: bytes, rows: int, dim: int) -> dict[str, Any]:
    """The packed form of rows x dim float32 values (little-endian, row after row)."""
    if len(data) != rows * dim * ITEM_BYTES:
        raise ValueError(f"{len(data)} bytes are not {rows} x {dim} float32 values")
    return {"dtype": DTYPE, "shape": [rows, dim], "data": base64.b64encode(data).decode("ascii")}


def is_packed(value: Any) -> bool:
    return isinstance(value, dict) and value.get("dtype") == DTYPE and "shape" in value and "data" in value


def packed_shape(value: dict[str, Any]) -> tuple[int, int]:
    rows, dim = value["shape"]
    return int(rows), int(dim)


def packed_bytes(value: dict[str, Any]) -> bytes:
    """The float32 bytes of a packed value, whether it holds them as base64 text (JSON) or
    as bytes (read from MongoDB)."""
    data = value["data"]
    raw = bytes(data) if isinstance(data, bytes | bytearray | memoryview) else b64decode(data)
    rows, dim = packed_shape(value)
    if len(raw) != rows * dim * ITEM_BYTES:
        raise ValueError(f"packed vectors of shape {rows}x{dim} hold {len(raw)} bytes")
    return raw


def b64decode(text: str) -> bytes:
    """The bytes of a block's base64 (for ours, standard and padded, base64.b64decode's),
    decoded by pydantic-core as a JSON string holding it; by base64 where that refuses it
    (text that is not base64 of ours, a quote or a backslash in it)."""
    try:
        return _BASE64.validate_json(f'"{text}"')
    except ValidationError:
        return base64.b64decode(text)


def vector_rows(value: Any) -> int:
    """How many vectors an embedding output holds: a packed block's rows, 1 for a list of
    floats (the single-input form), 0 for anything else."""
    if is_packed(value):
        return packed_shape(value)[0]
    return 1 if isinstance(value, list) and value else 0


def float_rows(value: Any) -> list[list[float]]:
    """An embedding output's vectors as lists of floats, whichever form it has (for clients
    without numpy; with numpy: np.frombuffer(packed_bytes(value), "<f4").reshape(shape))."""
    if not is_packed(value):
        return [list(value)] if isinstance(value, list) and value else []
    rows, dim = packed_shape(value)
    values = array("f", packed_bytes(value))
    if sys.byteorder != "little":
        values.byteswap()
    return [values[row * dim : (row + 1) * dim].tolist() for row in range(rows)]
