"""Files of tenants in MongoDB's GridFS (bucket `files`): what the Files API and the batch
runner read and write, and the sweep of expired files (files.py says how files expire)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import IO, Any

from gridfs import AsyncGridFSBucket, NoFile
from gridfs.errors import CorruptGridFile
from pymongo import AsyncMongoClient
from pymongo.errors import PyMongoError

from gateway.protocol import new_request_id

log = logging.getLogger(__name__)

BUCKET = "files"
# OpenAI's bounds of an upload's expires_after[seconds]: one hour to 30 days.
MIN_EXPIRES_AFTER_S = 3600
MAX_EXPIRES_AFTER_S = 30 * 24 * 3600
DEFAULT_RETENTION_S = MAX_EXPIRES_AFTER_S
# Expired files one sweep removes at most (the next sweep takes the rest).
SWEEP_BATCH = 1000
UPLOAD_PURPOSES = ("batch",)
# Files the Batch API writes (as OpenAI names them).
OUTPUT_PURPOSE = "batch_output"


@dataclass(frozen=True, slots=True)
class LongLine:
    """A line longer than a reader's limit, never held: its size in bytes."""

    size: int


def long_line(source: IO[bytes], most: int) -> tuple[int, int] | None:
    """The first line of a file longer than `most` bytes (as FileStore.lines counts it: a
    \\r before its \\n left out), as (its number from 1, the bytes read of it so far, more
    than `most`), or None; the file read from where it stands in chunks of at most `most`
    bytes and never joined (a blocking read: call it in a worker thread). A line wholly
    inside one chunk is shorter than the limit, so only the ends of lines that run from one
    chunk into the next are measured."""
    size = max(1, min(1 << 20, most))
    run = 0  # bytes of the line under way, from chunks before this one
    lines = 1  # its number
    last = b""  # the last byte of the chunk before
    while chunk := source.read(size):
        first = chunk.find(b"\n")
        if first < 0:
            run += len(chunk)
            if run > most + 1:  # (one more: it may end in \r)
                return lines, run
        else:
            before = chunk[first - 1 : first] if first else last
            length = run + first - (before == b"\r")
            if length > most:
                return lines, length
            lines += chunk.count(b"\n")
            run = len(chunk) - chunk.rfind(b"\n") - 1
        last = chunk[-1:]
    length = run - (last == b"\r" and run > 0)
    return (lines, length) if length > most else None


def new_file_id() -> str:
    return f"file-{new_request_id()}"


