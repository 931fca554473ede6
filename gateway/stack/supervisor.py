"""Keeping the local stack up: a child that dies is reported (console and its own log),
what it left is cleaned up (Triton's stubs and shared memory), and it is started again
after a backoff and waited on until ready (Triton: every model READY; Redis reloads its
append-only file), while the other children keep running. The launcher gives up, stops
everything and exits non-zero only when a child keeps dying at start: `give_up_after`
deaths in a row, each within `window_s` of its (re)start.

Everything runs on the main thread (a child's parent-death signal is tied to the thread
that started it), as a state machine polled every `poll_s`, so one child's backoff or
slow start does not delay noticing another's death; a stop request interrupts it at once."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from gateway.stack.owners import DEFAULT_GRACE_S
from gateway.stack.process import LaunchError, ManagedProcess, describe_exit


@dataclass(frozen=True)
class RestartPolicy:
    give_up_after: int = 5
    window_s: float = 60.0
    first_delay_s: float = 0.5
    max_delay_s: float = 8.0
    ready_timeout_s: float = 300.0
    poll_s: float = 0.2

    def delay(self, streak: int) -> float:
        """Exponential backoff: 0.5, 1, 2, 4, 8, 8 ... seconds for the 1st, 2nd ... death in a row."""
        return min(self.max_delay_s, self.first_delay_s * 2 ** max(0, streak - 1))


class GiveUp(Exception):
    """A child keeps dying at start; the message says which and where its log is."""


class Phase(Enum):
    RUNNING = "running"
    WAITING = "waiting"  # backoff before the next start
    STARTING = "starting"  # started again, not ready yet


@dataclass
class Watched:
    process: ManagedProcess
    started_at: float
    phase: Phase = Phase.RUNNING
    streak: int = 0  # deaths in a row, each soon after a start
    restart_at: float = 0.0
    ready_by: float = 0.0
    restarts: int = 0


class Supervisor:
    def __init__(
        self,
        processes: Sequence[ManagedProcess],
        policy: RestartPolicy | None = None,
        log: Callable[[str], None] = print,
        grace: float = DEFAULT_GRACE_S,
    ) -> None:
        self.policy = policy or RestartPolicy()
        self.log = log
        self.grace = grace
        now = time.monotonic()
        self.watched = [Watched(process, started_at=now) for process in processes]

    def run(self, until: Callable[[], bool] = lambda: False) -> None:
        """Supervise until `until()` (or a stop request, or GiveUp)."""
        while not until():
            self.tick()
            time.sleep(self.policy.poll_s)

    def tick(self) -> None:
        now = time.monotonic()
        for watched in self.watched:
            process = watched.process
            if watched.phase is Phase.RUNNING:
                code = process.exit_code()
                if code is not None:
                    self._died(watched, f"exited with {describe_exit(code)}")
            elif watched.phase is Phase.WAITING:
                if now >= watched.restart_at:
                    self._start(watched)
            else:
                self._check_start(watched, now)

    def _check_start(self, watched: Watched, now: float) -> None:
        process = watched.process
        code = process.exit_code()
        if code is not None:
            self._died(watched, f"exited with {describe_exit(code)} while starting again")
            return
        try:
            ready = process.spec.ready()
        except LaunchError as exc:  # e.g. a model Triton cannot load: waiting will not help
            process.stop(self.grace)
            self._died(watched, f"failed while starting again: {exc}")
            return
        except Exception:
            ready = False  # not answering yet
        if ready:
            watched.phase = Phase.RUNNING
            watched.restarts += 1
            took = now - watched.started_at
            self._report(watched, f"{process.spec.name} is back (pid {process.pid}, ready in {took:.1f}s)", "   ")
        elif now >= watched.ready_by:
            process.stop(self.grace)
            self._died(watched, "did not become ready in time")

    def _start(self, watched: Watched) -> None:
        process = watched.process
        now = time.monotonic()
        watched.started_at = now
        try:
            process.start()
        except LaunchError as exc:
            self._died(watched, f"could not start again: {exc}")
            return
        watched.phase = Phase.STARTING
        watched.ready_by = now + self.policy.ready_timeout_s
        process.note(f"started again, pid {process.pid}")

    def _died(self, watched: Watched, what: str) -> None:
        process = watched.process
        process.cleanup()  # what it left: orphaned children (Triton's stubs), shared memory
        now = time.monotonic()
        soon = now - watched.started_at <= self.policy.window_s
        watched.streak = watched.streak + 1 if soon else 1
        name, policy = process.spec.name, self.policy
        if watched.streak >= policy.give_up_after:
            message = (
                f"{name} {what}; it died {watched.streak} times in a row, each within "
                f"{policy.window_s:.0f}s of its start: giving up; see {process.spec.log_file}"
            )
            self._report(watched, message, "!! ")
            raise GiveUp(message)
        delay = policy.delay(watched.streak)
        watched.phase = Phase.WAITING
        watched.restart_at = now + delay
        self._report(
            watched,
            f"{name} {what}; restarting in {delay:.2f}s (death {watched.streak} in a row, "
            f"giving up at {policy.give_up_after}); see {process.spec.log_file}",
            "!! ",
        )

    def _report(self, watched: Watched, line: str, mark: str) -> None:
        self.log(f"{mark}{line}")
        try:
            watched.process.note(line)
        except OSError:
            pass  # the console has it; a missing log directory must not stop supervision
