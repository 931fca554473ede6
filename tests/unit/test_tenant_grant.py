"""The limits that apply to a tenant: its grant, tightened by its own (0: none)."""

from gateway.server.tenants.config import TenantConfig, TenantLimits, tightest


def test_each_limit_is_the_lower_of_the_grant_and_the_tenants_own() -> None:
    grant = TenantLimits(requests_per_minute=60, tokens_per_minute=0, max_concurrent=2, max_queued=10)
    own = TenantLimits(requests_per_minute=10, tokens_per_minute=500, max_concurrent=0, max_queued=20)
    assert tightest(grant, own) == TenantLimits(
        requests_per_minute=10, tokens_per_minute=500, max_concurrent=2, max_queued=10
    )


def test_a_tenant_config_applies_its_effective_limits() -> None:
    config = TenantConfig(tenant="t", limits=TenantLimits(max_queued=8), own_limits=TenantLimits(max_queued=3))
    assert config.effective.max_queued == 3
    assert config.public()["effective_limits"]["max_queued"] == 3
