"""Sorting Triton and gRPC errors by what to do about them, from the gRPC status code
where there is one and from Triton's structured message where there is not (errors
inside a gRPC stream carry only a message, e.g. "in ensemble 'llm', invalid input: ...")."""

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
_NOT_READY = re.compile(r"is not (ready|found)|unknown model|no model|model .* unavailable", re.IGNORECASE)
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
    if "INVALID_ARGUMENT" in status or "OUT_OF_RANGE" in status or _INVALID.search(message):
        return Failure("invalid_input", message, retryable=False)
    if "DEADLINE_EXCEEDED" in status or _TIMEOUT.search(message):
        return Failure("deadline_exceeded", message, retryable=False)
    if "UNAVAILABLE" in status or isinstance(exc, OSError) or _UNAVAILABLE.search(message):
        return Failure("replica_unavailable", message, retryable=True, eject=True)
    if "NOT_FOUND" in status or _NOT_READY.search(message):
        # The model is not loaded there (being reloaded, or never was): try elsewhere.
        return Failure("model_not_ready", message, retryable=True)
    if "RESOURCE_EXHAUSTED" in status:
        return Failure("replica_overloaded", message, retryable=True)
    return Failure("inference_failed", message, retryable=True)
