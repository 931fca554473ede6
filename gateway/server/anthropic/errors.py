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


def _anthropic_words(code: str, message: str, details: Any) -> str:
    """A prompt over the model's context in Anthropic's own words, which clients read
    (Claude Code shows "Prompt is too long" from them), the gateway's sentence after them."""
    if code == "prompt_too_long" and isinstance(details, dict):
        tokens, most = details.get("prompt_tokens"), details.get("max_input_tokens")
        if isinstance(tokens, int) and isinstance(most, int):
            return f"prompt is too long: {tokens} tokens > {most} maximum ({message})"
    return message


def anthropic_error_body(status: int, code: str, message: str, details: Any = None) -> dict[str, Any]:
    words = _anthropic_words(code, message, details)
    return {"type": "error", "error": {"type": error_type(status), "message": words, "code": code}}


def anthropic_error(
    status: int, code: str, message: str, details: Any = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = anthropic_error_body(status, code, message, details)
    return JSONResponse(body, status_code=error_status(status), headers=headers)
