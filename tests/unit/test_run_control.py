"""A run's control (dispatch/runner.py RunControl) lets go of what holds it once the run
ends, so that the run's objects are freed by reference counting, not by the collector."""

from __future__ import annotations

import gc
import weakref
from typing import Any

from gateway.server.dispatch.emitter import TokenEmitter
from gateway.server.dispatch.runner import RunControl


def control_of_a_streamed_run() -> RunControl:
    """As the runner and the dispatcher build it: each callback holds the control it acts on."""
    control = RunControl(request_id="r", attempt=1, token="t")
    relay: Any = None  # never used: nothing is emitted
    control.emitter = TokenEmitter(relay, "r", "t", first_index=0, on_cancel=lambda: control.stop())
    control.on_acquired = lambda: control.stop()
    control.abort = lambda: print(control.request_id)
    return control


def test_a_released_control_is_freed_with_the_callbacks_and_emitter_that_held_it() -> None:
    control = control_of_a_streamed_run()
    freed = weakref.ref(control)
    gc.disable()  # only reference counting frees anything now
    try:
        control.release()
        del control
        assert freed() is None
    finally:
        gc.enable()
