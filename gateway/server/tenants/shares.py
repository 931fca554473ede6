"""A tenant's share of a process's shared pools (the event hub's followers and long polls,
searches in flight, long tokenizations: gateway.server.models.tokenize_pool): a pool
holds at most `total` at once, a tenant at most `share` of them, so one tenant holding
its whole share leaves the rest to the others. Counted in the process (each gateway
process has pools of its own); a hold is released when its block ends, however it ends
(or, taken without a block, at its release)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from gateway.server.errors import Busy, Unavailable


def share_of(total: int, fraction: float, floor: int) -> int:
    """A tenant's share of a pool of `total`: the fraction of it, at least the floor, at
    most the whole pool."""
    return max(1, min(total, max(floor, math.ceil(fraction * total))))


def backlog_share(whole: int, fraction: float) -> int:
    """A tenant's share of a backlog of `whole` waiting requests (TENANT_BACKLOG_SHARE of
    it, at least one): what a max_queued of 0 grants (submission.admission)."""
    return max(1, math.floor(whole * fraction))


def queued_granted(granted: int, max_backlog: int, max_batch_backlog: int, fraction: float) -> int:
    """The most a tenant's own max_queued may be under a grant of `granted`: the grant, or,
    at 0, the tenant's share of the smaller backlog (an own max_queued binds in both the
    interactive and the batch backlog, and replaces the share in each)."""
    return granted or min(backlog_share(max_backlog, fraction), backlog_share(max_batch_backlog, fraction))


class ShareExceeded(Busy):
    """The tenant holds its whole share of a pool: 429 tenant_share_exceeded, the pool
    named in the details (others' calls are not refused)."""

    def __init__(self, pool: str, share: int, *, retry_after_s: int = 1) -> None:
        super().__init__(
            "tenant_share_exceeded",
            f"this tenant holds its share of {pool} ({share} at once in this process); "
            f"retry once one of them has ended",
            retry_after_s=retry_after_s,
        )
        self.details = {"pool": pool, "share": share}


class PoolFull(Unavailable):
    """The whole pool is held (by several tenants, none past its share): 503."""

    def __init__(self, code: str, pool: str, total: int, *, retry_after_s: int = 1) -> None:
        super().__init__(
            code,
            f"{total} {pool} are held in this process; retry shortly",
            details={"pool": pool},
            headers={"Retry-After": str(retry_after_s)},
        )


class SharedPool:
    """Holders of one pool of a process, by tenant."""

    def __init__(self, name: str, *, total: int | None, share: int, full_code: str = "pool_full") -> None:
        """name: what the pool holds, as the refusals say it ("event streams"). total: the
        most it holds at once (None: no limit but the tenants' shares); share: the most one
        tenant holds."""
        self.name = name
        self.total = total
        self.share = share
        self.full_code = full_code
        self.held = 0
        self.by_tenant: Counter[str] = Counter()

    def check(self, tenant: str | None) -> None:
        """Raise the refusal a hold for this tenant would get now (ShareExceeded, PoolFull).
        A tenant of None counts against the total only."""
        if tenant is not None and self.by_tenant[tenant] >= self.share:
            raise ShareExceeded(self.name, self.share)
        if self.total is not None and self.held >= self.total:
            raise PoolFull(self.full_code, self.name, self.total)

    @contextmanager
    def hold(self, tenant: str | None) -> Iterator[None]:
        """Hold one place of the pool for the block (refused at once when there is none)."""
        self.take(tenant)
        try:
            yield
        finally:
            self.release(tenant)

    def take(self, tenant: str | None, *, refuse: bool = True) -> None:
        """Hold one place until release(tenant), for a hold that ends elsewhere than where
        it began (work in another thread). refuse=False: counted without the check, for work
        that must not be refused (it still counts against the tenant's share and the total,
        so the holds after it see it)."""
        if refuse:
            self.check(tenant)  # (no await between the check and the count: nothing comes between)
        self.held += 1
        if tenant is not None:
            self.by_tenant[tenant] += 1

    def release(self, tenant: str | None) -> None:
        self.held -= 1
        if tenant is not None:
            self.by_tenant[tenant] -= 1
            if self.by_tenant[tenant] <= 0:
                del self.by_tenant[tenant]
