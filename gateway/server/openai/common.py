"""What the /v1 doors share beyond the core (gateway.server.calls): an OpenAI body's labels
for its records, OpenAI's usage object, a created time, a streamed delta's padding."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable
from typing import Any

from gateway.protocol import ResultRecord
from gateway.server.calls import run
from gateway.server.calls.terms import Tier


def metadata(body: Any, kind: str, run_as: Tier | None = None) -> dict[str, str]:
    found = {**(getattr(body, "metadata", None) or {}), "api": kind}
    if getattr(body, "user", None):
        found["user"] = body.user[:512]
    if getattr(body, "safety_identifier", None):
        found["safety_identifier"] = body.safety_identifier[:512]
    if run_as is not None and run_as.name != "default":
        found["service_tier"] = run_as.name
    return found


def usage(records: Iterable[ResultRecord], tpb: int = 32) -> dict[str, Any]:
    """OpenAI's usage of the requests behind one call, summed (n choices are n requests:
    each prompt is counted, and the prefix cache's reuse shows in cached_tokens)."""
    summed = run.usage(records, tpb)
    return {
        "prompt_tokens": summed.prompt,
        "completion_tokens": summed.completion,
        "total_tokens": summed.prompt + summed.completion,
        "prompt_tokens_details": {"cached_tokens": summed.cached, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def created(record_or_now: ResultRecord | None = None) -> int:
    return int(record_or_now.created_at.timestamp()) if record_or_now else int(time.time())


def obfuscation(text: str) -> str:
    """Random padding for a streamed delta (OpenAI's include_obfuscation): the delta and its
    padding together come to a multiple of 16 characters, at least 16, so the size of an
    event does not tell how long its text is."""
    size = 16 - len(text) % 16
    return secrets.token_urlsafe(size)[:size]
