"""The Files API (OpenAI's shapes): POST /v1/files, GET /v1/files, GET /v1/files/{id},
GET /v1/files/{id}/content, DELETE /v1/files/{id}.

Files live in MongoDB's GridFS (bucket `files`), never only in memory: a batch's input
survives any gateway, and its output and error files are written there too. Each file
belongs to one tenant; another tenant gets 404. Uploads are limited to MAX_FILE_BYTES
(413 beyond), and only purpose `batch` is taken (the Batch API is what files are for).
A tenant keeps at most TENANT_MAX_FILES files of TENANT_MAX_FILE_BYTES bytes together
(an upload past either: 403 file_count_quota_exceeded / file_bytes_quota_exceeded), the
uploads being stored counted with them: each is reserved atomically in Redis before a
byte of its body is read, for its declared size (UploadHold; 1 byte when it declares none),
grown as its body arrives past that (decompressed: a gzip upload counts what it decodes
to, and is refused once that passes the quota, not after it was spooled), settled to its
file's size before it is stored and released once: stored, refused or abandoned. So
concurrent uploads cannot all pass one quota, nor spool past it.

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

from gateway.server.api.errors import ApiError, BodyRefused
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
from gateway.server.tenants.reservations import Over, Reservation, now_ms, reserve

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
    hold = getattr(request.state, "body_hold", None)
    if not isinstance(hold, UploadHold):  # reserved before its body only by the edge's check
        async with upload_reserved(svc, who.tenant, size):  # its size as decoded and spooled
            return await svc.files.put(who.tenant, label(file.filename), purpose, file.file, expires_after_s=seconds)
    await hold.settle(size)
    try:
        return await svc.files.put(who.tenant, label(file.filename), purpose, file.file, expires_after_s=seconds)
    finally:
        await hold.close()  # stored (it counts now) or not; the edge's close does nothing then


# What an upload's multipart framing (boundaries, part headers, the form's other fields)
# adds to the file itself, at most.
UPLOAD_FRAMING = 1 << 20


# What an upload's body is taken to hold besides its file when it is reserved: its
# multipart boundaries, part headers and the form's purpose field take a few hundred bytes.
# An upload is reserved for its body's size less this, and grows once its body passes it.
RESERVED_FRAMING = 4096
# An upload's reservation grows at least this much at a time as its body arrives (fewer
# calls to Redis), unless only less fits.
GROWTH_STEP = 1 << 20


async def before_upload(svc: Services, who: Caller, declared: int | None) -> UploadHold | None:
    """POST /v1/files before a byte of its body is read (the edge calls it): the upload
    reserved against the tenant's file quota for its declared size, less its framing (1
    byte when it declares none, as a chunked upload does), or refused 403 then, not after
    the gateway spooled it. None when the tenant's files have no quota."""
    settings = svc.settings
    if not settings.tenant_max_files and not settings.tenant_max_file_bytes:
        return None
    size = max(1, declared - RESERVED_FRAMING) if declared is not None else 1
    return UploadHold(svc, who.tenant, await reserve_upload(svc, who.tenant, size))


class UploadHold:
    """An upload's reservation, made before its body is read (the edge's BodyHold): grown
    as the body arrives past it (counted decompressed, so a small gzip body that decodes
    large is refused as soon as what it decoded passes the quota), settled to the file's
    own size before it is stored, and released once, however the call ends."""

    def __init__(self, svc: Services, tenant: str, reservation: Reservation) -> None:
        self.svc, self.tenant, self.reservation = svc, tenant, reservation

    async def arrived(self, size: int) -> None:
        """The body has brought size bytes so far (decompressed): BodyRefused 403 when the
        file they hold cannot be reserved."""
        needed = size - RESERVED_FRAMING
        held = self.reservation.size
        if needed <= held:
            return
        over = await self.reservation.resize(min(max(needed, held + GROWTH_STEP), self.svc.settings.max_file_bytes))
        if over is not None and needed < self.svc.settings.max_file_bytes:
            over = await self.reservation.resize(needed)  # all that is left, perhaps
        if over is not None:
            code, message, details = _refusal(self.svc, self.tenant, over)
            raise BodyRefused(403, code, message, details)

    async def settle(self, size: int) -> None:
        """Hold the file's own size (its body spooled): ApiError 403 when it does not fit."""
        over = await self.reservation.resize(size)
        if over is not None:
            code, message, details = _refusal(self.svc, self.tenant, over)
            raise ApiError(403, code, message, details=details)

    async def close(self) -> None:
        await self.reservation.release()


# The uploads of a tenant being stored: what counts against its quota besides the files
# it keeps (gateway.server.tenants.reservations).
RESERVATIONS_KEY = "uploads:reserved:{{{tenant}}}"


@asynccontextmanager
async def upload_reserved(svc: Services, tenant: str, size: int) -> AsyncIterator[None]:
    """An upload of size bytes reserved against the tenant's quota while the block stores it
    (refused 403 if it does not fit beside the files and the other reservations), released
    when the block ends, however: concurrent uploads cannot all pass one quota. (An upload
    the edge reserved before its body has its UploadHold instead.)"""
    if not svc.settings.tenant_max_files and not svc.settings.tenant_max_file_bytes:
        yield
        return
    reservation = await reserve_upload(svc, tenant, size)
    try:
        yield
    finally:
        await reservation.release()


async def reserve_upload(svc: Services, tenant: str, size: int) -> Reservation:
    """Reserve size bytes and a file of the tenant's quota (TENANT_MAX_FILES,
    TENANT_MAX_FILE_BYTES, at least one of them set; a batch's output files count too),
    atomically beside the other uploads' reservations; ApiError 403 if it does not fit."""
    settings = svc.settings

    async def usage() -> tuple[int, int]:
        return await svc.files.usage(tenant)

    counted_at_ms = now_ms()
    count, used = await usage()
    reserved = await reserve(
        svc.redis,
        RESERVATIONS_KEY.format(tenant=tenant),
        kept=count,
        kept_bytes=used,
        counted_at_ms=counted_at_ms,
        size=size,
        max_count=settings.tenant_max_files,
        max_bytes=settings.tenant_max_file_bytes,
        recount=usage,
    )
    if isinstance(reserved, Over):
        code, message, details = _refusal(svc, tenant, reserved)
        raise ApiError(403, code, message, details=details)
    return reserved


def _refusal(svc: Services, tenant: str, over: Over) -> tuple[str, str, dict[str, Any]]:
    """The code, message and details of an upload refused past its tenant's file quota."""
    if over.kind == "count":
        max_files = svc.settings.tenant_max_files
        message = (
            f"tenant {tenant} keeps or is storing {over.used} files, its quota (TENANT_MAX_FILES) is "
            f"{max_files}: delete some first"
        )
        return (
            "file_count_quota_exceeded",
            message,
            {"quota": "TENANT_MAX_FILES", "limit": max_files, "used": over.used},
        )
    max_bytes = svc.settings.tenant_max_file_bytes
    message = (
        f"tenant {tenant} keeps or is storing {over.used} bytes of files, this file would take it past its "
        f"quota (TENANT_MAX_FILE_BYTES) of {max_bytes}: delete some first"
    )
    return (
        "file_bytes_quota_exceeded",
        message,
        {"quota": "TENANT_MAX_FILE_BYTES", "limit": max_bytes, "used": over.used},
    )


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
