"""Limits on what a client may send: a body over max_bytes is refused with 413 before it
is read into memory, and a body that does not arrive within body_timeout_s is refused
with 408 (slow senders cannot hold a worker). The header timeout is the HTTP
protocol's (gateway.server.serve)."""

from __future__ import annotations

import asyncio
import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_TOO_LARGE = 413
_TIMEOUT = 408


class BodyRefused(HTTPException):
    # An HTTPException, so FastAPI's body parsing passes it on as is (it turns other
    # errors while reading the body into a 400).
    pass


class RequestLimitsMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        body_timeout_s: float,
        uploads: dict[str, tuple[int, float]] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout_s = body_timeout_s
        # Paths that take larger bodies (file uploads): path -> (max bytes, body timeout).
        self.uploads = uploads or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes, body_timeout_s = self.uploads.get(scope["path"], (self.max_bytes, self.body_timeout_s))
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            await self._refuse(send, _TOO_LARGE, "payload_too_large", f"request body is over {max_bytes} bytes")
            return
        received = 0
        body_done = False
        response_started = False
        loop = asyncio.get_running_loop()
        body_deadline = loop.time() + body_timeout_s

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # waiting for a disconnect while the response streams: no limit
                return await receive()
            try:
                async with asyncio.timeout_at(body_deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyRefused(_TIMEOUT, f"the request body did not arrive within {body_timeout_s:g}s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    raise BodyRefused(_TOO_LARGE, f"request body is over {max_bytes} bytes")
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyRefused as exc:
            if not response_started:
                code = "payload_too_large" if exc.status_code == _TOO_LARGE else "request_timeout"
                await self._refuse(send, exc.status_code, code, str(exc.detail))

    @staticmethod
    async def _refuse(send: Send, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
