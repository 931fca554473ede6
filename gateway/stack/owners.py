"""Which processes are ours: every process the launcher starts carries an owner token in its
environment (OWNER_ENV), inherited by its descendants, so what a launcher started is found,
and ended, by that token alone, even after the launcher itself died (the guard does that);
and Triton's shared-memory regions are named after it."""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import psutil

# Environment variable that marks every process we start, and its descendants.
OWNER_ENV = "GATEWAY_STACK_OWNER"
# Optional prefix of every owner token (letters, digits, '-'): a test session sets it to
# find what its launchers left behind (processes and shared-memory regions).
TAG_ENV = "GATEWAY_STACK_TAG"
SHM_DIR = Path("/dev/shm")
# Triton's python backend names its regions <prefix><uuid>; this is its default prefix.
TRITON_SHM_PREFIX = "triton_python_backend_shm_region_"
# SIGTERM to SIGKILL, per stage of a stop: long enough for Redis to write its append-only
# file and for the gateway to hand its running requests over, short enough that a stop
# (three stages, Triton's shorter) takes < 10 s.
DEFAULT_GRACE_S = 3.0
_KILL_WAIT_S = 3.0


@cache
def run_id() -> str:
    """This launcher's id: the first part of the owner token of every process it starts."""
    tag = os.environ.get(TAG_ENV, "")
    return (tag if re.fullmatch(r"[A-Za-z0-9-]{1,40}", tag) else "") + secrets.token_hex(4)


def new_owner() -> str:
    return f"{run_id()}-{secrets.token_hex(4)}"


# -- finding and ending what we started ------------------------------------------------


def _owned(owner_prefixes: Iterable[str]) -> dict[str, list[psutil.Process]]:
    """One pass over /proc: the live processes whose owner token starts with each prefix."""
    found: dict[str, list[psutil.Process]] = {prefix: [] for prefix in owner_prefixes}
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            token = proc.environ().get(OWNER_ENV)
            if token is None or proc.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.Error, OSError):
            continue  # gone, a zombie, or not ours to read
        for prefix, procs in found.items():
            if token.startswith(prefix):
                procs.append(proc)
    return found


def owned_processes(owner_prefix: str) -> list[psutil.Process]:
    """Live processes whose owner token starts with owner_prefix (a whole token: one
    child's tree; `<run_id>-`: everything one launcher started)."""
    return _owned([owner_prefix])[owner_prefix]


def shm_regions(prefix: str) -> list[Path]:
    return sorted(SHM_DIR.glob(f"{prefix}*")) if prefix else []


def remove_shm(prefix: str) -> list[Path]:
    """Remove the regions named <prefix>* (call once no process of their owner is left)."""
    removed = []
    for path in shm_regions(prefix):
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _ended(proc: psutil.Process) -> bool:
    """Gone, or a zombie: a descendant whose parent died is reparented to an ancestor that
    may never reap it (a container's first process), but it runs nothing and holds nothing."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _kill(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """SIGKILL each; those still running _KILL_WAIT_S later (normally none)."""
    targets = list(procs)
    for proc in targets:
        try:
            proc.kill()  # psutil checks the pid still names the same process first
        except psutil.Error:
            pass
    deadline = time.monotonic() + _KILL_WAIT_S
    alive = [proc for proc in targets if not _ended(proc)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [proc for proc in alive if not _ended(proc)]
    return alive


def sweep(owner_prefix: str, grace: float) -> list[psutil.Process]:
    """Give what carries owner_prefix `grace` seconds to exit, SIGKILL the rest, then
    remove its Triton regions. Returns what would not die (normally nothing)."""
    left = owned_processes(owner_prefix)
    if left:
        psutil.wait_procs(left, timeout=grace)
        left = _kill(owned_processes(owner_prefix))
    remove_shm(TRITON_SHM_PREFIX + owner_prefix)
    return left
