"""Anthropic's error body: {"type": "error", "error": {"type", "message"}}, with the
gateway's stable code beside them in `error.code`. Refusals the native API answers 422
are 400 here, as Anthropic answers them."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_status(status: int) -> int:
    return 400 if status == 422 else status


def error_type(status: int) -> str:
    found = _TYPES.get(error_status(status))
    if found is not None:
        return found
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_body(status: int, code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message, "code": code}}


def anthropic_error(
    status: int, code: str, message: str, details: Any = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(anthropic_error_body(status, code, message), status_code=error_status(status), headers=headers)
