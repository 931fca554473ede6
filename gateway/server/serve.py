"""Serving the app with uvicorn: one process, or `workers` processes on the port (workers.py).

uvicorn (httptools) has no limit on how long a client may take to send its request
headers, nor on how large they may be: a connection that trickles (or never finishes)
its headers would be held for good, and one that sends megabytes of them would be read
into memory. The protocol below closes the first after header_timeout_s and answers the
second 431 once its headers pass max_header_bytes; and a connection closed after a
refusal from the headers lingers (LINGER_S) so that its answer is not lost to a reset."""

from __future__ import annotations

import asyncio
import functools
import json

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.server.settings import GatewaySettings
from gateway.server.workers import OwnSocketProcesses


@functools.cache
def _settings() -> GatewaySettings:
    return GatewaySettings()


def _too_large(limit: int) -> bytes:
    body = json.dumps(
        {"error": {"code": "headers_too_large", "message": f"request headers are over {limit} bytes"}}
    ).encode()
    head = (
        "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


# How long a connection closed before its request body was read (a refusal from the
# headers: 401, 413, a quota) keeps reading, and dropping, what still arrives: closed at
# once, the kernel would answer those bytes with a reset, and a proxy that streams the
# body (nginx with proxy_request_buffering off) would lose the answer and say 502.
LINGER_S = 2.0


class _LingeringTransport:
    """The connection's transport, whose close() half-closes (FIN after the answer) and
    closes for good LINGER_S later when the request's body was not read to its end."""

    def __init__(self, transport: asyncio.Transport, protocol: LimitedHttpProtocol) -> None:
        self._transport, self._protocol = transport, protocol

    def __getattr__(self, name: str) -> object:
        return getattr(self._transport, name)

    def close(self) -> None:
        transport, protocol = self._transport, self._protocol
        cycle = protocol.cycle
        unread = cycle is not None and cycle.more_body and not protocol.lingering
        if not unread or transport.is_closing() or not transport.can_write_eof():
            transport.close()
            return
        protocol.lingering = True
        transport.write_eof()
        protocol.flow.resume_reading()
        protocol.loop.call_later(LINGER_S, transport.close)


class LimitedHttpProtocol(HttpToolsProtocol):
    _header_timer: asyncio.TimerHandle | None = None
    _header_bytes = 0
    lingering = False

    def on_message_begin(self) -> None:
        self._header_bytes = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_body(self, body: bytes) -> None:
        if not self.transport.is_closing():
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self.transport.is_closing():
            super().on_message_complete()

    def _count(self, size: int) -> None:
        self._header_bytes += size
        limit = _settings().max_header_bytes
        if self._header_bytes > limit and not self.transport.is_closing():
            self.transport.write(_too_large(limit))
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = _LingeringTransport(transport, self)  # type: ignore[assignment]
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the rest of a refused body: dropped unparsed
        if self.cycle is None or self.cycle.response_complete:
            self._arm()  # a new request begins: its headers must come in time
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._disarm()
        if self.transport.is_closing():  # refused (431) or timed out: run nothing
            return
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(_settings().header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def serve(settings: GatewaySettings, workers: int = 1) -> None:
    config = uvicorn.Config(
        "gateway.server.app:create_app",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=workers,
        http="gateway.server.serve:LimitedHttpProtocol",
        # REQUEST_COUNTS counts loop iterations through the pure-Python loop's hooks.
        loop="asyncio" if settings.request_counts else "auto",
        # Responses WebSockets (openai/responses/websocket.py): a message is at most the
        # body limit (websockets refuses a longer one from its frame header, before reading
        # it: close 1009), and never deflated, so what a socket holds is what it was sent:
        # permessage-deflate would let ~70 kB on the wire become 16 MiB messages, and the
        # sans-I/O protocol decodes every message of one read (up to 256 KiB) before the app
        # takes the first (it pauses reading only after that); ws_max_queue is the legacy
        # implementation's and does not apply. Pinned rather than "auto" for that reason.
        ws="websockets-sansio",
        ws_max_size=settings.max_body_bytes,
        ws_per_message_deflate=False,
        timeout_keep_alive=int(settings.keep_alive_s),
        timeout_graceful_shutdown=int(settings.drain_s + 5),
        log_level=settings.log_level.lower(),
        access_log=False,
    )
    if workers > 1:
        OwnSocketProcesses(config).run()  # a socket each, so that a burst spreads over them
        return
    server = uvicorn.Server(config)
    server.run()
    if not server.started:
        raise SystemExit(STARTUP_FAILURE)
