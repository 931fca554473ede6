"""The vector index: one FAISS inner-product index per (embedding space, tenant)
(vectors are L2-normalised, so inner product is cosine similarity).

Tenants are partitions, not a filter on hits: a search looks only at its tenant's
index, so it returns the tenant's k nearest results however many closer ones other
tenants hold (a search without a tenant merges every tenant's hits).

Each (space, tenant) is an IndexIDMap2 over IndexFlatIP. Its int64 ids are never reused
and map to request ids; a request id already present is skipped, so delivering a
result again adds nothing. Every vector carries its result's expiry (MongoDB's TTL on
expires_at) so the index forgets what MongoDB forgets: an expired vector is never
returned (searches mark what has expired and skip it), and the follower removes the
marked ones from FAISS now and then (remove_ids on a flat index compacts all of it,
too costly to do on every search).

One task writes (the follower, from a worker thread); searches, expiry and snapshots
take the same lock, each only briefly. A snapshot never holds it for a whole clone: it
copies one shard at a time, SNAPSHOT_CHUNK vectors per turn of the lock (a flat index
only grows at its end, so the vectors copied stay where they were; a sweep, which
compacts a shard, makes the copy of that shard start over), and writes that shard's file
before copying the next. Searches and indexing go on between the turns, and the memory a
snapshot takes is one shard's copy, not the whole index's.

Snapshots are atomic: all files go into a fresh directory, are fsynced, and only then
does the CURRENT pointer (itself replaced by rename) move to it. A process killed
mid-snapshot leaves CURRENT on the previous complete snapshot. A snapshot writes only the
shards that changed since the one before (each shard's vectors and its own metadata are
files of their own; an unchanged shard's are hard links to the previous snapshot's), and a
shard whose vectors have all expired and been swept is dropped, in memory and on disk."""

from __future__ import annotations

import heapq
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import faiss
import numpy as np

from gateway.protocol.records import DEFAULT_TENANT

log = logging.getLogger(__name__)

# Older formats (1: no tenants, no expiry; 2: one results stream; 3: every shard's
# metadata in meta.json) are not loaded: the index is rebuilt from MongoDB instead.
SNAPSHOT_FORMAT = 4
NEVER = float("inf")
# Vectors a snapshot copies per turn of the index lock (384-d float32: 24 MiB, a few ms).
SNAPSHOT_CHUNK = 16_384
# A shard whose copy was started over this often (sweeps meanwhile) is copied in one turn.
_SNAPSHOT_RETRIES = 3


class Item(NamedTuple):
    """One vector to index. request_id is its key: the request's id, or for a row of a
    many-input request `<id>#<row>` (row_key), so that each input's vector is indexed
    once and a hit names its request and row (hit_of)."""

    space: str
    tenant: str
    request_id: str
    vector: list[float] | np.ndarray  # a row of the record's float32 bytes, not copied
    expires_at: float = NEVER  # epoch seconds


ROW_MARK = "#"  # not in a request id (Crockford base32)


def row_key(request_id: str, row: int) -> str:
    return f"{request_id}{ROW_MARK}{row}"


def hit_of(key: str, score: float) -> dict[str, Any]:
    """A search hit as the binder answers it: the request, and the row (the input's index
    in its call) for a vector of a many-input request."""
    request_id, _, row = key.partition(ROW_MARK)
    return {"request_id": request_id, "score": score, **({"row": int(row)} if row else {})}


