"""Start and stop child processes by pid, with a log file each and a readiness check.

Ownership: every child gets an owner token in its environment (OWNER_ENV), which all
its descendants inherit, Triton's python-backend stubs included. A stop or a crash
clean-up kills a child's whole tree: its descendants while it lives, and whatever
still carries its token once it is gone (stubs orphaned by a Triton that died). A
Triton's shared-memory regions are named with the same token (ServiceSpec.shm_prefix),
so they are removed by name once no process of that tree is left, and a region of a
Triton we did not start is never touched. (redis-server overwrites its environment
block with its process title; it is reached through its pid, its forks as descendants.)

If the launcher itself dies (even by SIGKILL) its children get SIGTERM from the kernel
(PR_SET_PDEATHSIG), and the guard (guard.py) kills what is left after the grace
period, stubs included, and removes the regions."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil

from gateway.stack import signals
from gateway.stack.owners import _KILL_WAIT_S, DEFAULT_GRACE_S, OWNER_ENV, _kill, _owned, new_owner, remove_shm

# The stages of a stop (ServiceSpec.stop_stage), in dependency order: a stage gets SIGTERM
# once the one before it is gone, so what a server depends on still serves it while it
# stops. The gateways first: they hand their running requests over and write their last
# counts through Redis and MongoDB, while Triton finishes what they drain. Then the binder
# (it moves the last results from Redis into MongoDB). Then what they used.
STOP_GATEWAYS = 0
STOP_BINDER = 1
STOP_SERVERS = 2  # Redis, MongoDB, Triton (and whatever names no stage)


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
    # One spec, one ManagedProcess: the token marks that process's tree (see the module doc).
    owner: str = field(default_factory=new_owner)
    # /dev/shm regions named <shm_prefix>* belong to this service (Triton's python backend).
    shm_prefix: str | None = None
    # When it is stopped with others: STOP_GATEWAYS, STOP_BINDER or STOP_SERVERS.
    stop_stage: int = STOP_SERVERS
    # At most this long from SIGTERM to SIGKILL, when shorter than the stop's grace (a
    # server whose graceful exit keeps nothing once what used it is gone).
    stop_grace_s: float | None = None


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


# Ports free_port handed out in this process.
_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now, and none this process handed out before: once the first socket is
    closed the kernel may give the same ephemeral port to the next bind (a stack's Triton
    once got one port for HTTP and metrics, and would not start)."""
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _handed_out:
            break
    _handed_out.add(port)
    return port


# -- private files ---------------------------------------------------------------------


def make_private_dir(path: Path) -> Path:
    """A directory only its owner can enter (0700), made if missing, tightened if not."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def make_private_tree(root: Path) -> None:
    """Directories 0700, files 0600 (0700 if executable): for trees copied from the package."""
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        if path.is_dir():
            path.chmod(0o700)
        else:
            path.chmod(0o700 if path.stat().st_mode & 0o111 else 0o600)


def _open_log(path: Path) -> int:
    make_private_dir(path.parent)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


def _child_setup() -> None:
    # Runs in the child before exec. If the launcher dies, even by SIGKILL, the child
    # gets SIGTERM, so no server is left without an owner (the guard kills what is still
    # there after the grace period). Linux ties this to the starting thread, so children
    # are started from the main thread. umask: data files 0600, directories 0700.
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    os.umask(0o077)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


class ManagedProcess:
    """One child process we started; stopped only through its own pid and its owner token."""

    def __init__(self, spec: ServiceSpec) -> None:
        self.spec = spec
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self) -> None:
        if self.popen is not None:
            # A restart: whatever the last run left (orphans, regions under our prefix) goes first.
            _finish([self], {})
        for port, label in self.spec.ports:
            if not port_is_free(port):
                raise LaunchError(
                    f"port {port} ({label}) is already in use: stop what listens there "
                    f"or choose another port (see `gateway up --help`)"
                )
        from gateway.stack import guard

        guard.ensure_started()
        log = _open_log(self.spec.log_file)
        env = {**os.environ, **self.spec.env, OWNER_ENV: self.spec.owner}
        try:
            # Deferred: a Ctrl-C here must not lose a child that was just forked.
            with signals.deferred():
                self.popen = subprocess.Popen(
                    self.spec.argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    cwd=self.spec.cwd,
                    # Own session: a Ctrl-C in the terminal reaches only the launcher,
                    # which then stops the children.
                    start_new_session=True,
                    preexec_fn=_child_setup,
                )
        except FileNotFoundError as exc:
            raise LaunchError(f"{self.spec.name}: {exc.filename} not found") from exc
        finally:
            os.close(log)

    def exit_code(self) -> int | None:
        return self.popen.poll() if self.popen else None

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            code = self.exit_code()
            if code is not None:
                raise LaunchError(
                    f"{self.spec.name} exited with {describe_exit(code)} while starting; see {self.spec.log_file}"
                )
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
        if not self.running or self.pid is None:
            return []
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []

    def note(self, line: str) -> None:
        """A line from the launcher in this service's log (restarts, crashes)."""
        stamp = datetime.now().astimezone().isoformat(timespec="seconds")
        fd = _open_log(self.spec.log_file)
        try:
            os.write(fd, f"[{stamp}] launcher: {line}\n".encode())
        finally:
            os.close(fd)

    def stop(self, grace: float = DEFAULT_GRACE_S) -> None:
        """SIGTERM, up to `grace` seconds, then SIGKILL of the whole tree and its regions."""
        stop_processes([self], grace)

    def kill(self) -> None:
        """SIGKILL, as a crash would; then its tree and regions are cleaned up like after one."""
        before = {self: self.descendants()}
        if self.running and self.pid is not None:
            os.kill(self.pid, signal.SIGKILL)
        _finish([self], before)

    def cleanup(self) -> None:
        """After an exit: kill what the process left running (e.g. Triton's stubs) and remove its regions."""
        _finish([self], {})


