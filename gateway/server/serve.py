"""Serving the app with uvicorn: one process, or `workers` processes sharing the port.

uvicorn has no limit on how long a client may take to send its request headers, so a
connection that trickles (or never finishes) its headers would be held for good; the
protocol below closes it after header_timeout_s."""

from __future__ import annotations

import asyncio
import functools

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.server.settings import GatewaySettings


@functools.cache
def _header_timeout_s() -> float:
    return GatewaySettings().header_timeout_s


class HeaderTimeoutProtocol(HttpToolsProtocol):
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self._arm()  # a new request begins: its headers must come in time
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(_header_timeout_s(), self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def serve(settings: GatewaySettings, workers: int = 1) -> None:
    uvicorn.run(
        "gateway.server.app:create_app",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=workers if workers > 1 else None,
        http="gateway.server.serve:HeaderTimeoutProtocol",
        timeout_keep_alive=int(settings.keep_alive_s),
        timeout_graceful_shutdown=int(settings.drain_s + 5),
        log_level=settings.log_level.lower(),
        access_log=False,
    )
