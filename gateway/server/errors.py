"""What the gateway's use cases raise when they refuse a call, in the domain's terms;
each API (native, OpenAI) turns them into its own answer (gateway.server.api.errors)."""

from __future__ import annotations

from typing import Any


class Refused(Exception):
    """A call the gateway will not take: `code` is stable, `message` says why. `status`: the
    HTTP status it answers with, where the kind of refusal does not say (an upstream's)."""

    status: int | None = None

    def __init__(
        self,
        code: str,
        message: str,
        *,
        details: Any = None,
        headers: dict[str, str] | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.details, self.headers = code, message, details, headers or {}
        if status is not None:
            self.status = status


class NotFound(Refused):
    """No such object for this caller (another tenant's objects read as unknown too)."""

    status = 404


class Forbidden(Refused):
    """Not for this caller: beyond what its tenant was granted (a priority band)."""

    status = 403


class Gone(Refused):
    """It existed, and is kept no longer (a result past its retention)."""

    status = 410


class Unavailable(Refused):
    """A part the call needs is away (a replica, a binder): an outage, not the caller's fault."""

    status = 503


class InvalidRequest(Refused):
    """It cannot be served as asked (a bad input, an unknown model, a prompt too long)."""


class Conflict(Refused):
    """It contradicts an earlier call (an idempotency key reused with another body)."""


class Busy(Refused):
    """Not now: a backlog is full or a rate limit is spent; `retry_after_s` says when to try."""

    def __init__(self, code: str, message: str, *, retry_after_s: int, headers: dict[str, str] | None = None) -> None:
        super().__init__(code, message, headers={**(headers or {}), "Retry-After": str(retry_after_s)})
        self.retry_after_s = retry_after_s


# -- a run's own ends (not refusals: no API answers them) ------------------------------------


class StaleRun(Exception):
    """Another run took this request over (this one was presumed dead)."""


class LostPieces(Exception):
    """The stream lost pieces of an earlier run that this run cannot send again."""
