"""Client SDK for the gateway's HTTP API: `GatewayClient` (sync) and `AsyncGatewayClient`.

    with GatewayClient() as client:                      # GATEWAY_URL, else 127.0.0.1:8080
        print(client.generate("The best thing about Triton is", 32))
        accepted = client.submit("llm", {"text_input": "Hi", "max_tokens": 16}, stream=True)
        for piece in client.stream_text(accepted.request_id):
            print(piece, end="", flush=True)

    async with AsyncGatewayClient() as client:
        record = await client.wait((await client.submit("text_embed", {"text": "a cat"})).request_id)

Both clients build their calls and read the answers through the same functions below and
differ only in how they do I/O, the way httpx pairs Client with AsyncClient. Answers parse
into the gateway's own schema models (gateway.schemas, gateway.contracts), so the client
cannot drift from the server it talks to.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Self, overload
from urllib.parse import quote

import httpx
from httpx_sse import ServerSentEvent, aconnect_sse, connect_sse

from gateway.contracts import TERMINAL_EVENT, EventKind, ResultRecord, State, WebhookSpec
from gateway.schemas import Accepted, CancelResponse, LiveStatus, SearchResponse

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


class GatewayError(Exception):
    """The gateway refused a call: `status` is the HTTP status and `code` the stable error
    code (unknown_model, not_found, backlog_full, ...); `retry_after` comes with 429.
    Also raised, with status None, when a request ends without the result asked for
    (`record` is then its final record) or its event stream cannot be followed."""

    def __init__(
        self, status: int | None, code: str, message: str, *,
        retry_after: float | None = None, details: Any = None, record: ResultRecord | None = None,
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
    model: str, inputs: dict[str, Any], parameters: dict[str, Any] | None, stream: bool,
    webhook: WebhookSpec | dict[str, Any] | None, timeout_s: float | None, priority: int,
    idempotency_key: str | None, wait: float | None,
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
        code, message = (error.code, error.message) if error else (record.status.value, f"request {record.status.value}")
        raise GatewayError(None, code, message, record=record)
    return (record.outputs or {}).get("text_output", "")


def _llm_inputs(prompt: str, max_tokens: int, stop_words: list[str] | None) -> dict[str, Any]:
    inputs: dict[str, Any] = {"text_input": prompt, "max_tokens": max_tokens}
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


class GatewayClient:
    """Synchronous client. Use it as a context manager, or call close()."""

    def __init__(
        self, base_url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S,
        http: httpx.Client | None = None,
    ) -> None:
        self.base_url = base_url or default_url()
        self.timeout = timeout
        self._http = http or httpx.Client(base_url=self.base_url, timeout=timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: _Call) -> httpx.Response:
        response = self._http.request(
            call.method, call.path, json=call.json, params=call.params, headers=call.headers,
            timeout=call.timeout(self.timeout),
        )
        _raise_for_error(response)
        return response

    def submit(
        self, model: str, inputs: dict[str, Any], *, parameters: dict[str, Any] | None = None, stream: bool = False,
        webhook: WebhookSpec | dict[str, Any] | None = None, timeout_s: float | None = None, priority: int = 0,
        idempotency_key: str | None = None, wait: float | None = None,
    ) -> Submitted:
        """Queue a request. With `wait`, the gateway holds the answer up to that many
        seconds and returns the record if the request ended by then."""
        call = _submit_call(model, inputs, parameters, stream, webhook, timeout_s, priority, idempotency_key, wait)
        return _parse_submitted(self._send(call))

    def result(self, request_id: str, wait: float | None = None) -> Outcome:
        """The record, or the live state if it has not ended (after up to `wait` s)."""
        return _parse_outcome(self._send(_result_call(request_id, wait)))

    def wait(self, request_id: str, timeout: float | None = None) -> ResultRecord:
        """Long-poll until the request ends; TimeoutError after `timeout` s."""
        deadline = _Deadline(timeout)
        while True:
            outcome = self.result(request_id, wait=deadline.next_poll())
            if record := _ended(outcome):
                return record
            if deadline.passed():
                raise _still_waiting(request_id, outcome, timeout)

    def events(self, request_id: str, last_event_id: str | None = None) -> Iterator[Event]:
        """The request's events up to the terminal one, reconnecting where the last left off."""
        cursor = _EventCursor(request_id, last_event_id)
        while True:
            error: Exception | None = None
            try:
                with connect_sse(
                    self._http, "GET", cursor.path, headers=cursor.headers(), timeout=_events_timeout(self.timeout)
                ) as source:
                    if not source.response.is_success:
                        source.response.read()
                        _raise_for_error(source.response)
                    for sse in source.iter_sse():
                        if (event := cursor.take(sse)) is not None:
                            yield event
                            if event.terminal:
                                return
            except httpx.TransportError as exc:
                error = exc
            time.sleep(cursor.broke_off(error))

    def stream_text(self, request_id: str, last_event_id: str | None = None) -> Iterator[str]:
        """The pieces of text of an llm request as they arrive (the whole text at the end
        if it was submitted without stream=True); GatewayError if it does not succeed."""
        streamed = False
        for event in self.events(request_id, last_event_id):
            if event.kind == EventKind.TOKEN:
                streamed = True
                yield event.text
            elif event.terminal:
                text = _text_of(event.record)
                if not streamed and text:
                    yield text

    def cancel(self, request_id: str) -> CancelResponse:
        """Stop a request (status canceled, or running while it stops); 409 already_finished."""
        return CancelResponse.model_validate(self._send(_cancel_call(request_id)).json())

    def search(
        self, text: str | None = None, image: str | None = None, space: str | None = None, k: int = 5
    ) -> SearchResponse:
        """The stored results nearest a text or a base64 image."""
        return SearchResponse.model_validate(self._send(_search_call(text, image, space, k)).json())

    @overload
    def generate(self, prompt: str, max_tokens: int = ..., *, stream: Literal[False] = ...,
                 parameters: dict[str, Any] | None = ..., stop_words: list[str] | None = ...,
                 timeout: float | None = ...) -> str: ...

    @overload
    def generate(self, prompt: str, max_tokens: int = ..., *, stream: Literal[True],
                 parameters: dict[str, Any] | None = ..., stop_words: list[str] | None = ...,
                 timeout: float | None = ...) -> Iterator[str]: ...

    def generate(
        self, prompt: str, max_tokens: int = 64, *, stream: bool = False, parameters: dict[str, Any] | None = None,
        stop_words: list[str] | None = None, timeout: float | None = None,
    ) -> str | Iterator[str]:
        """Run the llm: its text, or (stream=True) an iterator of its pieces. The request
        is submitted here, so a refusal raises here, not at the first iteration.
        `timeout` is the request's deadline (timeout_s); it expires after it."""
        submitted = self.submit(
            "llm", _llm_inputs(prompt, max_tokens, stop_words), parameters=parameters, stream=stream,
            timeout_s=timeout, wait=_generate_wait(stream),
        )
        if stream:
            return self.stream_text(submitted.request_id)
        return _text_of(submitted if isinstance(submitted, ResultRecord) else self.wait(submitted.request_id))


