"""The binder's settings (environment variables, see gateway.common.settings).

Settings that would only fail later (a signing secret that cannot sign, an allowlist
entry that cannot be parsed, an attempt deadline longer than its lease) are refused
here, so the binder stops at start with one line naming the problem (binder/cli.py)
instead of failing every delivery."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Self

from pydantic import Field, SecretStr, field_validator, model_validator

from binder.webhooks.guard import parse_allow_entry
from binder.webhooks.queue import LEASE_MARGIN_S
from gateway.common.settings import CommaList, ServiceSettings, index_partition, is_loopback
from gateway.protocol.webhook_secrets import secrets_problem


class BinderSettings(ServiceSettings):
    """Webhook destinations: a webhook goes only to a public address (no private,
    loopback, link-local, reserved, multicast, Teredo, 6to4 or local-use NAT64 address;
    a well-known-prefix NAT64 address 64:ff9b::/96 counts as the IPv4 address it
    embeds) on port 80 or 443, unless WEBHOOK_ALLOWLIST lets it through. Each
    comma-separated allowlist entry is one of:

    - `host`, `IP` or `CIDR` (`hooks.internal`, `10.1.2.3`, `10.1.0.0/16`, `fd00::/8`):
      that host name (whatever it resolves to) or those addresses, on any port;
    - the same with `:port` (`hooks.internal:8443`, `10.1.0.0/16:9000`, and for IPv6 in
      brackets, `[fd00::1]:8443`, `[fd00::/8]:8443`): only on that port;
    - `*:port` (`*:8443`): that port too, but still only on public addresses.
    """

    binder_host: str = "127.0.0.1"
    binder_port: int = 8090
    # The internal API's token (search, webhook and dead-letter replay): every call but
    # /healthz and /metrics needs `Authorization: Bearer <it>`; the gateways send their
    # BINDER_API_KEY. Unset, the binder must bind to loopback and serves loopback peers only.
    binder_api_key: SecretStr | None = Field(default=None, min_length=16)
    # Consumer name in the binders group; must be unique per running binder.
    binder_name: str = Field(default_factory=lambda: f"binder-{os.uname().nodename}-{os.getpid()}")
    batch_size: int = Field(default=256, ge=1)
    block_ms: int = Field(default=200, ge=1, le=1500)
    # After a short read, wait this long for more before writing: MongoDB (and nx-27017
    # most of all) stores a few large batches far more cheaply than many small ones.
    linger_ms: int = Field(default=50, ge=0)
    claim_idle_ms: int = Field(default=30_000, ge=50)
    # Stored results stay in the results streams at least this long, and until every live
    # index follower has read them (a follower gone longer rebuilds from MongoDB); a stored
    # request's hash and events stay this long too, then readers go to MongoDB. Each costs
    # Redis memory until then (an embedding's record about 9 KB).
    results_keep_s: float = Field(default=30.0, ge=0)
    # An entry delivered more often than this goes to the dead-letter stream.
    max_deliveries: int = Field(default=5, ge=1)
    faiss_dir: Path = Path(".stack/faiss")
    # The index partition this binder holds when INDEX_PARTITIONS > 1 (the vectors of the
    # tenants of that partition only). Default: the number BINDER_NAME ends with, modulo
    # INDEX_PARTITIONS (a StatefulSet's binder-3 holds partition 3 % N), so binder-i is
    # the i-th of the gateways' BINDER_URLS.
    index_partition: int | None = Field(default=None, ge=0)
    snapshot_interval_s: float = Field(default=30.0, gt=0)
    # Webhooks (Standard Webhooks): one or more `whsec_...` secrets, newest first; a tenant
    # that has none of its own is signed with secrets derived from them and its name
    # (gateway.protocol.webhook_secrets.tenant_secrets), never with these themselves.
    webhook_secrets: CommaList = []
    # Seconds before each attempt (Svix-like); the first is the initial delivery.
    webhook_retry_schedule: CommaList = ["0", "5", "300", "1800", "7200", "18000", "36000", "36000"]
    webhook_jitter: float = Field(default=0.1, ge=0, le=1)
    # The longest wait a receiver's Retry-After gets before the next attempt (a longer one
    # counts as this); never past the delivery's expiry (RESULT_RETENTION_S after its
    # first attempt) either.
    webhook_retry_after_max_s: float = Field(default=3600.0, ge=0)
    # The whole of one attempt (resolving, connecting, sending, the response headers),
    # however the receiver trickles its answer; must end inside the lease.
    webhook_timeout_s: float = Field(default=15.0, gt=0)
    # How long a claimed delivery is ours before another sender may take it.
    webhook_lease_s: float = Field(default=60.0, gt=LEASE_MARGIN_S)
    # A delivery's hash (its attempts log) stays in Redis this long once it is delivered or
    # has ended for good, then expires; queuing the same delivery again meanwhile is a
    # no-op (a result stored twice, within the results' redelivery, is not sent twice).
    webhook_keep_s: float = Field(default=3600.0, ge=1)
    webhook_concurrency: int = Field(default=64, ge=1)
    # A tenant's share of those slots: the fraction, at least the floor. While a tenant
    # holds its share, the other tenants' due webhooks go first (binder/webhooks/sender.py).
    webhook_tenant_share: float = Field(default=0.25, gt=0, le=1)
    webhook_tenant_floor: int = Field(default=2, ge=1)
    # A tenant whose attempts stall (run out of time, or fail after WEBHOOK_TENANT_SLOW_S)
    # this many times in a row is backed off: its webhooks wait WEBHOOK_TENANT_BACKOFF_S
    # (doubled each time its next attempt stalls too, up to ..._MAX_S), then go one at a
    # time until one is quick again.
    webhook_tenant_slow_s: float = Field(default=5.0, gt=0)
    webhook_tenant_backoff_after: int = Field(default=3, ge=1)
    webhook_tenant_backoff_s: float = Field(default=30.0, gt=0)
    webhook_tenant_backoff_max_s: float = Field(default=900.0, gt=0)
    # See the class docstring for the entry syntax.
    webhook_allowlist: CommaList = []
    # A tenant's own secrets (its document in MongoDB's `tenants` collection, set through
    # PUT /admin/tenants/<t>) are read at send time and kept this long.
    webhook_tenant_secrets_cache_s: float = Field(default=5.0, ge=0)
    # Replays a tenant may ask for per minute (POST /results/<id>/webhook/replay).
    webhook_replays_per_minute: int = Field(default=10, ge=1)

    @field_validator("webhook_secrets")
    @classmethod
    def _secrets_can_sign(cls, secrets: list[str]) -> list[str]:
        problem = secrets_problem(secrets)
        if problem:
            raise ValueError(problem)
        return secrets

    @field_validator("webhook_allowlist")
    @classmethod
    def _allowlist_parses(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            parse_allow_entry(entry)  # its ValueError names the entry and the problem
        return entries

    @field_validator("webhook_retry_schedule")
    @classmethod
    def _schedule_is_seconds(cls, delays: list[str]) -> list[str]:
        for delay in delays:
            try:
                if float(delay) < 0:
                    raise ValueError
            except ValueError:
                raise ValueError(f"{delay!r} is not a number of seconds >= 0") from None
        return delays

    @model_validator(mode="after")
    def _attempt_ends_inside_its_lease(self) -> Self:
        if self.webhook_timeout_s > self.webhook_lease_s - LEASE_MARGIN_S:
            raise ValueError(
                f"WEBHOOK_TIMEOUT_S ({self.webhook_timeout_s:g}) must be at least {LEASE_MARGIN_S:g}s shorter "
                f"than WEBHOOK_LEASE_S ({self.webhook_lease_s:g}), or a slow attempt outlives its lease "
                "and the delivery is sent twice"
            )
        return self

    @model_validator(mode="after")
    def _api_is_authenticated_or_local(self) -> Self:
        if self.binder_api_key is None and not is_loopback(self.binder_host):
            raise ValueError(
                f"BINDER_HOST={self.binder_host} serves the binder's API beyond this machine: set BINDER_API_KEY "
                "(the gateways send the same BINDER_API_KEY), or bind to 127.0.0.1"
            )
        return self

    @model_validator(mode="after")
    def _partition_is_known(self) -> Self:
        if self.index_partitions <= 1:
            self.index_partition = 0
            return self
        if self.index_partition is None:
            number = re.search(r"(\d+)$", self.binder_name)
            if number is None:
                raise ValueError(
                    f"INDEX_PARTITIONS={self.index_partitions} needs INDEX_PARTITION, or a BINDER_NAME ending "
                    "with its number (binder-3)"
                )
            self.index_partition = int(number.group(1)) % self.index_partitions
        if self.index_partition >= self.index_partitions:
            raise ValueError(f"INDEX_PARTITION must be below INDEX_PARTITIONS ({self.index_partitions})")
        return self

    def holds(self, tenant: str) -> bool:
        """Whether this binder's index partition holds the tenant's vectors."""
        return self.index_partitions <= 1 or index_partition(tenant, self.index_partitions) == self.index_partition

    @property
    def retry_delays(self) -> list[float]:
        return [float(x) for x in self.webhook_retry_schedule]
