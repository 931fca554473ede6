"""Request states and the kinds of event a request's event stream carries."""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({State.SUCCEEDED, State.FAILED, State.CANCELED, State.EXPIRED})


class EventKind(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"  # data: {attempt, replica?, restarted, resume_from}
    TOKEN = "token"  # data: {index, text_output, count?}: one or more generated pieces
    OUTPUT = "output"  # the whole output (embedding models, or an llm without stream)
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELED = "canceled"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_EVENT.values()


TERMINAL_EVENT = {
    State.SUCCEEDED: EventKind.COMPLETED,
    State.FAILED: EventKind.FAILED,
    State.CANCELED: EventKind.CANCELED,
    State.EXPIRED: EventKind.EXPIRED,
}