@dataclass
class Shard:
    """The vectors of one (space, tenant)."""

    dim: int
    index: Any  # faiss.IndexIDMap2 (faiss ships no type information)
    request_of: dict[int, str] = field(default_factory=dict)  # FAISS id -> request id
    id_of: dict[str, int] = field(default_factory=dict)
    expiry: list[tuple[float, int]] = field(default_factory=list)  # heap of (expires_at, FAISS id)
    expired: set[int] = field(default_factory=set)  # past expiry, still in FAISS until swept
    next_id: int = 0
    gpu: Any = None  # a GPU copy of the flat vectors for search, when a GPU is present
    generation: int = 0  # changes when a sweep compacts the vectors (positions move)
    version: int = 0  # changes with every change of its vectors (a snapshot rewrites it then)

    @classmethod
    def empty(cls, dim: int) -> Shard:
        return cls(dim=dim, index=faiss.IndexIDMap2(faiss.IndexFlatIP(dim)))

    @property
    def live(self) -> int:
        return len(self.request_of) - len(self.expired)

    def add(self, items: list[Item], now: float) -> int:
        fresh: dict[str, Item] = {}
        for item in items:
            if item.request_id not in self.id_of and item.expires_at > now:
                fresh.setdefault(item.request_id, item)
        if not fresh:
            return 0
        ids = np.arange(self.next_id, self.next_id + len(fresh), dtype=np.int64)
        vectors = np.asarray([item.vector for item in fresh.values()], dtype=np.float32)  # one copy, stacked
        self.index.add_with_ids(vectors, ids)
        if self.gpu is not None:
            self.gpu.add(vectors)  # appended in the same order: GPU positions are flat positions
        for faiss_id, item in zip(ids.tolist(), fresh.values(), strict=True):
            self.request_of[faiss_id] = item.request_id
            self.id_of[item.request_id] = faiss_id
            if item.expires_at != NEVER:
                heapq.heappush(self.expiry, (item.expires_at, faiss_id))
        self.next_id += len(fresh)
        self.version += 1
        return len(fresh)

    def mark_expired(self, now: float) -> None:
        while self.expiry and self.expiry[0][0] <= now:
            self.expired.add(heapq.heappop(self.expiry)[1])

    def sweep(self) -> int:
        """Remove the vectors marked expired from FAISS."""
        if not self.expired:
            return 0
        gone = np.fromiter(self.expired, dtype=np.int64, count=len(self.expired))
        removed = int(self.index.remove_ids(faiss.IDSelectorBatch(gone)))
        self.generation += 1
        self.version += 1
        for faiss_id in self.expired:
            request_id = self.request_of.pop(faiss_id, None)
            if request_id is not None:
                self.id_of.pop(request_id, None)
        self.expired.clear()
        if self.gpu is not None:  # remove_ids compacted the flat vectors: copy them again
            self.gpu.reset()
            if self.index.ntotal:
                self.gpu.add(faiss.downcast_index(self.index.index).reconstruct_n(0, self.index.ntotal))
        return removed

    def search(self, query: np.ndarray, k: int) -> list[tuple[str, float]]:
        total = self.index.ntotal
        if not total:
            return []
        # Ask for as many more as are marked expired, so k live hits remain after skipping them.
        fetch = min(k + len(self.expired), total)
        if self.gpu is not None:
            scores, positions = self.gpu.search(query, fetch)
            id_map = self.index.id_map
            ids = [id_map.at(int(p)) if p >= 0 else -1 for p in positions[0]]
        else:
            scores, found = self.index.search(query, fetch)
            ids = found[0].tolist()
        hits = []
        for score, faiss_id in zip(scores[0].tolist(), ids, strict=True):
            if faiss_id >= 0 and faiss_id not in self.expired:
                hits.append((self.request_of[faiss_id], float(score)))
        return hits[:k]


@dataclass
class Captured:
    """A shard's state copied (in turns of the lock), for writing after it is released."""

    space: str
    tenant: str
    dim: int
    index: Any
    request_ids: list[str]  # in the order of the copy's vectors
    expiry: list[tuple[float, int]]
    expired: set[int]
    version: int  # the shard's version when its copy began


