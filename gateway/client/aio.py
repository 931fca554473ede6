"""The asynchronous client (the same API as the synchronous one, awaited)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Literal, Self, overload

import httpx
from httpx_sse import aconnect_sse

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


class AsyncGatewayClient:
    """Asynchronous client. Use it as an async context manager, or await aclose()."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        """api_key: GATEWAY_API_KEY, else the key `gateway up` saved, by default."""
        self.base_url = base_url or default_url()
        self.timeout = timeout
        headers = auth_headers(api_key or default_api_key())
        self._http = http or httpx.AsyncClient(base_url=self.base_url, timeout=timeout, headers=headers)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, call: _Call) -> httpx.Response:
        response = await self._http.request(
            call.method,
            call.path,
            json=call.json,
            params=call.params,
            headers=call.headers,
            timeout=call.timeout(self.timeout),
        )
        _raise_for_error(response)
        return response

    async def submit(
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
                    if source.response.status_code == 204:
                        return  # nothing after last_event_id: the request has ended
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
        response = await self._send(_cancel_call(request_id))
        return CancelResponse.model_validate(response.json())

    async def search(
        self, text: str | None = None, image: str | None = None, space: str | None = None, k: int = 5
    ) -> SearchResponse:
        """The stored results nearest a text or a base64 image."""
        response = await self._send(_search_call(text, image, space, k))
        return SearchResponse.model_validate(response.json())

    @overload
    async def generate(
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
    async def generate(
        self,
        prompt: str,
        max_tokens: int = ...,
        *,
        stream: Literal[True],
        parameters: dict[str, Any] | None = ...,
        stop_words: list[str] | None = ...,
        timeout: float | None = ...,
    ) -> AsyncIterator[str]: ...

    async def generate(
        self,
        prompt: str,
        max_tokens: int = 64,
        *,
        stream: bool = False,
        parameters: dict[str, Any] | None = None,
        stop_words: list[str] | None = None,
        timeout: float | None = None,
    ) -> str | AsyncIterator[str]:
        """Run the llm: its text, or (stream=True) an async iterator of its pieces
        (`async for piece in await client.generate(prompt, stream=True)`). The request is
        submitted by the await, so a refusal raises there, not at the first iteration.
        `timeout` is the request's deadline (timeout_s); it expires after it."""
        submitted = await self.submit(
            "llm",
            _llm_inputs(prompt, max_tokens, stop_words),
            parameters=parameters,
            stream=stream,
            timeout_s=timeout,
            wait=_generate_wait(stream),
        )
        if stream:
            return self.stream_text(submitted.request_id)
        return _text_of(submitted if isinstance(submitted, ResultRecord) else await self.wait(submitted.request_id))