def stop_processes(
    processes: Sequence[ManagedProcess], grace: float = DEFAULT_GRACE_S, log: Callable[[str], None] | None = None
) -> None:
    """Stop them stage by stage, in dependency order (ServiceSpec.stop_stage: the gateways,
    then the binder, then Redis, MongoDB and Triton), each stage all at once: SIGTERM to
    each of its processes, up to `grace` seconds for them together (a spec's shorter
    stop_grace_s for it; no wait after a second Ctrl-C), then SIGKILL of every process of
    their trees, then their shared-memory regions; only then the next stage. Stop requests
    meanwhile are only recorded."""
    with signals.shielded():
        trees = {p: p.descendants() for p in processes}  # before anyone is reparented
        for stage in sorted({p.spec.stop_stage for p in processes}):
            group = [p for p in processes if p.spec.stop_stage == stage]
            _stop_stage(group, trees, grace, log)


def _stop_stage(
    group: Sequence[ManagedProcess],
    trees: dict[ManagedProcess, list[psutil.Process]],
    grace: float,
    log: Callable[[str], None] | None,
) -> None:
    started = time.monotonic()
    live = [p for p in group if p.running]
    for process in live:
        assert process.popen is not None
        try:
            process.popen.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadlines = {
        p: started + min(grace, p.spec.stop_grace_s if p.spec.stop_grace_s is not None else grace) for p in live
    }
    while any(p.running and time.monotonic() < deadlines[p] for p in live) and not signals.urgent():
        time.sleep(0.05)
    late = [p for p in live if p.running]
    if late and log is not None:
        waited = max(deadlines[p] for p in late) - started
        log(f"   {', '.join(p.spec.name for p in late)}: still running {waited:.0f}s after SIGTERM; killing")
    _finish(group, trees)
    if live and log is not None:
        log(f"   {', '.join(p.spec.name for p in live)} stopped in {time.monotonic() - started:.1f}s")


def _finish(processes: Sequence[ManagedProcess], trees: dict[ManagedProcess, list[psutil.Process]]) -> None:
    """SIGKILL each process and everything of its tree still alive, reap, remove regions."""
    with signals.shielded():
        mains = {p.pid for p in processes if p.pid is not None}
        for process in processes:
            if process.running and process.popen is not None:
                process.popen.kill()
        owned = _owned(p.spec.owner for p in processes)
        victims: dict[int, psutil.Process] = {}
        for process in processes:
            for proc in [*trees.get(process, []), *owned[process.spec.owner]]:
                # Our own children are reaped through Popen (psutil would take their exit code).
                if proc.pid not in mains:
                    victims[proc.pid] = proc
        stuck = [proc.pid for proc in _kill(victims.values())]
        for process in processes:
            if process.popen is not None:
                try:
                    process.popen.wait(_KILL_WAIT_S)
                except subprocess.TimeoutExpired:
                    stuck.append(process.popen.pid)
            if process.spec.shm_prefix:
                remove_shm(process.spec.shm_prefix)
        if stuck:
            print(f"!! could not kill pids {stuck}", file=sys.stderr)


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
