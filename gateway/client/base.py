"""What the sync and async clients share: building calls, reading answers, errors,
events, and following an event stream across reconnects. The two clients differ only in
how they do I/O, the way httpx pairs Client with AsyncClient. Answers parse into the
gateway's own wire models (gateway.protocol), so the client cannot drift from the server."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from httpx_sse import ServerSentEvent

from gateway.protocol import TERMINAL_EVENT, EventKind, ResultRecord, State, WebhookSpec
from gateway.protocol.http import Accepted, LiveStatus

DEFAULT_URL = "http://127.0.0.1:8080"
DEFAULT_TIMEOUT_S = 30.0
# The longest single long-poll wait() asks for; the gateway caps waits (max_wait_s, 60 s).
LONG_POLL_S = 30.0
# The gateway sends an SSE keep-alive every 15 s: four missed ones mean the connection is dead.
EVENTS_READ_TIMEOUT_S = 60.0
# Reconnects in a row, with no event in between, before an event stream is given up.
MAX_RECONNECTS = 5

TERMINAL_EVENTS = frozenset(kind.value for kind in TERMINAL_EVENT.values())

# GET /results/<id>: the stored record once the request has ended, its live state before.
Outcome = ResultRecord | LiveStatus
# POST /infer: the id (202), or the record when `wait` was given and it ended in time (200).
Submitted = Accepted | ResultRecord


def default_url() -> str:
    return os.environ.get("GATEWAY_URL") or DEFAULT_URL


def default_api_key() -> str | None:
    """GATEWAY_API_KEY, else the key `gateway up` saved in its data directory
    (STACK_DATA_DIR, default .stack)."""
    key = os.environ.get("GATEWAY_API_KEY")
    if key:
        return key.strip()
    saved = Path(os.environ.get("STACK_DATA_DIR") or ".stack") / "api_key"
    try:
        return saved.read_text().strip() or None
    except OSError:
        return None


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class GatewayError(Exception):
    """The gateway refused a call: `status` is the HTTP status and `code` the stable error
    code (unknown_model, not_found, backlog_full, ...); `retry_after` comes with 429.
    Also raised, with status None, when a request ends without the result asked for
    (`record` is then its final record) or its event stream cannot be followed."""

    def __init__(
        self,
        status: int | None,
        code: str,
        message: str,
        *,
        retry_after: float | None = None,
        details: Any = None,
        record: ResultRecord | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}" if status is None else f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after
        self.details = details
        self.record = record


@dataclass(frozen=True)
class Event:
    """One Server-Sent Event of a request: queued, running, token, output, then
    completed | failed | canceled | expired (whose data is the final record)."""

    id: str
    kind: str  # a str, not an EventKind, so that a newer gateway's new kinds do not break this client
    data: dict[str, Any]

    @property
    def terminal(self) -> bool:
        return self.kind in TERMINAL_EVENTS

    @property
    def text(self) -> str:
        """The piece of text a token event carries ("" for other events)."""
        return self.data.get("text_output", "") if self.kind == EventKind.TOKEN else ""

    @property
    def record(self) -> ResultRecord:
        if not self.terminal:
            raise ValueError(f"a {self.kind} event carries no record")
        return ResultRecord.model_validate(self.data)


# -- Building calls and reading answers (shared by both clients) -------------------------


@dataclass(frozen=True)
class _Call:
    method: str
    path: str
    json: dict[str, Any] | None = None
    params: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    # The gateway may hold the answer this long (long-poll), so the read timeout grows by it.
    hold_s: float = 0.0

    def timeout(self, base: float) -> httpx.Timeout:
        return httpx.Timeout(base, read=base + self.hold_s)


def _path(request_id: str, tail: str = "") -> str:
    # Ids come from users (CLI arguments): quoting keeps one from reaching another route.
    return f"/results/{quote(request_id, safe='')}{tail}"


def _submit_call(
    model: str,
    inputs: dict[str, Any],
    parameters: dict[str, Any] | None,
    stream: bool,
    webhook: WebhookSpec | dict[str, Any] | None,
    timeout_s: float | None,
    priority: int,
    idempotency_key: str | None,
    wait: float | None,
) -> _Call:
    body: dict[str, Any] = {"model": model, "inputs": inputs, "stream": stream, "priority": priority}
    if parameters:
        body["parameters"] = parameters
    if webhook is not None:
        body["webhook"] = webhook.model_dump() if isinstance(webhook, WebhookSpec) else webhook
    if timeout_s is not None:
        body["timeout_s"] = timeout_s
    headers = {}
    if idempotency_key is not None:
        headers["Idempotency-Key"] = idempotency_key
    if wait is not None:
        headers["Prefer"] = f"wait={wait:g}"
    return _Call("POST", "/infer", json=body, headers=headers, hold_s=wait or 0.0)


def _result_call(request_id: str, wait: float | None) -> _Call:
    return _Call("GET", _path(request_id), params={"wait": wait} if wait else None, hold_s=wait or 0.0)


def _cancel_call(request_id: str) -> _Call:
    # A running request is given up to 5 s to stop before the gateway answers.
    return _Call("POST", _path(request_id, "/cancel"), hold_s=5.0)


def _search_call(text: str | None, image: str | None, space: str | None, k: int) -> _Call:
    body: dict[str, Any] = {"k": k}
    for name, value in (("text", text), ("image", image), ("space", space)):
        if value is not None:
            body[name] = value
    return _Call("POST", "/search", json=body)


def _events_timeout(base: float) -> httpx.Timeout:
    return httpx.Timeout(base, read=max(base, EVENTS_READ_TIMEOUT_S))


def _raise_for_error(response: httpx.Response) -> None:
    """Turn a refusal into GatewayError; the body must have been read."""
    if response.is_success:
        return
    try:
        error = response.json()["error"]
        code, message, details = str(error["code"]), str(error["message"]), error.get("details")
    except (ValueError, KeyError, TypeError):
        # Not the gateway's error body (a proxy in front of it answered, say).
        code, message, details = f"http_{response.status_code}", response.text[:500] or response.reason_phrase, None
    raise GatewayError(response.status_code, code, message, retry_after=_retry_after(response), details=details)


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["Retry-After"])
    except (KeyError, ValueError):
        return None  # absent, or an HTTP date, which the gateway does not send


def _parse_submitted(response: httpx.Response) -> Submitted:
    body = response.json()
    return ResultRecord.model_validate(body) if response.status_code == 200 else Accepted.model_validate(body)


def _parse_outcome(response: httpx.Response) -> Outcome:
    body = response.json()
    # The gateway writes the terminal state and the record together, so a terminal status means a record.
    return ResultRecord.model_validate(body) if State(body["status"]).terminal else LiveStatus.model_validate(body)


def _ended(outcome: Outcome) -> ResultRecord | None:
    return outcome if isinstance(outcome, ResultRecord) and outcome.status.terminal else None


def _text_of(record: ResultRecord) -> str:
    """The generated text of a finished llm request; GatewayError if it did not succeed."""
    if record.status != State.SUCCEEDED:
        error = record.error
        code, message = (
            (error.code, error.message) if error else (record.status.value, f"request {record.status.value}")
        )
        raise GatewayError(None, code, message, record=record)
    return (record.outputs or {}).get("text_output", "")


def _llm_inputs(prompt: str, max_tokens: int, stop_words: list[str] | None, *, raw: bool = False) -> dict[str, Any]:
    """The prompt as one user turn (the model's chat template applies: what an instruct
    model expects), or as raw text to continue."""
    inputs: dict[str, Any] = (
        {"text_input": prompt, "max_tokens": max_tokens}
        if raw
        else {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    )
    if stop_words:
        inputs["stop_words"] = stop_words
    return inputs


def _generate_wait(stream: bool) -> float | None:
    # Without streaming, let the submit itself hold for the answer: one call for short work.
    return None if stream else LONG_POLL_S


class _Deadline:
    """wait()'s overall limit, cut into long-polls the gateway will honour."""

    def __init__(self, timeout: float | None) -> None:
        self.end = None if timeout is None else time.monotonic() + timeout

    def next_poll(self) -> float:
        if self.end is None:
            return LONG_POLL_S
        return max(0.0, min(LONG_POLL_S, self.end - time.monotonic()))

    def passed(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end


def _still_waiting(request_id: str, outcome: Outcome, timeout: float | None) -> TimeoutError:
    return TimeoutError(f"{request_id} is still {outcome.status.value} after {timeout:g}s")


class _EventCursor:
    """Where an event stream has got to, so that a dropped connection resumes
    (Last-Event-ID) with nothing lost or repeated."""

    def __init__(self, request_id: str, last_event_id: str | None) -> None:
        self.path = _path(request_id, "/events")
        self.last_event_id = last_event_id
        self.failures = 0

    def headers(self) -> dict[str, str]:
        return {"Last-Event-ID": self.last_event_id} if self.last_event_id else {}

    def take(self, sse: ServerSentEvent) -> Event | None:
        # httpx-sse reports a keep-alive comment as an empty "message" once an id was seen; skip it.
        if not sse.data:
            return None
        self.failures = 0
        self.last_event_id = sse.id or self.last_event_id
        return Event(id=sse.id, kind=sse.event, data=sse.json())

    def broke_off(self, error: Exception | None) -> float:
        """The stream ended before a terminal event (error: how). Returns the pause
        before reconnecting; raises once that has happened too often in a row."""
        self.failures += 1
        if self.failures > MAX_RECONNECTS:
            if error is not None:
                raise error
            raise GatewayError(None, "events_incomplete", f"{self.path} keeps ending before the request does")
        return min(0.25 * 2 ** (self.failures - 1), 4.0)


# -- The clients -------------------------------------------------------------------------