class FileStore:
    """Files of tenants in GridFS: content in chunks, what a file is in its metadata."""

    def __init__(self, client: AsyncMongoClient, database: str, retention_s: int = DEFAULT_RETENTION_S) -> None:
        self.bucket = AsyncGridFSBucket(client[database], bucket_name=BUCKET)
        self.meta = client[database][f"{BUCKET}.files"]
        self.chunks_collection = client[database][f"{BUCKET}.chunks"]
        self.retention_s = retention_s

    async def put(
        self,
        tenant: str,
        filename: str,
        purpose: str,
        source: bytes | IO[bytes],
        file_id: str | None = None,
        expires_after_s: int | None = None,
    ) -> dict[str, Any]:
        """Store a file (a file_id given again replaces that file: finalizing may be redone),
        expiring expires_after_s from now (None: the retention)."""
        file_id = file_id or new_file_id()
        if await self._exists(file_id):
            await self.bucket.delete(file_id)
        now = int(time.time())
        expires_at = now + (expires_after_s if expires_after_s is not None else self.retention_s)
        metadata = {"tenant": tenant, "purpose": purpose, "created_at": now, "expires_at": expires_at}
        await self.bucket.upload_from_stream_with_id(file_id, filename, source, metadata=metadata)
        found = await self.get(tenant, file_id)
        assert found is not None
        return found

    async def usage(self, tenant: str) -> tuple[int, int]:
        """How many files the tenant keeps (not expired) and their bytes together."""
        count = size = 0
        query = {"metadata.tenant": tenant, **self._unexpired(int(time.time()))}
        async for document in self.meta.find(query, {"length": 1}):
            count += 1
            size += int(document.get("length", 0))
        return count, size

    async def _exists(self, file_id: str) -> bool:
        return await self.meta.find_one({"_id": file_id}, {"_id": 1}) is not None

    def _unexpired(self, now: int) -> dict[str, Any]:
        """A file still to be served (one stored before files expired lasts the retention)."""
        return {
            "$or": [
                {"metadata.expires_at": {"$gt": now}},
                {"metadata.expires_at": {"$exists": False}, "metadata.created_at": {"$gt": now - self.retention_s}},
            ]
        }

    def _expired(self, now: int) -> dict[str, Any]:
        return {
            "$or": [
                {"metadata.expires_at": {"$lte": now}},
                {"metadata.expires_at": {"$exists": False}, "metadata.created_at": {"$lte": now - self.retention_s}},
            ]
        }

    async def get(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        query = {"_id": file_id, "metadata.tenant": tenant, **self._unexpired(int(time.time()))}
        document = await self.meta.find_one(query)
        return file_object(document, self.retention_s) if document else None

    async def list(self, tenant: str, purpose: str | None, limit: int, after: str | None) -> list[dict[str, Any]]:
        """Newest first (ids grow with time), those older than `after` when given."""
        query: dict[str, Any] = {"metadata.tenant": tenant, **self._unexpired(int(time.time()))}
        if purpose:
            query["metadata.purpose"] = purpose
        found = []
        # `after` is applied here, not in the query: nx-27017 refuses range queries on _id
        # in GridFS's collection (a tenant's files are few enough to scan).
        async for document in self.meta.find(query).sort("_id", -1):
            if after is None or document["_id"] < after:
                found.append(file_object(document, self.retention_s))
                if len(found) == limit:
                    break
        return found

    async def read(self, tenant: str, file_id: str) -> bytes | None:
        if await self.get(tenant, file_id) is None:
            return None
        stream = await self.bucket.open_download_stream(file_id)
        return await stream.read()

    async def chunks(self, tenant: str, file_id: str) -> AsyncIterator[bytes] | None:
        """The content in GridFS chunks, read one at a time: a large file is not held in
        memory (GridFS's own download stream reads its chunks in cursor batches of up to
        16 MiB)."""
        document = await self.meta.find_one(
            {"_id": file_id, "metadata.tenant": tenant, **self._unexpired(int(time.time()))}
        )
        if document is None:
            return None
        length, size = int(document.get("length", 0)), int(document.get("chunkSize") or 1)

        async def chunks() -> AsyncIterator[bytes]:
            for n in range(-(-length // size)):
                chunk = await self.chunks_collection.find_one({"files_id": file_id, "n": n})
                if chunk is None:
                    raise CorruptGridFile(f"file {file_id}: chunk {n} is missing")
                yield bytes(chunk["data"])

        return chunks()

    async def lines(self, tenant: str, file_id: str, most: int | None = None) -> AsyncIterator[bytes | LongLine] | None:
        """The content line by line (split at \\n, a \\r before it dropped; the last line
        may lack its \\n), read chunk by chunk: what is held is one chunk and one line. A
        line longer than `most` bytes is never joined: once past it, the rest of it is
        counted and skipped to the next newline, and it comes as a LongLine (its size)."""
        chunks = await self.chunks(tenant, file_id)
        if chunks is None:
            return None
        # A \r may end a line of `most` bytes: one byte more is held until its end shows.
        cap = most + 1 if most is not None else None

        def line(pending: list[bytes]) -> bytes | LongLine:
            data = b"".join(pending).removesuffix(b"\r")
            return LongLine(len(data)) if most is not None and len(data) > most else data

        async def lines() -> AsyncIterator[bytes | LongLine]:
            pending: list[bytes] = []  # the start of a line that goes on in the next chunk
            held = 0  # its bytes
            skipped = 0  # bytes of a line past the cap, skipped so far (0: none)
            async for chunk in chunks:
                start = 0
                while (end := chunk.find(b"\n", start)) >= 0:
                    if skipped:
                        yield LongLine(skipped + end - start)
                    elif cap is not None and held + end - start > cap:
                        yield LongLine(held + end - start)
                    else:
                        pending.append(chunk[start:end])
                        yield line(pending)
                    pending, held, skipped, start = [], 0, 0, end + 1
                rest = len(chunk) - start
                if not rest:
                    continue
                if skipped:
                    skipped += rest
                elif cap is not None and held + rest > cap:
                    pending, held, skipped = [], 0, held + rest
                else:
                    pending.append(chunk[start:])
                    held += rest
            if skipped:
                yield LongLine(skipped)
            elif pending:
                yield line(pending)

        return lines()

    async def delete(self, tenant: str, file_id: str) -> bool:
        if await self.get(tenant, file_id) is None:
            return False
        try:
            await self.bucket.delete(file_id)
        except NoFile:
            return False
        return True

    async def sweep(self, now: float | None = None) -> int:
        """Remove expired files (up to SWEEP_BATCH): chunks first, then the document, so a
        sweep cut short leaves a document that the next one finds again. Gateways may
        sweep at once: removing what is gone already is nothing. How many were removed."""
        expired = self.meta.find(self._expired(int(now if now is not None else time.time())), {"_id": 1})
        file_ids = [document["_id"] async for document in expired.limit(SWEEP_BATCH)]
        for file_id in file_ids:
            await self.chunks_collection.delete_many({"files_id": file_id})
            await self.meta.delete_one({"_id": file_id})
        return len(file_ids)

    async def prepare(self) -> None:
        """Indexes for what the hot paths ask of the file documents: a tenant's files (its
        list, its quota) and the expired ones (the sweep). The local MongoDB-wire server
        keeps its own GridFS indexes and ignores these."""
        await self.meta.create_index([("metadata.tenant", 1), ("_id", -1)])
        await self.meta.create_index([("metadata.expires_at", 1)])

    async def sweep_forever(self, interval_s: float) -> None:
        """prepare(), then sweep() every interval_s (supervised: a MongoDB away is waited out here)."""
        prepared = False
        while True:
            try:
                if not prepared:
                    await self.prepare()
                    prepared = True
                while (removed := await self.sweep()) > 0:
                    log.info("removed %d expired files", removed)
                    if removed < SWEEP_BATCH:
                        break
            except PyMongoError as exc:
                log.warning("sweeping expired files failed (tried again in %.0fs): %s", interval_s, exc)
            await asyncio.sleep(interval_s)


def file_object(document: dict[str, Any], retention_s: int = DEFAULT_RETENTION_S) -> dict[str, Any]:
    metadata = document.get("metadata") or {}
    created_at = int(metadata.get("created_at", 0))
    return {
        "id": document["_id"],
        "object": "file",
        "bytes": int(document.get("length", 0)),
        "created_at": created_at,
        "filename": document.get("filename") or "",
        "purpose": metadata.get("purpose", ""),
        "status": "processed",
        "expires_at": int(metadata.get("expires_at", created_at + retention_s)),
        "status_details": None,
    }
