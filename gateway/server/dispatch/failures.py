"""Sorting Triton and gRPC errors by what to do about them, from the gRPC status code
where there is one and from Triton's structured message where there is not (errors
inside a gRPC stream carry only a message, e.g. "in ensemble 'llm', invalid input: ...").

A model that is not ready on one replica (loading, reloading, failed to load there, or not
in its repository) is not that replica being down: Triton answers it with the status
UNAVAILABLE ("'llm' version 1 is not at ready state"), NOT_FOUND, or INVALID_ARGUMENT
(namespaced repositories), always with its own wording, so that wording is read first.
The request goes to another replica and this one stays in rotation for its other models
(its health probe takes it out if the server itself is down)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import grpc
from tritonclient.utils import InferenceServerException


@dataclass
class Failure(Exception):
    code: str
    message: str
    retryable: bool
    eject: bool = False  # the replica itself is unusable (take it out of rotation)

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


# Triton and python-backend phrases for a request that cannot succeed anywhere.
_INVALID = re.compile(
    r"invalid[ _]input|invalid[ _]arg|invalid argument|unexpected shape|unexpected datatype|"
    r"expected \d+ inputs|unable to parse|failed to parse|inconsistent batch|exceeds the maximum|"
    r"not (a )?valid|cannot identify image|leaves no room",
    re.IGNORECASE,
)
_UNAVAILABLE = re.compile(
    r"unavailable|connection (refused|reset)|socket closed|failed to connect|broken pipe|stream removed|"
    r"endpoint read failed|goaway",
    re.IGNORECASE,
)
# Triton's model lifecycle ("Request for unknown model: 'llm' version 1 is not at ready
# state", "... has no available versions", "... is not found"), the python backend's BLS
# ("Model 'llm' is not ready.") and other "model ... unavailable" wordings: a sentence
# about a model, not about the connection.
_NOT_READY = re.compile(
    r"unknown model|is not at ready state|has no available versions|no model|"
    r"\bmodel\b[^.;]*?\b(is not ready|is not found|unavailable)\b",
    re.IGNORECASE,
)
_TIMEOUT = re.compile(r"deadline exceeded|request timeout expired|timed out", re.IGNORECASE)


def _status_and_message(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, InferenceServerException):
        return str(exc.status() or ""), exc.message() or str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):
        return str(exc.code()), exc.details() or str(exc)
    return "", str(exc) or type(exc).__name__


def classify(exc: BaseException) -> Failure:
    if isinstance(exc, Failure):
        return exc
    status, message = _status_and_message(exc)
    if _NOT_READY.search(message):
        # The model is not ready there (being reloaded, or never was), whatever the status
        # (Triton answers UNAVAILABLE for a version not at ready state): try elsewhere,
        # without ejecting a replica that serves its other models.
        return Failure("model_not_ready", message, retryable=True)
    if "INVALID_ARGUMENT" in status or "OUT_OF_RANGE" in status or _INVALID.search(message):
        return Failure("invalid_input", message, retryable=False)
    if "DEADLINE_EXCEEDED" in status or _TIMEOUT.search(message):
        return Failure("deadline_exceeded", message, retryable=False)
    if "UNAVAILABLE" in status or isinstance(exc, OSError) or _UNAVAILABLE.search(message):
        return Failure("replica_unavailable", message, retryable=True, eject=True)
    if "NOT_FOUND" in status:
        return Failure("model_not_ready", message, retryable=True)
    if "RESOURCE_EXHAUSTED" in status:
        return Failure("replica_overloaded", message, retryable=True)
    return Failure("inference_failed", message, retryable=True)
