"""Errors as JSON with a stable code: {"error": {"code", "message", "details"?}}.

Every refusal is a 4xx with a stable code; an outage of Redis or MongoDB is a 503 with
a stable code; a 500 means a bug. Nothing of the request body is logged."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pymongo.errors import PyMongoError
from redis.exceptions import RedisError, ResponseError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.server.errors import Busy, Conflict, InvalidRequest, Refused

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(
        self, status: int, code: str, message: str, *, details: Any = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.details, self.headers = status, code, message, details, headers


def error_body(code: str, message: str, details: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {"code": code, "message": message}
    if details is not None:
        body["details"] = details
    return {"error": body}


def error_response(
    status: int, code: str, message: str, details: Any = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(code, message, details), status_code=status, headers=headers)


def plain_errors(errors: list[Any]) -> list[dict[str, Any]]:
    """Pydantic's error list without the raw input (which can be a large image)."""
    return [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in errors]


def _validation_code(errors: list[Any]) -> str:
    if any(e.get("type") == "json_invalid" for e in errors):
        return "invalid_json"
    return "validation_error"


def refusal_status(exc: Refused) -> int:
    """The native API's status for a domain refusal (the OpenAI dialect answers 422 as 400)."""
    if isinstance(exc, Busy):
        return 429
    if isinstance(exc, InvalidRequest | Conflict):
        return 422
    return 400


_STATUS_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "payload_too_large",
    415: "unsupported_media_type",
}

# An error handler answers in the caller's dialect: the native API's error body, or
# another (OpenAI's, under /v1) chosen by path prefix.
Renderer = Callable[[int, str, str, Any, dict[str, str] | None], JSONResponse]


def install_error_handlers(
    app: FastAPI,
    on_reject: Callable[[str], None] | None = None,
    renderers: dict[str, Renderer] | None = None,
    retry_after_s: int = 1,
) -> None:
    """on_reject(code) is called for every 4xx and 503, for metrics. renderers maps a
    path prefix to the renderer of its error bodies."""
    dialects = sorted((renderers or {}).items(), key=lambda item: -len(item[0]))

    def reject(
        request: Request,
        status: int,
        code: str,
        message: str,
        details: Any = None,
        headers: dict[str, str] | None = None,
    ) -> JSONResponse:
        if on_reject and (400 <= status < 500 or status == 503):
            on_reject(code)
        for prefix, render in dialects:
            if request.url.path.startswith(prefix):
                return render(status, code, message, details, headers)
        return error_response(status, code, message, details, headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return reject(request, exc.status, exc.code, exc.message, exc.details, exc.headers)

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> JSONResponse:
        return reject(request, refusal_status(exc), exc.code, exc.message, exc.details, exc.headers or None)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return reject(request, 422, _validation_code(errors), message, plain_errors(errors))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _STATUS_CODES.get(exc.status_code, f"http_{exc.status_code}")
        return reject(request, exc.status_code, code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(RedisError)
    async def redis_down(request: Request, exc: RedisError) -> JSONResponse:
        retry = {"Retry-After": str(retry_after_s)}
        if isinstance(exc, ResponseError) and str(exc).startswith("OOM"):
            # Redis runs with maxmemory-policy noeviction: accepted work is never evicted,
            # new work is refused until the backlog drains.
            log.warning("Redis is full (maxmemory) on %s %s", request.method, request.url.path)
            return reject(request, 503, "redis_full", "the request store is full; try again shortly", headers=retry)
        log.warning("Redis unavailable on %s %s: %s", request.method, request.url.path, type(exc).__name__)
        message = "the request store (Redis) is not answering; try again"
        return reject(request, 503, "redis_unavailable", message, headers=retry)

    @app.exception_handler(PyMongoError)
    async def mongo_down(request: Request, exc: PyMongoError) -> JSONResponse:
        log.warning("MongoDB unavailable on %s %s: %s", request.method, request.url.path, type(exc).__name__)
        return reject(
            request,
            503,
            "mongo_unavailable",
            "the result store (MongoDB) is not answering; try again",
            headers={"Retry-After": str(retry_after_s)},
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error(
            "unhandled error on %s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc, exc_info=exc
        )
        return reject(request, 500, "internal_error", "internal error; the request was logged")
