"""The engine's responses, sent from a thread of their own.

Each send of Triton's Python backend is a round trip to the server process (0.5-1 ms under
load), and 128 streams send 128 responses a step: sent from the engine's thread, they, not
the GPU, set its pace. The engine queues each sequence's responses in its Outbox; the
Responder's thread sends them, in order per sequence. Each token is its own response, as
TensorRT-LLM streams them; a coalescing Outbox sends the tokens a sequence made while its
previous response was being sent as one response of several tokens (what the gateway reads
as well: one token each while the sender keeps up, and the engine's pace when it does not).
After a sequence's responses the Outbox's `after` runs (model.py asks Triton there whether
the request was cancelled, so the engine's check each step reads a flag).

The engine's thread and the responder's share one GIL. Every torch call of the engine's
step releases it; a responder that takes it then, to build a response, delays the step by
that much, many times a step (at 128 streams through Triton a decode step took twice as
long as the engine's alone). With a Gate, the responder builds responses while the
engine's thread waits on the GPU, not while it runs the step's Python."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

PATIENCE_S = 0.02  # the longest the responder waits for an open gate in one closed spell
# Outboxes sent for one wait at the gate: however briefly the engine opens it, each opening
# lets this many sequences' responses go (one each would starve 128 streams when the GPU
# waits are short).
TURN = 16


class Gate:
    """The responder's turn. The engine's thread closes it for a step (`closed`) and opens
    it while the step waits on the GPU (`opened`); the responder waits for it to be open
    (`wait`), but never more than `patience` seconds into one closed spell: a long step
    (a prefill, a graph's capture) holds responses back no longer than that."""

    def __init__(self, patience: float = PATIENCE_S) -> None:
        self.patience = patience
        self._open = threading.Event()
        self._open.set()
        self._closed_at = 0.0

    @contextmanager
    def closed(self) -> Iterator[None]:
        self._closed_at = time.monotonic()
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()

    @contextmanager
    def opened(self) -> Iterator[None]:
        """Inside `closed`: open while the engine's thread waits (on the GPU); outside, open
        already, it stays so."""
        if self._open.is_set():
            yield
            return
        self._open.set()
        try:
            yield
        finally:
            self._closed_at = time.monotonic()
            self._open.clear()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def wait(self) -> None:
        if not self._open.is_set():
            self._open.wait(max(0.0, self._closed_at + self.patience - time.monotonic()))


class Outbox:
    """One sequence's responses not sent yet, in order: ("tokens", first, tokens, final,
    last_token_ns) and ("error", message)."""

    def __init__(
        self,
        respond: Callable[[int, list[int], bool, int], None],
        fail: Callable[[str], None],
        after: Callable[[], Any],
        *,
        coalesce: bool,
    ) -> None:
        self.respond = respond  # (first, tokens, final, last_token_ns): build and send one response
        self.fail = fail  # (message): send the error response
        self.after = after
        self.coalesce = coalesce
        self.items: list[tuple] = []
        self.queued = False

    def flush(self, items: list[tuple]) -> None:
        """Each item as its own response; or, coalescing, the tokens of consecutive items as
        one response. An error comes last (the engine fails a sequence once)."""
        if not self.coalesce:
            for item in items:
                if item[0] == "error":
                    self.fail(item[1])
                else:
                    self.respond(*item[1:])
            return
        tokens: list[int] = []
        first, final, last_ns, error = None, False, 0, None
        for item in items:
            if item[0] == "error":
                error = item[1]
                continue
            _, start, ids, end, stamp = item
            first = start if first is None else first
            tokens.extend(ids)
            final, last_ns = final or end, stamp
        if first is not None and (tokens or final):
            self.respond(first, tokens, final, last_ns)
        if error is not None:
            self.fail(error)


class Responder:
    """One thread sending every Outbox's responses; `log` gets a send's failure (the client
    went away, say), which ends nothing else. With a `gate`, it waits for the gate
    before each turn of up to TURN Outboxes."""

    def __init__(self, log: Callable[[str], None], gate: Gate | None = None) -> None:
        self.log = log
        self.gate = gate
        self._ready: deque[Outbox] = deque()
        self._cond = threading.Condition()
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="llm-responder", daemon=True)
        self._thread.start()

    def put(self, outbox: Outbox, item: tuple) -> None:
        with self._cond:
            outbox.items.append(item)
            if not outbox.queued:
                outbox.queued = True
                self._ready.append(outbox)
                self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._running and not self._ready:
                    self._cond.wait()
                if not self._ready:
                    return  # closed, and everything sent
                turn = [self._ready.popleft() for _ in range(min(TURN, len(self._ready)))]
            if self.gate is not None:
                self.gate.wait()
            for outbox in turn:
                with self._cond:
                    items, outbox.items, outbox.queued = outbox.items, [], False
                try:
                    outbox.flush(items)
                    outbox.after()
                except Exception as exc:
                    self.log(f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Send what is queued, then stop."""
        with self._cond:
            self._running = False
            self._cond.notify()
        self._thread.join(timeout=10)
