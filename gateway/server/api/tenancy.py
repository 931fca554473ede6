"""Who is calling: the tenant every object of a request belongs to, and its limits.
Until API keys are configured every caller is the default tenant."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from gateway.protocol.records import DEFAULT_TENANT


@dataclass(frozen=True)
class Caller:
    tenant: str = DEFAULT_TENANT
    role: str = "user"
    # Queued requests this tenant may have at once (0: only the global backlog limit).
    max_queued: int = 0

    @property
    def scope(self) -> str:
        """The tenant whose objects this caller may see."""
        return self.tenant


async def caller(request: Request) -> Caller:
    return Caller()
