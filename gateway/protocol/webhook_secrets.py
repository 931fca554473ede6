"""Standard Webhooks signing secrets: `whsec_` and the base64 of 24 to 64 random bytes.

One check for every place a secret comes in (the binder's WEBHOOK_SECRETS, a tenant's
secrets set through the admin API, and the binder again at send time, for secrets stored
before the API checked them). Messages never quote the secret.

A tenant that set no secrets of its own is signed with its derived secret: HMAC-SHA256
keyed by a deployment secret's bytes over the tenant's name, in `whsec_` form. Each
tenant's differs, so no tenant can sign for another; the binder signs with it and the
gateway shows it to the tenant's admin (GET /admin/tenants/<t>/webhook-secret), both
through tenant_secrets() here."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Sequence

SECRET_PREFIX = "whsec_"
# Standard Webhooks: a secret is 24 to 64 random bytes, base64-encoded after the prefix.
SECRET_BYTES = (24, 64)
EXPECTED = f"expected {SECRET_PREFIX} and the base64 of {SECRET_BYTES[0]} to {SECRET_BYTES[1]} random bytes"


def _key(secret: str) -> bytes:
    """The key bytes of a `whsec_` secret (raises ValueError when it is not base64)."""
    body = secret[len(SECRET_PREFIX) :]
    try:
        return base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except binascii.Error as exc:
        raise ValueError(str(exc)) from None


def secret_problem(secret: str) -> str | None:
    """What is wrong with a signing secret (never quoting it), or None."""
    if not secret.startswith(SECRET_PREFIX):
        return f"does not start with {SECRET_PREFIX}"
    try:
        key = _key(secret)
    except ValueError:
        return f"is not base64 after {SECRET_PREFIX}"
    low, high = SECRET_BYTES
    if not low <= len(key) <= high:
        return f"decodes to {len(key)} bytes, not {low} to {high}"
    return None


def secrets_problem(secrets: list[str]) -> str | None:
    """The first problem of a list of secrets, naming the secret by its place
    ("secret 2 of 3 ... (expected ...)"), or None when all can sign."""
    for number, secret in enumerate(secrets, 1):
        problem = secret_problem(secret)
        if problem:
            return f"secret {number} of {len(secrets)} {problem} ({EXPECTED})"
    return None


def tenant_secret(deployment_secret: str, tenant: str) -> str:
    """The tenant's signing secret derived from one deployment secret (a valid `whsec_`
    secret, as the settings check): HMAC-SHA256(its key bytes, the tenant's name), 32 bytes."""
    digest = hmac.new(_key(deployment_secret), tenant.encode(), hashlib.sha256).digest()
    return SECRET_PREFIX + base64.b64encode(digest).decode()


def tenant_secrets(deployment_secrets: Sequence[str], tenant: str) -> tuple[str, ...]:
    """The tenant's derived secrets, one per deployment secret in the same order (newest
    first: during a rotation of WEBHOOK_SECRETS either verifies)."""
    return tuple(tenant_secret(secret, tenant) for secret in deployment_secrets)
