"""A snapshot's meta, written a part at a time (binder/index/vectors.py), reads back as
the whole value."""

from __future__ import annotations

import io
import json

from binder.index.vectors import _dump_in_parts


def test_the_meta_written_in_parts_reads_back_as_the_whole() -> None:
    meta = {
        "format": 3,
        "positions": {"results:0": "1-0", "results:1": "7-3"},
        "shards": [
            {"file": "shard-0.faiss", "request_ids": [f"id-{i}" for i in range(10)], "expires_at": [1.5, None] * 5},
            {"file": "shard-1.faiss", "request_ids": [], "expires_at": []},
        ],
        "partition": "1/4",
    }
    out = io.StringIO()
    _dump_in_parts(meta, out, part=3)
    assert json.loads(out.getvalue()) == meta
