"""Several gateway processes on one port, each listening on a socket of its own.

uvicorn's supervisor binds one socket and every process accepts from it. A burst of
connections then lands mostly on whichever process wakes first: asyncio and uvloop
accept every pending connection of the socket in one wake-up, so the first process to
wake takes most of a burst of stream starts while the others idle (measured: 128
connections to 4 processes went 76 / 28 / 13 / 11). With SO_REUSEPORT each process has
its own listening socket in the port's group and the kernel hashes each new connection
to one of them, so a burst spreads evenly (the same burst: 40 / 33 / 32 / 23).

The supervisor stays uvicorn's (`Multiprocess`: health checks, a dead process replaced,
SIGHUP, SIGTTIN/SIGTTOU); only the sockets it hands its processes differ: a new one for
every process it starts, whose parent's copy is closed once that process holds it, so
that when the process dies its socket (and the connections queued on it, never
accepted) goes with it rather than waiting unaccepted in the parent."""

from __future__ import annotations

import socket

from uvicorn import Config
from uvicorn.supervisors import Multiprocess


def port_is_free(host: str, port: int) -> None:
    """Raise OSError (EADDRINUSE) when something already listens on the port. A plain
    bind, without SO_REUSEPORT: a second gateway started on the same port is refused
    instead of joining the first one's group and taking half its connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))


def reuse_port_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock  # the process's server calls listen() on it


class OwnSocketProcesses(Multiprocess):
    """uvicorn's `Multiprocess`, each process started with a socket of its own.

    The base class reads `self.sockets` once for every process it starts (at start, on
    a restart, on SIGTTIN); here each read makes a new socket bound to the port."""

    def __init__(self, config: Config) -> None:
        port_is_free(config.host, config.port)
        self._port = config.port
        self._handed: list[socket.socket] = []
        super().__init__(config, sockets=[])

    @property
    def sockets(self) -> list[socket.socket]:
        sock = reuse_port_socket(self.config.host, self._port)
        self._port = sock.getsockname()[1]  # a port of 0 resolved once, for all of them
        self._handed.append(sock)
        return [sock]

    @sockets.setter
    def sockets(self, _shared: list[socket.socket]) -> None:
        pass  # the base class's one shared list: each process gets its own instead

    def keep_subprocess_alive(self) -> None:
        # Called after the first processes start and every 0.5 s after a restart or a
        # SIGTTIN. A spawned process was handed a duplicate of its socket when it
        # started, so the parent's copy can go.
        while self._handed:
            self._handed.pop().close()
        super().keep_subprocess_alive()