class VectorIndex:
    def __init__(self, directory: Path, use_gpu: bool | None = None, partition: str = "") -> None:
        """partition: which tenants this index holds ("" all; "1/4": partition 1 of 4),
        recorded in each snapshot: one of another partition is not loaded (rebuilt instead)."""
        self.directory = directory
        self.partition = partition
        self.shards: dict[tuple[str, str], Shard] = {}
        self.dims: dict[str, int] = {}
        # The last applied entry of each results stream (one per Redis shard).
        self.positions: dict[str, str] = {}
        # Live vectors per space in the last snapshot this process wrote or loaded (None:
        # none yet): what a restart would start from.
        self.snapshotted: dict[str, int] | None = None
        self.lock = threading.Lock()
        self.snapshot_lock = threading.Lock()  # one snapshot writes at a time
        self.snapshot_chunk = SNAPSHOT_CHUNK
        # Called (without the lock) after each chunk a snapshot copies: tests hold it there.
        self.on_snapshot_chunk: Callable[[], None] | None = None
        # What the last snapshot (written or loaded) holds of each shard: its version then
        # and its files' stem there; a shard still at that version is linked, not written.
        self._written: dict[tuple[str, str], tuple[int, Path]] = {}
        self.use_gpu = faiss.get_num_gpus() > 0 if use_gpu is None else use_gpu
        self._gpu_resources = faiss.StandardGpuResources() if self.use_gpu else None

    @property
    def spaces(self) -> list[str]:
        return sorted(self.dims)

    def ntotal(self, space: str, tenant: str | None = None) -> int:
        """Live (not expired) vectors of a space, of one tenant or of all."""
        shards = list(self.shards.items())  # a copy: healthz reads without the lock
        return sum(shard.live for (name, owner), shard in shards if name == space and tenant in (None, owner))

    def tenants(self, space: str) -> list[str]:
        return sorted(owner for name, owner in list(self.shards) if name == space)

    def _shard(self, space: str, tenant: str) -> Shard:
        shard = self.shards.get((space, tenant))
        if shard is None:
            shard = self.shards[(space, tenant)] = Shard.empty(self.dims[space])
            self._attach_gpu(shard)
        return shard

    def _attach_gpu(self, shard: Shard) -> None:
        if self._gpu_resources is not None:
            shard.gpu = faiss.GpuIndexFlatIP(self._gpu_resources, shard.dim)
            if shard.index.ntotal:
                shard.gpu.add(faiss.downcast_index(shard.index.index).reconstruct_n(0, shard.index.ntotal))

    def add(self, items: list[Item], position: tuple[str, str] | None = None, now: float | None = None) -> int:
        """Index the items (those already expired are skipped). position: (stream, entry
        id) they came up to."""
        now = time.time() if now is None else now
        added = 0
        with self.lock:
            by_shard: dict[tuple[str, str], list[Item]] = {}
            for item in items:
                dim = self.dims.setdefault(item.space, len(item.vector))
                if len(item.vector) != dim:
                    log.warning("space %s: dropping a vector whose size is not %d", item.space, dim)
                    continue
                by_shard.setdefault((item.space, item.tenant), []).append(item)
            for (space, tenant), shard_items in by_shard.items():
                added += self._shard(space, tenant).add(shard_items, now)
            if position is not None:
                self.positions[position[0]] = position[1]
        return added

    def search(
        self, space: str, vector: list[float], k: int, tenant: str | None = None, now: float | None = None
    ) -> list[tuple[str, float]]:
        """The k nearest live vectors of the tenant (of every tenant when None)."""
        now = time.time() if now is None else now
        with self.lock:
            dim = self.dims.get(space)
            if dim is None:
                return []
            if len(vector) != dim:
                raise ValueError(f"space {space} holds {dim}-dimensional vectors, not {len(vector)}")
            if tenant is None:
                shards = [shard for (name, _), shard in self.shards.items() if name == space]
            else:
                shards = [self.shards[(space, tenant)]] if (space, tenant) in self.shards else []
            query = np.asarray([vector], dtype=np.float32)
            hits: list[tuple[str, float]] = []
            for shard in shards:
                shard.mark_expired(now)
                hits.extend(shard.search(query, k))
        hits.sort(key=lambda hit: hit[1], reverse=True)
        return hits[:k]

    def forget_expired(self, now: float | None = None) -> int:
        """Remove every vector whose result has expired; returns how many."""
        now = time.time() if now is None else now
        removed = 0
        with self.lock:
            for key, shard in list(self.shards.items()):
                shard.mark_expired(now)
                removed += shard.sweep()
                if shard.index.ntotal == 0:  # every vector gone: the shard too
                    del self.shards[key]
        if removed:
            log.info("index: removed %d expired vectors", removed)
        return removed

    # -- snapshots --------------------------------------------------------------------

    def position(self, stream: str) -> str:
        return self.positions.get(stream, "0-0")

    def _capture(self, key: tuple[str, str]) -> Captured | None:
        """A copy of one shard, SNAPSHOT_CHUNK vectors per turn of the lock (None: the
        shard is gone, a load replaced the index). Vectors added meanwhile may be in it."""
        for attempt in range(_SNAPSHOT_RETRIES + 1):
            whole = attempt == _SNAPSHOT_RETRIES  # sweeps kept starting it over: one turn
            with self.lock:
                shard = self.shards.get(key)
                if shard is None:
                    return None
                generation, version, total = shard.generation, shard.version, shard.index.ntotal
            copy: Any = faiss.IndexIDMap2(faiss.IndexFlatIP(shard.dim))
            request_ids: list[str] = []
            step = total if whole else max(1, self.snapshot_chunk)
            start = 0
            while True:
                with self.lock:
                    if self.shards.get(key) is not shard or shard.generation != generation:
                        break  # compacted (or replaced) meanwhile: start over
                    if start >= total:
                        # The expiry of what was copied, at the same turn as its last part.
                        return Captured(
                            key[0],
                            key[1],
                            shard.dim,
                            copy,
                            request_ids,
                            list(shard.expiry),
                            set(shard.expired),
                            version,
                        )
                    count = min(step, total - start)
                    vectors = faiss.downcast_index(shard.index.index).reconstruct_n(start, count)
                    ids = faiss.rev_swig_ptr(shard.index.id_map.data(), total)[start : start + count].copy()
                    request_ids.extend(shard.request_of[i] for i in ids.tolist())
                copy.add_with_ids(vectors, ids)
                start += count
                if self.on_snapshot_chunk is not None:
                    self.on_snapshot_chunk()
        raise AssertionError("unreachable: the last attempt copies in one turn")

    def snapshot(self) -> Path:
        """Write every shard (one at a time) and the positions, then move CURRENT to it.
        The positions are taken first: every entry up to them is in the shards copied
        after, and a replay from them adds what came later (again: it is skipped)."""
        with self.snapshot_lock:
            with self.lock:
                positions, keys = dict(self.positions), list(self.shards)
            return self._write(positions, keys)

    def _write(self, positions: dict[str, str], keys: list[tuple[str, str]]) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"snapshot-{time.time_ns()}"
        staging = self.directory / f"{name}.partial"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
        shards_meta: list[dict[str, Any]] = []
        counts: dict[str, int] = {}
        written: dict[tuple[str, str], tuple[int, str]] = {}
        for key in keys:
            stem = f"shard-{len(shards_meta)}"
            with self.lock:
                current = self.shards.get(key)
                if current is None or current.index.ntotal == 0:
                    continue  # gone, or nothing in it: not written
                dim, version, live = current.dim, current.version, current.live
            before = self._written.get(key)
            if before is not None and before[0] == version and _link_files(before[1], staging / stem):
                # Unchanged since the snapshot before: its files, linked (none written).
                counts[key[0]] = counts.get(key[0], 0) + live
            else:
                shard = self._capture(key)
                if shard is None:
                    continue
                version, live = shard.version, self._write_shard(shard, staging / stem)
                counts[key[0]] = counts.get(key[0], 0) + live
                del shard  # one shard's copy at a time: freed before the next is copied
            shards_meta.append(
                {"file": f"{stem}.faiss", "meta": f"{stem}.json", "space": key[0], "tenant": key[1], "dim": dim}
            )
            written[key] = (version, stem)
        meta = {"format": SNAPSHOT_FORMAT, "positions": positions, "shards": shards_meta}
        if self.partition:
            meta["partition"] = self.partition
        with (staging / "meta.json").open("w") as out:
            json.dump(meta, out)
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
        self._written = {key: (version, final / stem) for key, (version, stem) in written.items()}
        self.snapshotted = counts
        return final

    @staticmethod
    def _write_shard(shard: Captured, stem: Path) -> int:
        """A shard's vectors (stem.faiss) and its metadata (stem.json); its live vectors."""
        faiss.write_index(shard.index, str(stem.with_suffix(".faiss")))
        ids = faiss.vector_to_array(shard.index.id_map).tolist()  # in the order of the vectors
        expiry = {faiss_id: at for at, faiss_id in shard.expiry}
        expiry.update(dict.fromkeys(shard.expired, 0.0))  # marked expired: gone at the next sweep
        meta = {"request_ids": shard.request_ids, "expires_at": [_json_time(expiry.get(i, NEVER)) for i in ids]}
        with stem.with_suffix(".json").open("w") as out:
            _dump_in_parts(meta, out)
        return len(ids) - len(shard.expired.intersection(ids))

    def load(self) -> bool:
        """Load the snapshot CURRENT points at. False when there is none, or it is of
        an older format or of another index partition (then the index is rebuilt from
        MongoDB)."""
        pointer = self.directory / "CURRENT"
        if not pointer.exists():
            return False
        snapshot = self.directory / pointer.read_text().strip()
        meta = json.loads((snapshot / "meta.json").read_text())
        if meta.get("format") != SNAPSHOT_FORMAT:
            log.info("snapshot %s is of an older format; rebuilding instead", snapshot.name)
            return False
        if meta.get("partition", "") != self.partition:
            log.info(
                "snapshot %s holds index partition %r, not %r; rebuilding instead",
                snapshot.name,
                meta.get("partition", ""),
                self.partition,
            )
            return False
        shards: dict[tuple[str, str], Shard] = {}
        dims: dict[str, int] = {}
        written: dict[tuple[str, str], tuple[int, Path]] = {}
        for info in meta["shards"]:
            index: Any = faiss.read_index(str(snapshot / info["file"]))  # an IndexIDMap2
            ids = faiss.vector_to_array(index.id_map).tolist()
            own = json.loads((snapshot / info["meta"]).read_text())
            request_ids, expires = own["request_ids"], own["expires_at"]
            if not len(ids) == len(request_ids) == len(expires):
                raise ValueError(f"snapshot {snapshot.name}: {info['file']} has {len(ids)} vectors, other metadata")
            shard = Shard(
                dim=info["dim"],
                index=index,
                request_of=dict(zip(ids, request_ids, strict=True)),
                id_of=dict(zip(request_ids, ids, strict=True)),
                expiry=[(at, i) for i, at in zip(ids, expires, strict=True) if at is not None],
                next_id=max(ids, default=-1) + 1,
            )
            heapq.heapify(shard.expiry)
            self._attach_gpu(shard)
            key = (info["space"], info.get("tenant") or DEFAULT_TENANT)
            shards[key] = shard
            written[key] = (shard.version, snapshot / Path(info["file"]).stem)
            dims[info["space"]] = info["dim"]
        with self.lock:
            self.shards, self.dims = shards, dims
            self.positions = dict(meta["positions"])
        self._written = written
        self.snapshotted = {space: self.ntotal(space) for space in self.spaces}
        return True


