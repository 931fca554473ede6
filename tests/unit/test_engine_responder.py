"""The llm_engine's responder (model_repo/local/llm_engine/1/responder.py), pure logic: the
engine queues each sequence's responses and one thread sends them, in order; each token is
its own response unless the outbox coalesces, and then the tokens queued while a send was
under way go out as one response, an error always last. With a gate, responses go out while
the engine's thread holds the gate open (its wait on the GPU), or once a closed spell
outlasts the gate's patience."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "model_repo" / "local" / "llm_engine" / "1"))

from responder import TURN, Gate, Outbox, Responder

WAIT_S = 30  # a bound on waiting for a condition, never a pace


class Sent:
    def __init__(self) -> None:
        self.responses: list[tuple] = []
        self.afters = 0
        self.done = threading.Event()

    def respond(self, first: int, tokens: list[int], final: bool, last_ns: int) -> None:
        self.responses.append(("tokens", first, list(tokens), final))
        if final:
            self.done.set()

    def fail(self, message: str) -> None:
        self.responses.append(("error", message))
        self.done.set()

    def after(self) -> None:
        self.afters += 1

    def outbox(self, coalesce: bool) -> Outbox:
        return Outbox(self.respond, self.fail, self.after, coalesce=coalesce)


def test_each_token_is_its_own_response_when_not_coalescing() -> None:
    sent = Sent()
    sent.outbox(False).flush([("tokens", 0, [5], False, 1), ("tokens", 1, [6], False, 2), ("tokens", 2, [7], True, 3)])
    assert sent.responses == [("tokens", 0, [5], False), ("tokens", 1, [6], False), ("tokens", 2, [7], True)]


def test_coalescing_sends_the_queued_tokens_as_one_response_from_the_first_ones_index() -> None:
    sent = Sent()
    sent.outbox(True).flush(
        [("tokens", 3, [5], False, 1), ("tokens", 4, [6, 7], False, 2), ("tokens", 6, [8], True, 3)]
    )
    assert sent.responses == [("tokens", 3, [5, 6, 7, 8], True)]


def test_an_error_after_tokens_comes_after_them_and_the_tokens_are_not_final() -> None:
    for coalesce in (False, True):
        sent = Sent()
        sent.outbox(coalesce).flush([("tokens", 0, [5], False, 1), ("error", "boom")])
        assert sent.responses == [("tokens", 0, [5], False), ("error", "boom")]


def test_a_final_response_without_tokens_is_still_sent_when_coalescing() -> None:
    sent = Sent()
    sent.outbox(True).flush([("tokens", 4, [], True, 0)])
    assert sent.responses == [("tokens", 4, [], True)]


def test_the_responder_sends_every_sequences_responses_in_order_and_runs_after_each_flush() -> None:
    responder = Responder(log=lambda text: None)
    sequences = [Sent() for _ in range(20)]
    try:
        outboxes = [s.outbox(False) for s in sequences]
        for step in range(50):
            for outbox in outboxes:
                responder.put(outbox, ("tokens", step, [step], step == 49, step))
        for sent in sequences:
            assert sent.done.wait(WAIT_S)
            assert [r[2] for r in sent.responses] == [[step] for step in range(50)]
            assert 1 <= sent.afters <= 50
    finally:
        responder.close()


def test_a_coalescing_responder_loses_no_token_and_keeps_their_order() -> None:
    responder = Responder(log=lambda text: None)
    sent = Sent()
    outbox = sent.outbox(True)
    try:
        for step in range(500):
            responder.put(outbox, ("tokens", step, [step], step == 499, step))
        assert sent.done.wait(WAIT_S)
        assert [t for r in sent.responses for t in r[2]] == list(range(500))
        assert all(r[1] == r[2][0] for r in sent.responses)  # each response says where its tokens begin
    finally:
        responder.close()


def test_a_failing_send_is_logged_and_the_other_sequences_go_on() -> None:
    logged: list[str] = []
    responder = Responder(log=logged.append)
    good = Sent()

    def broken(first: int, tokens: list[int], final: bool, last_ns: int) -> None:
        raise ConnectionError("the client went away")

    try:
        responder.put(Outbox(broken, good.fail, good.after, coalesce=False), ("tokens", 0, [1], True, 0))
        responder.put(good.outbox(False), ("tokens", 0, [2], True, 0))
        assert good.done.wait(WAIT_S)
        assert logged == ["ConnectionError: the client went away"]
    finally:
        responder.close()


class WatchedGate(Gate):
    """A Gate that says when the responder began waiting for it."""

    def __init__(self, patience: float) -> None:
        super().__init__(patience)
        self.waiting = threading.Event()

    def wait(self) -> None:
        self.waiting.set()
        super().wait()


def test_a_gated_responder_sends_only_once_the_engine_opens_the_gate() -> None:
    gate = WatchedGate(patience=WAIT_S)
    responder = Responder(log=lambda text: None, gate=gate)
    sent = Sent()
    open_when_sent: list[bool] = []

    def respond(first: int, tokens: list[int], final: bool, last_ns: int) -> None:
        open_when_sent.append(gate.is_open)
        sent.respond(first, tokens, final, last_ns)

    try:
        with gate.closed():  # the engine's step
            responder.put(Outbox(respond, sent.fail, sent.after, coalesce=True), ("tokens", 0, [1], True, 0))
            assert gate.waiting.wait(WAIT_S)
            assert sent.responses == []
            with gate.opened():  # its wait on the GPU
                assert sent.done.wait(WAIT_S)
        assert open_when_sent == [True]
    finally:
        responder.close()


def test_a_gate_closed_longer_than_its_patience_holds_no_response_back() -> None:
    gate = Gate(patience=0.05)
    responder = Responder(log=lambda text: None, gate=gate)
    sent = Sent()
    try:
        with gate.closed():  # a long step: a prefill, a graph's capture
            responder.put(sent.outbox(True), ("tokens", 0, [1], True, 0))
            assert sent.done.wait(WAIT_S)
        assert sent.responses == [("tokens", 0, [1], True)]
    finally:
        responder.close()


class BriefGate(Gate):
    """Open for one wait at a time: an engine whose waits on the GPU are too short for the
    responder to come back to the gate within one."""

    def __init__(self) -> None:
        super().__init__(patience=2 * WAIT_S)
        self.openings = threading.Semaphore(0)

    def wait(self) -> None:
        self.openings.acquire(timeout=self.patience)


def test_one_brief_opening_of_the_gate_lets_a_turn_of_sequences_go() -> None:
    # With steps launched ahead the engine's waits on the GPU can be short: each must let
    # more than one sequence's responses out, or 128 streams starve.
    gate = BriefGate()
    responder = Responder(log=lambda text: None, gate=gate)
    sequences = [Sent() for _ in range(TURN)]
    try:
        for sent in sequences:
            responder.put(sent.outbox(True), ("tokens", 0, [1], True, 0))
        gate.openings.release()
        assert all(sent.done.wait(WAIT_S) for sent in sequences)
    finally:
        gate.openings.release(TURN)
        responder.close()
