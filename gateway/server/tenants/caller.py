"""Who a call is made for: a tenant, a role, the key used, the tenant's settings, and the
response headers the calls made on its behalf add (rate limits)."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field

from gateway.protocol.records import DEFAULT_TENANT
from gateway.server.tenants.config import TenantConfig


@dataclass
class Caller:
    tenant: str = DEFAULT_TENANT
    role: str = "user"
    key_id: str = ""
    config: TenantConfig = field(default_factory=lambda: TenantConfig(tenant=DEFAULT_TENANT))
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def operator(self) -> bool:
        """Manages every tenant and the deployment (else an admin manages its own tenant)."""
        return self.role == "operator"

    @property
    def scope(self) -> str:
        """The tenant whose objects this caller may see."""
        return self.tenant


# The tenant of the call being served (set where the key is verified: api/tenancy.identify),
# for the parts a call reaches that are not handed its caller (the event hub's share).
_calling_tenant: ContextVar[str | None] = ContextVar("calling_tenant", default=None)


def calling_tenant() -> str | None:
    """The tenant of the call this task serves, if any."""
    return _calling_tenant.get()


def serving(tenant: str) -> None:
    """This task (and those it starts) serves a call of `tenant`."""
    _calling_tenant.set(tenant)
