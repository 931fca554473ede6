"""Who a call is made for: a tenant, a role, the key used, the tenant's settings, and the
response headers the calls made on its behalf add (rate limits)."""

from __future__ import annotations

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
