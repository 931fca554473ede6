"""Errors as JSON with a stable code: {"error": {"code", "message", "details"?}}.

Every refusal is a 4xx with a stable code; an outage of Redis or MongoDB is a 503 with
a stable code; a 500 means a bug. Nothing of the request body is logged.

One ErrorRenderer turns every refusal into its answer, in the caller's dialect (the
native body, or OpenAI's under /v1): FastAPI's exception handlers and the hot routes
(gateway.server.api.hot) both use it, so an error reads the same whichever served it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pymongo.errors import PyMongoError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.common.redis import NotReplicated, is_redis_full
from gateway.protocol.storable import STORAGE_REFUSALS
from gateway.server.errors import Busy, Conflict, InvalidRequest, Refused

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(
        self, status: int, code: str, message: str, *, details: Any = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.details, self.headers = status, code, message, details, headers


class BodyRefused(StarletteHTTPException):
    """The request body itself is refused (too large, too slow, not UTF-8). An
    HTTPException, so FastAPI's body parsing passes it on as it is (it turns other errors
    while reading a body into a 400)."""

    def __init__(self, status: int, code: str, message: str, details: Any = None) -> None:
        super().__init__(status, message)
        self.status, self.code, self.message, self.details = status, code, message, details


# A JSON body nested deeper than the parser's recursion limit (json.loads raises
# RecursionError; FastAPI turns it into a 400): answered 400 bad_request by every route.
NESTED_TOO_DEEP = "the JSON body is nested too deeply"


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


def validation_code(errors: list[Any]) -> str:
    if any(e.get("type") == "json_invalid" for e in errors):
        return "invalid_json"
    if errors and errors[0].get("type") in STORAGE_REFUSALS:
        return str(errors[0]["type"])  # what storage cannot hold (gateway.protocol.storable)
    return "validation_error"


def validation_message(errors: list[Any]) -> str:
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")


def refusal_status(exc: Refused) -> int:
    """The native API's status for a domain refusal (the OpenAI dialect answers 422 as 400)."""
    if exc.status is not None:
        return exc.status
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

# An error answers in the caller's dialect: the native API's error body, or another
# (OpenAI's, under /v1) chosen by path prefix.
Renderer = Callable[[int, str, str, Any, dict[str, str] | None], JSONResponse]


class ErrorRenderer:
    def __init__(
        self,
        on_reject: Callable[[str], None] | None = None,
        renderers: dict[str, Renderer] | None = None,
        retry_after_s: int = 1,
    ) -> None:
        """on_reject(code) is called for every 4xx and 503, for metrics. renderers maps a
        path prefix to the renderer of its error bodies."""
        self.on_reject = on_reject
        self.dialects = sorted((renderers or {}).items(), key=lambda item: -len(item[0]))
        self.retry_after_s = retry_after_s

    def response(
        self,
        path: str,
        status: int,
        code: str,
        message: str,
        details: Any = None,
        headers: dict[str, str] | None = None,
    ) -> JSONResponse:
        if self.on_reject and (400 <= status < 500 or status == 503):
            self.on_reject(code)
        for prefix, render in self.dialects:
            if path.startswith(prefix):
                return render(status, code, message, details, headers)
        return error_response(status, code, message, details, headers)

    def validation(self, path: str, errors: list[Any]) -> JSONResponse:
        # What storage cannot hold is what to say first, before a union's other
        # branches' complaints (the input was an object, not "a valid string").
        errors = sorted(errors, key=lambda e: e.get("type") not in STORAGE_REFUSALS)
        return self.response(path, 422, validation_code(errors), validation_message(errors), plain_errors(errors))

    def of(self, path: str, method: str, exc: Exception) -> JSONResponse | None:
        """The answer to a refusal or an outage raised while serving; None for a bug."""
        if isinstance(exc, ApiError):
            return self.response(path, exc.status, exc.code, exc.message, exc.details, exc.headers)
        if isinstance(exc, Refused):
            return self.response(path, refusal_status(exc), exc.code, exc.message, exc.details, exc.headers or None)
        if isinstance(exc, NotReplicated):
            # Written to the primary only (REDIS_WAIT_REPLICAS): not acknowledged. The request
            # exists and may run: resent with the same Idempotency-Key it is found again.
            log.warning("not replicated on %s %s: %s", method, path, exc)
            message = (
                f"the request store could not confirm the request on a replica ({exc}); it may still run: "
                "resend it with the same Idempotency-Key to get it without a duplicate"
            )
            details = {"request_ids": exc.request_ids, "replicas": exc.acked, "wanted": exc.wanted}
            retry = {"Retry-After": str(self.retry_after_s)}
            return self.response(path, 503, "not_replicated", message, details, retry)
        if isinstance(exc, RedisError):
            retry = {"Retry-After": str(self.retry_after_s)}
            if is_redis_full(exc):
                # Redis runs with maxmemory-policy noeviction: accepted work is never evicted,
                # new work is refused until the backlog drains.
                log.warning("Redis is full (maxmemory) on %s %s", method, path)
                message = "the request store is full; try again shortly"
                return self.response(path, 503, "redis_full", message, None, retry)
            log.warning("Redis unavailable on %s %s: %s", method, path, type(exc).__name__)
            message = "the request store (Redis) is not answering; try again"
            return self.response(path, 503, "redis_unavailable", message, None, retry)
        if isinstance(exc, PyMongoError):
            log.warning("MongoDB unavailable on %s %s: %s", method, path, type(exc).__name__)
            return self.response(
                path,
                503,
                "mongo_unavailable",
                "the result store (MongoDB) is not answering; try again",
                None,
                {"Retry-After": str(self.retry_after_s)},
            )
        return None

    def unexpected(self, path: str, method: str, exc: BaseException) -> JSONResponse:
        log.error("unhandled error on %s %s: %s: %s", method, path, type(exc).__name__, exc, exc_info=exc)
        return self.response(path, 500, "internal_error", "internal error; the request was logged")


def install_error_handlers(app: FastAPI, errors: ErrorRenderer) -> None:
    @app.exception_handler(ApiError)
    @app.exception_handler(Refused)
    @app.exception_handler(RedisError)
    @app.exception_handler(PyMongoError)
    async def refusal(request: Request, exc: Exception) -> JSONResponse:
        answer = errors.of(request.url.path, request.method, exc)
        return answer if answer is not None else errors.unexpected(request.url.path, request.method, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return errors.validation(request.url.path, list(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = (
            exc.code if isinstance(exc, BodyRefused) else _STATUS_CODES.get(exc.status_code, f"http_{exc.status_code}")
        )
        message = str(exc.detail)
        if exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):
            message = NESTED_TOO_DEEP  # FastAPI says only "There was an error parsing the body"
        headers = getattr(exc, "headers", None)
        details = exc.details if isinstance(exc, BodyRefused) else None
        return errors.response(request.url.path, exc.status_code, code, message, details, headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return errors.unexpected(request.url.path, request.method, exc)
