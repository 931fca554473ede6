"""Server-Sent Events as an ASGI response, lean enough for one event per token.

The frames are sse_starlette's (its ServerSentEvent is the event type; a `: ping - <time>`
comment after ping_s without an event), with LF line ends (sse_starlette's `sep="\\n"`,
as OpenAI's and most SSE servers write them; CRLF confuses some clients), but a
stream costs two helper tasks for its life (a disconnect watcher and a pinger) and an
event one `send`, not a task group and a cancel scope per send. A client that goes away
ends the stream: the events' generator is closed (its `finally` runs: a /v1 stream
cancels its request there)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from typing import Any

from sse_starlette import ServerSentEvent
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SEP = "\n"
_LINES = re.compile(r"\r\n|\r|\n")
# Line ends some clients split on besides CR and LF (Python's str.splitlines, which httpx's
# aiter_lines uses): a token of U+2028 cut a data line in two there. Every event's data is
# JSON (or /v1's [DONE]), where these can only be inside strings and their \u escape is
# the same character; JSON encoders escape the control characters splitlines also takes.
_OTHER_LINE_ENDS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


class FrameTemplate:
    """The frame of a JSON event rendered once, with holes for JSON values that each event
    fills: a streamed token's frame without a dict built and encoded for it (that cost five
    times what filling costs). A hole is a value `FrameTemplate.hole(i)` in the data, i = 0,
    1, ... in the order they appear in it."""

    _HOLE = re.compile(r'"\ue000(\d)"')

    def __init__(self, data: dict[str, Any]) -> None:
        text = json.dumps(data, ensure_ascii=False).translate(_OTHER_LINE_ENDS)
        pieces = self._HOLE.split(f"data: {text}{SEP}{SEP}")
        self.literals = [piece.encode() for piece in pieces[::2]]
        if pieces[1::2] != [str(i) for i in range(len(self.literals) - 1)]:
            raise ValueError("a frame template's holes are 0, 1, ... in order, each once")

    @staticmethod
    def hole(index: int) -> str:
        return f"\ue000{index}"

    def fill(self, *values: str) -> bytes:
        """The frame with each hole given its value, JSON as json_value() writes it."""
        literals = self.literals
        parts = [literals[0]]
        for value, literal in zip(values, literals[1:], strict=True):
            parts += (value.encode(), literal)
        return b"".join(parts)


def json_value(value: str) -> str:
    """A string as JSON, as a frame's data carries it (see _OTHER_LINE_ENDS)."""
    return _dumps(value).translate(_OTHER_LINE_ENDS)


_dumps = json.JSONEncoder(ensure_ascii=False).encode


def encode(event: ServerSentEvent | bytes) -> bytes:
    """The frame of an event, as sse_starlette writes it (but for _OTHER_LINE_ENDS); bytes
    are a frame already (a FrameTemplate's)."""
    if isinstance(event, bytes):
        return event
    parts = []
    if event.comment is not None:
        parts += [f": {line}{SEP}" for line in _LINES.split(str(event.comment))]
    if event.id is not None:
        parts.append(f"id: {_LINES.sub('', event.id)}{SEP}")
    if event.event is not None:
        parts.append(f"event: {_LINES.sub('', event.event)}{SEP}")
    if event.data is not None:
        data = str(event.data).translate(_OTHER_LINE_ENDS)
        if "\n" in data or "\r" in data:
            parts += [f"data: {line}{SEP}" for line in _LINES.split(data)]
        else:
            parts.append(f"data: {data}{SEP}")
    if event.retry is not None:
        parts.append(f"retry: {event.retry}{SEP}")
    parts.append(SEP)
    return "".join(parts).encode()


class EventStream(StreamingResponse):
    """A streaming response (FastAPI passes it on as it is) that streams events."""

    def __init__(
        self,
        events: AsyncIterator[ServerSentEvent | bytes],
        *,
        ping: float = 15.0,
        headers: Mapping[str, str] | None = None,
        status_code: int = 200,
    ) -> None:
        merged = {"Cache-Control": "no-store", **(headers or {})}
        merged["Connection"] = "keep-alive"
        merged["X-Accel-Buffering"] = "no"
        # (The content given here is never read: __call__ streams the events itself.)
        super().__init__(iter(()), status_code=status_code, headers=merged, media_type="text/event-stream")
        self.events = events
        self.ping_s = ping
        self._last_sent = 0.0
        self._gone = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if scope.get("method", "GET").upper() == "HEAD":
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        streaming = asyncio.current_task()
        assert streaming is not None
        watcher = asyncio.create_task(self._watch(receive, streaming))
        pinger = asyncio.create_task(self._ping(send)) if self.ping_s > 0 else None
        self._last_sent = time.monotonic()
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": encode(event), "more_body": True})
                self._last_sent = time.monotonic()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (asyncio.CancelledError, OSError):
            if not self._gone:
                raise
            streaming.uncancel()  # the client left: the stream just ends
        finally:
            for helper in (watcher, pinger):
                if helper is not None:
                    helper.cancel()
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _watch(self, receive: Receive, streaming: asyncio.Task[None]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._gone = True
                streaming.cancel()
                return

    async def _ping(self, send: Send) -> None:
        while True:
            await asyncio.sleep(max(0.0, self._last_sent + self.ping_s - time.monotonic()))
            if time.monotonic() - self._last_sent >= self.ping_s:
                ping = ServerSentEvent(comment=f"ping - {datetime.now(UTC)}")
                await send({"type": "http.response.body", "body": encode(ping), "more_body": True})
                self._last_sent = time.monotonic()