class AsyncGatewayClient:
    """Asynchronous client. Use it as an async context manager, or await aclose()."""

    def __init__(
        self, base_url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = base_url or default_url()
        self.timeout = timeout
        self._http = http or httpx.AsyncClient(base_url=self.base_url, timeout=timeout)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, call: _Call) -> httpx.Response:
        response = await self._http.request(
            call.method, call.path, json=call.json, params=call.params, headers=call.headers,
            timeout=call.timeout(self.timeout),
        )
        _raise_for_error(response)
        return response

    async def submit(
        self, model: str, inputs: dict[str, Any], *, parameters: dict[str, Any] | None = None, stream: bool = False,
        webhook: WebhookSpec | dict[str, Any] | None = None, timeout_s: float | None = None, priority: int = 0,
        idempotency_key: str | None = None, wait: float | None = None,
    ) -> Submitted:
        """Queue a request. With `wait`, the gateway holds the answer up to that many
        seconds and returns the record if the request ended by then."""
        call = _submit_call(model, inputs, parameters, stream, webhook, timeout_s, priority, idempotency_key, wait)
        return _parse_submitted(await self._send(call))

    async def result(self, request_id: str, wait: float | None = None) -> Outcome:
        """The record, or the live state if it has not ended (after up to `wait` s)."""
        return _parse_outcome(await self._send(_result_call(request_id, wait)))

    async def wait(self, request_id: str, timeout: float | None = None) -> ResultRecord:
        """Long-poll until the request ends; TimeoutError after `timeout` s."""
        deadline = _Deadline(timeout)
        while True:
            outcome = await self.result(request_id, wait=deadline.next_poll())
            if record := _ended(outcome):
                return record
            if deadline.passed():
                raise _still_waiting(request_id, outcome, timeout)

    async def events(self, request_id: str, last_event_id: str | None = None) -> AsyncIterator[Event]:
        """The request's events up to the terminal one, reconnecting where the last left off."""
        cursor = _EventCursor(request_id, last_event_id)
        while True:
            error: Exception | None = None
            try:
                async with aconnect_sse(
                    self._http, "GET", cursor.path, headers=cursor.headers(), timeout=_events_timeout(self.timeout)
                ) as source:
                    if not source.response.is_success:
                        await source.response.aread()
                        _raise_for_error(source.response)
                    async for sse in source.aiter_sse():
                        if (event := cursor.take(sse)) is not None:
                            yield event
                            if event.terminal:
                                return
            except httpx.TransportError as exc:
                error = exc
            await asyncio.sleep(cursor.broke_off(error))

    async def stream_text(self, request_id: str, last_event_id: str | None = None) -> AsyncIterator[str]:
        """The pieces of text of an llm request as they arrive (the whole text at the end
        if it was submitted without stream=True); GatewayError if it does not succeed."""
        streamed = False
        async for event in self.events(request_id, last_event_id):
            if event.kind == EventKind.TOKEN:
                streamed = True
                yield event.text
            elif event.terminal:
                text = _text_of(event.record)
                if not streamed and text:
                    yield text

    async def cancel(self, request_id: str) -> CancelResponse:
        """Stop a request (status canceled, or running while it stops); 409 already_finished."""
        return CancelResponse.model_validate((await self._send(_cancel_call(request_id))).json())

    async def search(
        self, text: str | None = None, image: str | None = None, space: str | None = None, k: int = 5
    ) -> SearchResponse:
        """The stored results nearest a text or a base64 image."""
        return SearchResponse.model_validate((await self._send(_search_call(text, image, space, k))).json())

    @overload
    async def generate(self, prompt: str, max_tokens: int = ..., *, stream: Literal[False] = ...,
                       parameters: dict[str, Any] | None = ..., stop_words: list[str] | None = ...,
                       timeout: float | None = ...) -> str: ...

    @overload
    async def generate(self, prompt: str, max_tokens: int = ..., *, stream: Literal[True],
                       parameters: dict[str, Any] | None = ..., stop_words: list[str] | None = ...,
                       timeout: float | None = ...) -> AsyncIterator[str]: ...

    async def generate(
        self, prompt: str, max_tokens: int = 64, *, stream: bool = False, parameters: dict[str, Any] | None = None,
        stop_words: list[str] | None = None, timeout: float | None = None,
    ) -> str | AsyncIterator[str]:
        """Run the llm: its text, or (stream=True) an async iterator of its pieces:
        `async for piece in await client.generate(prompt, stream=True)`. The request is
        submitted by the await, so a refusal raises there."""
        submitted = await self.submit(
            "llm", _llm_inputs(prompt, max_tokens, stop_words), parameters=parameters, stream=stream,
            timeout_s=timeout, wait=_generate_wait(stream),
        )
        if stream:
            return self.stream_text(submitted.request_id)
        return _text_of(submitted if isinstance(submitted, ResultRecord) else await self.wait(submitted.request_id))


__all__ = [
    "DEFAULT_URL", "AsyncGatewayClient", "Event", "GatewayClient", "GatewayError", "Outcome", "Submitted",
    "default_url",
]
