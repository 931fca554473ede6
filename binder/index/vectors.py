"""The vector index: one FAISS inner-product index per embedding space (vectors are
L2-normalised, so inner product is cosine similarity).

Each space is an IndexIDMap2 over IndexFlatIP; its int64 ids are positions in a list of
request ids, and a request id already present is skipped, so delivering a result again
adds nothing. One task writes (the follower); searches take the same lock.

Snapshots are atomic: all files go into a fresh directory, are fsynced, and only then
does the CURRENT pointer (itself replaced by rename) move to it. A process killed
mid-snapshot leaves CURRENT on the previous complete snapshot."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np

log = logging.getLogger(__name__)


@dataclass
class SpaceIndex:
    dim: int
    index: Any  # faiss.IndexIDMap2 (faiss ships no type information)
    request_ids: list[str] = field(default_factory=list)
    positions: dict[str, int] = field(default_factory=dict)
    gpu: Any = None  # a GPU copy for search, when a GPU is present

    @classmethod
    def empty(cls, dim: int) -> SpaceIndex:
        return cls(dim=dim, index=faiss.IndexIDMap2(faiss.IndexFlatIP(dim)))

    def add(self, items: list[tuple[str, list[float]]]) -> int:
        fresh: dict[str, list[float]] = {}
        for request_id, vector in items:
            if request_id not in self.positions and request_id not in fresh and len(vector) == self.dim:
                fresh[request_id] = vector
        if not fresh:
            return 0
        start = len(self.request_ids)
        ids = np.arange(start, start + len(fresh), dtype=np.int64)
        vectors = np.asarray(list(fresh.values()), dtype=np.float32)
        self.index.add_with_ids(vectors, ids)
        if self.gpu is not None:
            self.gpu.add(vectors)  # positions line up: ids are 0..n-1 in order
        for offset, request_id in enumerate(fresh):
            self.request_ids.append(request_id)
            self.positions[request_id] = start + offset
        return len(fresh)

    def search(self, vector: list[float], k: int) -> list[tuple[str, float]]:
        if not self.request_ids:
            return []
        query = np.asarray([vector], dtype=np.float32)
        scores, ids = (self.gpu or self.index).search(query, min(k, len(self.request_ids)))
        return [(self.request_ids[i], float(s)) for s, i in zip(scores[0], ids[0], strict=False) if i >= 0]


class VectorIndex:
    def __init__(self, directory: Path, use_gpu: bool | None = None) -> None:
        self.directory = directory
        self.spaces: dict[str, SpaceIndex] = {}
        self.last_id = "0-0"  # last applied entry of the results stream
        self.lock = threading.Lock()
        self.use_gpu = faiss.get_num_gpus() > 0 if use_gpu is None else use_gpu
        self._gpu_resources = faiss.StandardGpuResources() if self.use_gpu else None

    def ntotal(self, space: str) -> int:
        return self.spaces[space].index.ntotal if space in self.spaces else 0

    def _space(self, name: str, dim: int) -> SpaceIndex:
        space = self.spaces.get(name)
        if space is None:
            space = self.spaces[name] = SpaceIndex.empty(dim)
            self._attach_gpu(space)
        return space

    def _attach_gpu(self, space: SpaceIndex) -> None:
        if self._gpu_resources is not None:
            space.gpu = faiss.GpuIndexFlatIP(self._gpu_resources, space.dim)
            if space.request_ids:
                vectors = faiss.downcast_index(space.index.index).reconstruct_n(0, len(space.request_ids))
                space.gpu.add(vectors)

    def add(self, items: list[tuple[str, str, list[float]]], last_id: str | None = None) -> int:
        """items: (space, request_id, vector). last_id: the stream entry they came up to."""
        added = 0
        with self.lock:
            by_space: dict[str, list[tuple[str, list[float]]]] = {}
            for space, request_id, vector in items:
                by_space.setdefault(space, []).append((request_id, vector))
            for name, pairs in by_space.items():
                target = self._space(name, len(pairs[0][1]))
                if any(len(v) != target.dim for _, v in pairs):
                    log.warning("space %s: dropping vectors whose size is not %d", name, target.dim)
                added += target.add(pairs)
            if last_id is not None:
                self.last_id = last_id
        return added

    def search(self, space: str, vector: list[float], k: int) -> list[tuple[str, float]]:
        with self.lock:
            index = self.spaces.get(space)
            if index is None:
                return []
            if len(vector) != index.dim:
                raise ValueError(f"space {space} holds {index.dim}-dimensional vectors, not {len(vector)}")
            return index.search(vector, k)

    # -- snapshots --------------------------------------------------------------------

    def snapshot(self) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        with self.lock:
            name = f"snapshot-{self.last_id}"
            staging = self.directory / f"{name}.partial"
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir()
            spaces_meta: dict[str, Any] = {}
            for space_name, space in self.spaces.items():
                faiss.write_index(space.index, str(staging / f"{space_name}.faiss"))
                spaces_meta[space_name] = {"dim": space.dim, "request_ids": space.request_ids}
            (staging / "meta.json").write_text(json.dumps({"last_id": self.last_id, "spaces": spaces_meta}))
        for path in staging.iterdir():
            _fsync(path)
        final = self.directory / name
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
        _fsync(self.directory)
        pointer = self.directory / "CURRENT.partial"
        pointer.write_text(name)
        _fsync(pointer)
        pointer.replace(self.directory / "CURRENT")
        _fsync(self.directory)
        for old in self.directory.iterdir():
            if old.is_dir() and old.name != name:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def load(self) -> bool:
        """Load the snapshot CURRENT points at. False when there is none."""
        pointer = self.directory / "CURRENT"
        if not pointer.exists():
            return False
        snapshot = self.directory / pointer.read_text().strip()
        meta = json.loads((snapshot / "meta.json").read_text())
        spaces = {}
        for space_name, info in meta["spaces"].items():
            index = faiss.read_index(str(snapshot / f"{space_name}.faiss"))
            request_ids = list(info["request_ids"])
            if index.ntotal != len(request_ids):
                raise ValueError(
                    f"snapshot {snapshot.name}: {space_name} has {index.ntotal} vectors, {len(request_ids)} ids"
                )
            space = SpaceIndex(
                dim=info["dim"],
                index=index,
                request_ids=request_ids,
                positions={rid: i for i, rid in enumerate(request_ids)},
            )
            self._attach_gpu(space)
            spaces[space_name] = space
        with self.lock:
            self.spaces = spaces
            self.last_id = meta["last_id"]
        return True


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
