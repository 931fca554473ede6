"""Webhooks: the delivery queue in Redis (queue.py), the address guard (guard.py), and
the signed, retried sender (sender.py)."""

from binder.webhooks.guard import AddressGuard, Refused, Unresolvable
from binder.webhooks.queue import Delivery, WebhookQueue
from binder.webhooks.sender import WebhookSender, retry_after_seconds, sign

__all__ = [
    "AddressGuard",
    "Delivery",
    "Refused",
    "Unresolvable",
    "WebhookQueue",
    "WebhookSender",
    "retry_after_seconds",
    "sign",
]
