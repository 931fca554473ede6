"""The Files API (OpenAI's shapes): POST /v1/files, GET /v1/files, GET /v1/files/{id},
GET /v1/files/{id}/content, DELETE /v1/files/{id}.

Files live in MongoDB's GridFS (bucket `files`), never only in memory: a batch's input
survives any gateway, and its output and error files are written there too. Each file
belongs to one tenant; another tenant gets 404. Uploads are limited to MAX_FILE_BYTES
(413 beyond), and only purpose `batch` is taken (the Batch API is what files are for).
A tenant keeps at most TENANT_MAX_FILES files of TENANT_MAX_FILE_BYTES bytes together
(an upload past either: 403 file_count_quota_exceeded / file_bytes_quota_exceeded), the
uploads being stored counted with them: each is reserved atomically in Redis while it is
stored (upload_reserved), so concurrent uploads cannot all pass one quota.

Every file expires (its `expires_at`): an upload FILE_RETENTION_S (30 days) after it was
made, or after OpenAI's `expires_after` (anchor `created_at`, one hour to 30 days); a
batch's output and error files FILE_RETENTION_S after they are written. An expired file
reads as gone at once (404, not listed); every gateway sweeps expired files out of GridFS
(chunks, then the file document) every FILE_SWEEP_INTERVAL_S. A TTL index cannot do it:
GridFS's chunks carry no date, and the local MongoDB-wire server (nx-27017) keeps no TTL
index on GridFS's collections."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import StreamingResponse

from gateway.server.api.errors import ApiError
from gateway.server.api.tenancy import Caller, caller
from gateway.server.openai.files.store import (
    MAX_EXPIRES_AFTER_S,
    MIN_EXPIRES_AFTER_S,
    UPLOAD_PURPOSES,
    FileStore,
    long_line,
)
from gateway.server.openai.paging import listing
from gateway.server.services import Services, services
from gateway.server.tenants.reservations import Over, Release, now_ms, reserve

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["OpenAI"])


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
    anchor: Annotated[str | None, Form(alias="expires_after[anchor]")] = None,
    seconds: Annotated[int | None, Form(alias="expires_after[seconds]")] = None,
) -> dict[str, Any]:
    svc: Services = services(request)
    if purpose not in UPLOAD_PURPOSES:
        raise ApiError(
            400, "invalid_purpose", f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}", details={"param": "purpose"}
        )
    if (anchor, seconds) != (None, None):
        if anchor != "created_at":
            raise ApiError(
                400,
                "invalid_expires_after",
                "expires_after[anchor] must be created_at",
                details={"param": "expires_after"},
            )
        if seconds is None or not MIN_EXPIRES_AFTER_S <= seconds <= MAX_EXPIRES_AFTER_S:
            raise ApiError(
                400,
                "invalid_expires_after",
                f"expires_after[seconds] must be between {MIN_EXPIRES_AFTER_S} and {MAX_EXPIRES_AFTER_S}",
                details={"param": "expires_after"},
            )
    size = file.size if file.size is not None else len(await file.read())
    await file.seek(0)
    if size == 0:
        raise ApiError(400, "empty_file", "the file is empty", details={"param": "file"})
    if size > svc.settings.max_file_bytes:
        raise ApiError(413, "file_too_large", f"a file may be at most {svc.settings.max_file_bytes} bytes")
    if purpose == "batch":  # a line the batch runner would refuse is refused now, by a streaming scan
        limit = svc.settings.batch_max_line_bytes
        found = await asyncio.to_thread(long_line, file.file, limit)
        file.file.seek(0)
        if found is not None:
            line, length = found
            raise ApiError(
                400,
                "line_too_large",
                f"line {line} of the file has more than {limit} bytes ({length} read); a batch line may have at "
                f"most {limit} (BATCH_MAX_LINE_BYTES)",
                details={"param": "file", "line": line, "limit": limit},
            )
    async with upload_reserved(svc, who.tenant, size):  # its size as decoded and spooled
        return await svc.files.put(who.tenant, label(file.filename), purpose, file.file, expires_after_s=seconds)


# What an upload's multipart framing (boundaries, part headers, the form's other fields)
# adds to the file itself, at most.
UPLOAD_FRAMING = 1 << 20


async def before_upload(svc: Services, who: Caller, declared: int | None) -> None:
    """POST /v1/files before a byte of its body is read (the edge calls it): an upload
    whose declared size, less its framing, would take the tenant past its file quota is
    refused then, not after the gateway spooled it (checked again on the file's own size)."""
    size = max(1, declared - UPLOAD_FRAMING) if declared is not None else 1
    await refuse_over_quota(svc, who.tenant, size)


# The uploads of a tenant being stored: what counts against its quota besides the files
# it keeps (gateway.server.tenants.reservations).
RESERVATIONS_KEY = "uploads:reserved:{{{tenant}}}"


async def refuse_over_quota(svc: Services, tenant: str, size: int) -> None:
    """Refuse (403) an upload of size bytes that would take the tenant past what it may
    store, counting the uploads being stored now (a check: nothing is reserved)."""
    release = await reserve_upload(svc, tenant, size)
    await release()


@asynccontextmanager
async def upload_reserved(svc: Services, tenant: str, size: int) -> AsyncIterator[None]:
    """An upload of size bytes reserved against the tenant's quota while the block stores it
    (refused 403 if it does not fit beside the files and the other reservations), released
    when the block ends, however: concurrent uploads cannot all pass one quota."""
    release = await reserve_upload(svc, tenant, size)
    try:
        yield
    finally:
        await release()


async def reserve_upload(svc: Services, tenant: str, size: int) -> Release:
    """Reserve size bytes and a file of the tenant's quota (TENANT_MAX_FILES,
    TENANT_MAX_FILE_BYTES; 0: no limit; a batch's output files count too), atomically
    beside the other uploads' reservations; ApiError 403 if it does not fit. Returns its
    release."""
    settings = svc.settings
    max_files, max_bytes = settings.tenant_max_files, settings.tenant_max_file_bytes

    async def nothing() -> None:
        return None

    if not max_files and not max_bytes:
        return nothing
    counted_at_ms = now_ms()
    count, used = await svc.files.usage(tenant)
    key = RESERVATIONS_KEY.format(tenant=tenant)
    reserved = await reserve(
        svc.redis,
        key,
        kept=count,
        kept_bytes=used,
        counted_at_ms=counted_at_ms,
        size=size,
        max_count=max_files,
        max_bytes=max_bytes,
    )
    if isinstance(reserved, Over) and reserved.kind == "count":
        raise ApiError(
            403,
            "file_count_quota_exceeded",
            f"tenant {tenant} keeps or is storing {reserved.used} files, its quota (TENANT_MAX_FILES) is "
            f"{max_files}: delete some first",
            details={"quota": "TENANT_MAX_FILES", "limit": max_files, "used": reserved.used},
        )
    if isinstance(reserved, Over):
        raise ApiError(
            403,
            "file_bytes_quota_exceeded",
            f"tenant {tenant} keeps or is storing {reserved.used} bytes of files, this file would take it past its "
            f"quota (TENANT_MAX_FILE_BYTES) of {max_bytes}: delete some first",
            details={"quota": "TENANT_MAX_FILE_BYTES", "limit": max_bytes, "used": reserved.used},
        )
    return reserved


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
    return listing(data[:limit], len(data) > limit)


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