def _dump_in_parts(value: Any, out: Any, part: int = SNAPSHOT_CHUNK) -> None:
    """The JSON of value, as json.dump(value, out) writes it but for spacing, each list of
    plain values encoded `part` items at a time: one json.dumps of a million request ids
    and expiry times holds the interpreter's lock ~0.2 s (measured), and every thread of
    the binder waits meanwhile (its /search and /healthz answers too); between two parts
    the others run."""
    if isinstance(value, dict):
        out.write("{")
        for i, (key, item) in enumerate(value.items()):
            out.write(("," if i else "") + json.dumps(key) + ":")
            _dump_in_parts(item, out, part)
        out.write("}")
    elif isinstance(value, list) and value and isinstance(value[0], dict | list):  # the meta's lists are of one kind
        out.write("[")
        for i, item in enumerate(value):
            out.write("," if i else "")
            _dump_in_parts(item, out, part)
        out.write("]")
    elif isinstance(value, list):
        # Each part's text without its brackets: the parts joined by commas are the list's.
        out.write("[" + ",".join(json.dumps(value[i : i + part])[1:-1] for i in range(0, len(value), part)) + "]")
    else:
        out.write(json.dumps(value))


def _link_files(stem: Path, to: Path) -> bool:
    """Hard-link a shard's two files of an earlier snapshot under a new stem (False when
    they are gone or cannot be linked: then the shard is written again)."""
    try:
        for suffix in (".faiss", ".json"):
            os.link(stem.with_suffix(suffix), to.with_suffix(suffix))
    except OSError:
        for suffix in (".faiss", ".json"):
            to.with_suffix(suffix).unlink(missing_ok=True)
        return False
    return True


def _json_time(at: float) -> float | None:
    return None if at == NEVER else at  # JSON has no infinity


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
