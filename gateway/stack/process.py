"""Start and stop child processes by pid, with a log file each and a readiness check."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil


class LaunchError(RuntimeError):
    """A service could not start. The message is one line that says what to do."""


@dataclass
class ServiceSpec:
    name: str
    argv: list[str]
    log_file: Path
    # (port, what listens there) pairs that must be free before the start.
    ports: list[tuple[int, str]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    ready: Callable[[], bool] = lambda: True
    url: str = ""


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    # Also refuse a port bound on another address (e.g. 0.0.0.0 by another server).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    # Runs in the child before exec: if the launcher dies, even by SIGKILL, the child
    # gets SIGTERM, so no server is left behind without an owner. (Linux ties this to
    # the starting thread, so children are started from the main thread.)
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ManagedProcess:
    """One child process we started; stopped only through its own pid."""

    def __init__(self, spec: ServiceSpec) -> None:
        self.spec = spec
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def start(self) -> None:
        for port, label in self.spec.ports:
            if not port_is_free(port):
                raise LaunchError(
                    f"port {port} ({label}) is already in use: stop what listens there "
                    f"or choose another port (see `gateway up --help`)"
                )
        self.spec.log_file.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.spec.log_file, "ab")  # noqa: SIM115 (handed to the child, closed below)
        env = {**os.environ, **self.spec.env}
        try:
            self.popen = subprocess.Popen(
                self.spec.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.spec.cwd,
                # Own process group: a Ctrl-C in the terminal reaches only the launcher,
                # which then stops the children in order.
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except FileNotFoundError as exc:
            raise LaunchError(f"{self.spec.name}: {exc.filename} not found") from exc
        finally:
            log.close()

    def exit_code(self) -> int | None:
        return self.popen.poll() if self.popen else None

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            code = self.exit_code()
            if code is not None:
                raise LaunchError(f"{self.spec.name} exited with code {code} while starting; see {self.spec.log_file}")
            try:
                if self.spec.ready():
                    return
            except LaunchError:
                raise
            except Exception:
                pass  # not answering yet
            time.sleep(0.2)
        raise LaunchError(f"{self.spec.name} did not become ready in time; see {self.spec.log_file}")

    def descendants(self) -> list[psutil.Process]:
        if not self.popen:
            return []
        try:
            return psutil.Process(self.popen.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM our child, wait, then SIGKILL it and any descendant still alive."""
        if not self.popen or self.popen.poll() is not None:
            return
        children = self.descendants()
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)
        _, alive = psutil.wait_procs(children, timeout=5)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return True
        except Exception:
            pass
        time.sleep(interval)
    return False
