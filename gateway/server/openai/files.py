"""The Files API (OpenAI's shapes): POST /v1/files, GET /v1/files, GET /v1/files/{id},
GET /v1/files/{id}/content, DELETE /v1/files/{id}.

Files live in MongoDB's GridFS (bucket `files`), never only in memory: a batch's input
survives any gateway, and its output and error files are written there too. Each file
belongs to one tenant; another tenant gets 404. Uploads are limited to MAX_FILE_BYTES
(413 beyond), and only purpose `batch` is taken (the Batch API is what files are for)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import IO, Annotated, Any

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import StreamingResponse
from gridfs import AsyncGridFSBucket, NoFile
from pymongo import AsyncMongoClient

from gateway.protocol import new_request_id
from gateway.server.api.errors import ApiError
from gateway.server.api.tenancy import Caller, caller
from gateway.server.services import Services, services

router = APIRouter(prefix="/v1", tags=["OpenAI"])

BUCKET = "files"
UPLOAD_PURPOSES = ("batch",)
# Files the Batch API writes (as OpenAI names them).
OUTPUT_PURPOSE = "batch_output"


def new_file_id() -> str:
    return f"file-{new_request_id()}"


class FileStore:
    """Files of tenants in GridFS: content in chunks, what a file is in its metadata."""

    def __init__(self, client: AsyncMongoClient, database: str) -> None:
        self.bucket = AsyncGridFSBucket(client[database], bucket_name=BUCKET)
        self.meta = client[database][f"{BUCKET}.files"]

    async def put(
        self, tenant: str, filename: str, purpose: str, source: bytes | IO[bytes], file_id: str | None = None
    ) -> dict[str, Any]:
        """Store a file (a file_id given again replaces that file: finalizing may be redone)."""
        file_id = file_id or new_file_id()
        if await self._exists(file_id):
            await self.bucket.delete(file_id)
        metadata = {"tenant": tenant, "purpose": purpose, "created_at": int(time.time())}
        await self.bucket.upload_from_stream_with_id(file_id, filename, source, metadata=metadata)
        found = await self.get(tenant, file_id)
        assert found is not None
        return found

    async def _exists(self, file_id: str) -> bool:
        return await self.meta.find_one({"_id": file_id}, {"_id": 1}) is not None

    async def get(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        document = await self.meta.find_one({"_id": file_id, "metadata.tenant": tenant})
        return file_object(document) if document else None

    async def list(self, tenant: str, purpose: str | None, limit: int, after: str | None) -> list[dict[str, Any]]:
        """Newest first (ids grow with time), those older than `after` when given."""
        query: dict[str, Any] = {"metadata.tenant": tenant}
        if purpose:
            query["metadata.purpose"] = purpose
        found = []
        # `after` is applied here, not in the query: nx-27017 refuses range queries on _id
        # in GridFS's collection (a tenant's files are few enough to scan).
        async for document in self.meta.find(query).sort("_id", -1):
            if after is None or document["_id"] < after:
                found.append(file_object(document))
                if len(found) == limit:
                    break
        return found

    async def read(self, tenant: str, file_id: str) -> bytes | None:
        if await self.get(tenant, file_id) is None:
            return None
        stream = await self.bucket.open_download_stream(file_id)
        return await stream.read()

    async def chunks(self, tenant: str, file_id: str) -> AsyncIterator[bytes] | None:
        """The content in GridFS chunks (a large output file is not held in memory)."""
        if await self.get(tenant, file_id) is None:
            return None
        stream = await self.bucket.open_download_stream(file_id)

        async def chunks() -> AsyncIterator[bytes]:
            while chunk := await stream.readchunk():
                yield chunk

        return chunks()

    async def delete(self, tenant: str, file_id: str) -> bool:
        if await self.get(tenant, file_id) is None:
            return False
        try:
            await self.bucket.delete(file_id)
        except NoFile:
            return False
        return True


def file_object(document: dict[str, Any]) -> dict[str, Any]:
    metadata = document.get("metadata") or {}
    return {
        "id": document["_id"],
        "object": "file",
        "bytes": int(document.get("length", 0)),
        "created_at": int(metadata.get("created_at", 0)),
        "filename": document.get("filename") or "",
        "purpose": metadata.get("purpose", ""),
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def files_of(request: Request) -> FileStore:
    return services(request).files


def _not_found(file_id: str) -> ApiError:
    return ApiError(404, "not_found", f"no file {file_id}", details={"param": "file_id"})


@router.post("/files", summary="Upload a file (OpenAI; purpose batch)")
async def upload_file(
    request: Request,
    who: Annotated[Caller, Depends(caller)],
    file: Annotated[UploadFile, File()],
    purpose: Annotated[str, Form()],
) -> dict[str, Any]:
    svc: Services = services(request)
    if purpose not in UPLOAD_PURPOSES:
        raise ApiError(
            400, "invalid_purpose", f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}", details={"param": "purpose"}
        )
    size = file.size if file.size is not None else len(await file.read())
    await file.seek(0)
    if size == 0:
        raise ApiError(400, "empty_file", "the file is empty", details={"param": "file"})
    if size > svc.settings.max_file_bytes:
        raise ApiError(413, "file_too_large", f"a file may be at most {svc.settings.max_file_bytes} bytes")
    return await svc.files.put(who.tenant, label(file.filename), purpose, file.file)


def label(filename: str | None) -> str:
    """A client's file name as an opaque label: its last path part, without control
    characters, at most 255 characters. Files are never stored under it."""
    name = (filename or "").replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(c for c in name if c.isprintable()).strip()
    return name[:255] if name not in ("", ".", "..") else "upload.jsonl"


@router.get("/files", summary="The tenant's files (OpenAI)")
async def list_files(
    request: Request,
    who: Annotated[Caller, Depends(caller)],
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    after: str | None = None,
) -> dict[str, Any]:
    data = await files_of(request).list(who.tenant, purpose, limit + 1, after)
    return {
        "object": "list",
        "data": data[:limit],
        "first_id": data[0]["id"] if data else None,
        "last_id": data[:limit][-1]["id"] if data else None,
        "has_more": len(data) > limit,
    }


@router.get("/files/{file_id}", summary="One file (OpenAI)")
async def get_file(file_id: str, request: Request, who: Annotated[Caller, Depends(caller)]) -> dict[str, Any]:
    found = await files_of(request).get(who.tenant, file_id)
    if found is None:
        raise _not_found(file_id)
    return found


@router.get("/files/{file_id}/content", summary="A file's content (OpenAI)")
async def get_file_content(file_id: str, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    chunks = await files_of(request).chunks(who.tenant, file_id)
    if chunks is None:
        raise _not_found(file_id)
    return StreamingResponse(chunks, media_type="application/octet-stream")


@router.delete("/files/{file_id}", summary="Delete a file (OpenAI)")
async def delete_file(file_id: str, request: Request, who: Annotated[Caller, Depends(caller)]) -> dict[str, Any]:
    if not await files_of(request).delete(who.tenant, file_id):
        raise _not_found(file_id)
    return {"id": file_id, "object": "file", "deleted": True}
