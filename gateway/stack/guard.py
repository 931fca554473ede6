"""The launcher's dead man's switch: `python -m gateway.stack.guard RUN_ID GRACE_S`.

Started once per launcher process, before its first child, in a session of its own,
with a pipe as stdin whose write end only the launcher holds. The pipe ends when the
launcher exits, however it ends, SIGKILL included. Then whatever still carries the
launcher's owner token (see process.py) gets GRACE_S seconds to exit (the children got
SIGTERM from PR_SET_PDEATHSIG), and SIGKILL after that: this is what reaches Triton's
python-backend stubs, which ignore SIGTERM and get no parent-death signal, and a child
that hangs on its way out. Last, the launcher's Triton shared-memory regions are
removed. After a normal stop nothing carries the token and the guard just exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from gateway.stack import signals
from gateway.stack.owners import DEFAULT_GRACE_S, OWNER_ENV, run_id, sweep


class _Guard:
    popen: subprocess.Popen[bytes] | None = None
    # The write end of the pipe: held, never written, closed only by our exit.
    fd: int | None = None


_guard = _Guard()


def ensure_started(grace: float = DEFAULT_GRACE_S) -> None:
    """Start this process's guard if it is not running."""
    if _guard.popen is not None and _guard.popen.poll() is None:
        return
    if _guard.fd is not None:
        os.close(_guard.fd)
    read_end, write_end = os.pipe()  # not inheritable: no other child holds the write end
    _guard.fd = write_end
    env = {name: value for name, value in os.environ.items() if name != OWNER_ENV}
    try:
        with signals.deferred():
            _guard.popen = subprocess.Popen(
                [sys.executable, "-m", "gateway.stack.guard", run_id(), str(grace)],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
                # Not in the launcher's process group: a Ctrl-C to it is the launcher's to handle.
                start_new_session=True,
            )
    finally:
        os.close(read_end)


def main(argv: list[str]) -> int:
    run, grace = argv[0], float(argv[1])
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    while os.read(0, 4096):
        pass  # nobody writes: read returns b"" when the launcher is gone
    sweep(f"{run}-", grace)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
