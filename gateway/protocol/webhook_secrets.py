"""Standard Webhooks signing secrets: `whsec_` and the base64 of 24 to 64 random bytes.

One check for every place a secret comes in (the binder's WEBHOOK_SECRETS, a tenant's
secrets set through the admin API, and the binder again at send time, for secrets stored
before the API checked them). Messages never quote the secret."""

from __future__ import annotations

import base64
import binascii

SECRET_PREFIX = "whsec_"
# Standard Webhooks: a secret is 24 to 64 random bytes, base64-encoded after the prefix.
SECRET_BYTES = (24, 64)
EXPECTED = f"expected {SECRET_PREFIX} and the base64 of {SECRET_BYTES[0]} to {SECRET_BYTES[1]} random bytes"


def secret_problem(secret: str) -> str | None:
    """What is wrong with a signing secret (never quoting it), or None."""
    if not secret.startswith(SECRET_PREFIX):
        return f"does not start with {SECRET_PREFIX}"
    body = secret[len(SECRET_PREFIX) :]
    try:
        key = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except (binascii.Error, ValueError):
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
