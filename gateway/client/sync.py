# Generated from gateway/client/aio.py by tools/unasync_client.py: edit aio.py, not this file.
"""The synchronous client (the same API as the asynchronous one, not awaited)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Literal, Self, overload

import httpx
from httpx_sse import connect_sse

from gateway.client.base import (
    DEFAULT_TIMEOUT_S,
    Event,
    Outcome,
    Submitted,
    _Call,
    _cancel_call,
    _Deadline,
    _ended,
    _EventCursor,
    _events_timeout,
    _generate_wait,
    _llm_inputs,
    _parse_outcome,
    _parse_submitted,
    _raise_for_error,
    _result_call,
    _search_call,
    _still_waiting,
    _submit_call,
    _text_of,
    auth_headers,
    default_api_key,
    default_url,
)
from gateway.protocol import EventKind, ResultRecord, WebhookSpec
from gateway.protocol.http import CancelResponse, SearchResponse


class GatewayClient:
    """Synchronous client. Use it as a context manager, or call close()."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        http: httpx.Client | None = None,
    ) -> None:
        """api_key: GATEWAY_API_KEY, else the key `gateway up` saved, by default."""
        self.base_url = base_url or default_url()
        self.timeout = timeout
        headers = auth_headers(api_key or default_api_key())
        self._http = http or httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: _Call) -> httpx.Response:
        response = self._http.request(
            call.method,
            call.path,
            json=call.json,
            params=call.params,
            headers=call.headers,
            timeout=call.timeout(self.timeout),
        )
        _raise_for_error(response)
        return response

    def submit(
        self,
        model: str,
        inputs: dict[str, Any],
        *,
        parameters: dict[str, Any] | None = None,
        stream: bool = False,
        webhook: WebhookSpec | dict[str, Any] | None = None,
        timeout_s: float | None = None,
        priority: int = 0,
        idempotency_key: str | None = None,
        wait: float | None = None,
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
                    if source.response.status_code == 204:
                        return  # nothing after last_event_id: the request has ended
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
        response = self._send(_cancel_call(request_id))
        return CancelResponse.model_validate(response.json())

    def search(
        self, text: str | None = None, image: str | None = None, space: str | None = None, k: int = 5
    ) -> SearchResponse:
        """The stored results nearest a text or a base64 image."""
        response = self._send(_search_call(text, image, space, k))
        return SearchResponse.model_validate(response.json())

    @overload
    def generate(
        self,
        prompt: str,
        max_tokens: int = ...,
        *,
        stream: Literal[False] = ...,
        parameters: dict[str, Any] | None = ...,
        stop_words: list[str] | None = ...,
        timeout: float | None = ...,
    ) -> str: ...

    @overload
    def generate(
        self,
        prompt: str,
        max_tokens: int = ...,
        *,
        stream: Literal[True],
        parameters: dict[str, Any] | None = ...,
        stop_words: list[str] | None = ...,
        timeout: float | None = ...,
    ) -> Iterator[str]: ...

    def generate(
        self,
        prompt: str,
        max_tokens: int = 64,
        *,
        stream: bool = False,
        parameters: dict[str, Any] | None = None,
        stop_words: list[str] | None = None,
        timeout: float | None = None,
    ) -> str | Iterator[str]:
        """Run the llm: its text, or (stream=True) an iterator of its pieces
        (`for piece in client.generate(prompt, stream=True)`). The request is
        submitted by the call, so a refusal raises there, not at the first iteration.
        `timeout` is the request's deadline (timeout_s); it expires after it."""
        submitted = self.submit(
            "llm",
            _llm_inputs(prompt, max_tokens, stop_words),
            parameters=parameters,
            stream=stream,
            timeout_s=timeout,
            wait=_generate_wait(stream),
        )
        if stream:
            return self.stream_text(submitted.request_id)
        return _text_of(submitted if isinstance(submitted, ResultRecord) else self.wait(submitted.request_id))
