"""Sorting Triton and gRPC errors by what to do about them, from the gRPC status code
where there is one and from Triton's structured message where there is not (errors
inside a gRPC stream carry only a message, e.g. "in ensemble 'llm', invalid input: ...").

A model that is not ready on one replica (loading, reloading, failed to load there, or not
in its repository) is not that replica being down: Triton answers it with the status
UNAVAILABLE ("'llm' version 1 is not at ready state"), NOT_FOUND, or INVALID_ARGUMENT
(namespaced repositories), always with its own wording, so that wording is read first.
The request goes to another replica and this one stays in rotation for its other models
(its health probe takes it out if the server itself is down).

What a tenant reads (`message`, into the record's error) is never the raw text, which
names replicas' addresses ("ipv4:10.0.0.5:8001: Failed to connect"): a fixed sentence per
code, or for invalid_input (about the tenant's own input) Triton's text with every address
replaced. The raw text is `detail`, logged here once."""

from __future__ import annotations

import logging
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
    detail: str = ""  # the raw error text: for logs and ejections, never for a tenant

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


log = logging.getLogger(__name__)

# What a tenant is told, by code (invalid_input: its input's own problem, scrubbed).
PUBLIC_MESSAGES = {
    "model_not_ready": "the model is not ready on a Triton replica",
    "deadline_exceeded": "the model did not answer in time",
    "replica_unavailable": "a Triton replica is not answering",
    "replica_overloaded": "a Triton replica is overloaded",
    "inference_failed": "the model failed to run the request",
}
# URLs, gRPC targets (ipv4:/ipv6:/unix:/dns:), IPv4 and bracketed IPv6 addresses, host:port.
_ADDRESS = re.compile(
    r"\b[a-z][a-z0-9+.-]*://\S+|\b(?:ipv4|ipv6|unix|dns):\S+|\[[0-9a-f:.]+\](?::\d+)?|"
    r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b|\b[a-z0-9][a-z0-9.-]*:\d{2,5}\b",
    re.IGNORECASE,
)


def scrubbed(message: str) -> str:
    """The message with every network address in it replaced."""
    return _ADDRESS.sub("<address>", message)


def _failure(code: str, raw: str, retryable: bool, eject: bool = False) -> Failure:
    log.info("triton error, %s: %s", code, raw)
    public = scrubbed(raw)[:1000] if code == "invalid_input" else PUBLIC_MESSAGES[code]
    return Failure(code, public, retryable, eject, detail=raw)


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
        return _failure("model_not_ready", message, retryable=True)
    if "INVALID_ARGUMENT" in status or "OUT_OF_RANGE" in status or _INVALID.search(message):
        return _failure("invalid_input", message, retryable=False)
    if "DEADLINE_EXCEEDED" in status or _TIMEOUT.search(message):
        return _failure("deadline_exceeded", message, retryable=False)
    if "UNAVAILABLE" in status or isinstance(exc, OSError) or _UNAVAILABLE.search(message):
        return _failure("replica_unavailable", message, retryable=True, eject=True)
    if "NOT_FOUND" in status:
        return _failure("model_not_ready", message, retryable=True)
    if "RESOURCE_EXHAUSTED" in status:
        return _failure("replica_overloaded", message, retryable=True)
    return _failure("inference_failed", message, retryable=True)
