"""OpenAI's error body: {"error": {"message", "type", "param", "code"}}. Refusals that
the native API answers 422 are 400 here, as OpenAI answers them."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    410: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


def error_status(status: int) -> int:
    return 400 if status == 422 else status


def openai_error_body(status: int, code: str, message: str, details: Any = None) -> dict[str, Any]:
    param = None
    if isinstance(details, list) and details and isinstance(details[0], dict):
        loc = [str(p) for p in details[0].get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
    elif isinstance(details, dict) and "param" in details:
        param = details["param"]
    kind = _TYPES.get(error_status(status), "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def openai_error(
    status: int, code: str, message: str, details: Any = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = openai_error_body(status, code, message, details)
    return JSONResponse(body, status_code=error_status(status), headers=headers)
