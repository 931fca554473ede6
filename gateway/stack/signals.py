"""Stop requests (SIGINT, SIGTERM) for the launcher, handled from its first instruction.

A process started in the background by a script inherits SIGINT as *ignored*, and
Python then never raises KeyboardInterrupt, so the handlers are installed explicitly,
whatever was inherited. Once armed, the first request raises StopRequested in the main
thread wherever it is (a readiness wait, a backoff sleep, building weights), so start-up
waits end at once; inside `deferred()` (starting a child) it waits for the block's end,
and inside `shielded()` (the stop itself) it is only recorded. A second request while
stopping makes the stop skip its grace period (`urgent()`).

Stdlib only: `gateway/cli.py` imports this before anything slow."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested(BaseException):
    """A stop was asked for (BaseException, like KeyboardInterrupt: `except Exception` lets it through)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _State:
    installed = False
    armed = False
    raised = False
    shield_depth = 0
    requested: int | None = None
    requested_at: float | None = None  # time.monotonic() of the first request
    count = 0


_state = _State()


def _handle(signum: int, frame: FrameType | None) -> None:
    _state.count += 1
    if _state.requested is None:
        _state.requested = signum
        _state.requested_at = time.monotonic()
    if _state.armed and not _state.raised and _state.shield_depth == 0:
        _state.raised = True
        raise StopRequested(signum)


def install() -> None:
    """Handle SIGINT and SIGTERM from now on (requests are recorded until `arm()`)."""
    if not _state.installed:
        for sig in STOP_SIGNALS:
            signal.signal(sig, _handle)
        _state.installed = True


def arm() -> None:
    """From now on the first stop request raises StopRequested; one that came already raises now."""
    install()
    _state.armed = True
    _raise_pending()


def disarm() -> None:
    """Requests are only recorded again (the stop is done; the process is exiting)."""
    _state.armed = False


def _raise_pending() -> None:
    if _state.armed and not _state.raised and _state.shield_depth == 0 and _state.requested is not None:
        _state.raised = True
        raise StopRequested(_state.requested)


def requested() -> int | None:
    """The signal of the first stop request, if any."""
    return _state.requested


def requested_at() -> float | None:
    """When the first stop request came (time.monotonic())."""
    return _state.requested_at


def urgent() -> bool:
    """More than one stop request: the stop should not wait for a graceful exit."""
    return _state.count > 1


@contextmanager
def shielded() -> Iterator[None]:
    """Requests during the block are only recorded (for the stop itself)."""
    _state.shield_depth += 1
    try:
        yield
    finally:
        _state.shield_depth -= 1


@contextmanager
def deferred() -> Iterator[None]:
    """Requests during the block raise at its end (so a child is never started unrecorded)."""
    with shielded():
        yield
    _raise_pending()
