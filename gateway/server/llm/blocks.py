"""Prompt blocks: the hash chain of every whole block of `tokens_per_block` tokens, so a
key names the whole prefix up to its block. The same function as the engines' block
cache (model_repo/local/llm_engine/1/kv_blocks.py; a test keeps them equal).

The chain starts from the cache salt (the tenant's): the same tokens of two tenants are
two prefixes, so neither the gateway's index nor a salted engine cache tells one tenant
what another sent."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_ROOT = b"\x00" * 16


def salt_root(salt: str | None) -> bytes:
    """Where a salted chain starts (the unsalted one: all zeros); the engine stand-ins start
    from the same bytes of the cache_salt_id they are sent."""
    return salt_id(salt).to_bytes(8, "little") + b"\x00" * 8 if salt else _ROOT


def salt_id(salt: str) -> int:
    """A salt as TensorRT-LLM's executor takes it (cache_salt_id, a 64-bit integer)."""
    return int.from_bytes(hashlib.blake2b(salt.encode("utf-8"), digest_size=8).digest(), "little")


def block_keys(tokens: Sequence[int], tokens_per_block: int, salt: str | None = None) -> list[bytes]:
    keys, previous = [], salt_root(salt)
    for start in range(0, len(tokens) - tokens_per_block + 1, tokens_per_block):
        block = tokens[start : start + tokens_per_block]
        previous = hashlib.blake2b(previous + struct.pack(f"<{len(block)}i", *block), digest_size=16).digest()
        keys.append(previous)
    return keys
