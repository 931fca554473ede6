"""Prompt blocks: the hash chain of every whole block of `tokens_per_block` tokens, so a
key names the whole prefix up to its block. The same function as the engines' block
cache (model_repo/local/llm_engine/1/kv_blocks.py; a test keeps them equal)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_ROOT = b"\x00" * 16


def block_keys(tokens: Sequence[int], tokens_per_block: int) -> list[bytes]:
    keys, previous = [], _ROOT
    for start in range(0, len(tokens) - tokens_per_block + 1, tokens_per_block):
        block = tokens[start : start + tokens_per_block]
        previous = hashlib.blake2b(previous + struct.pack(f"<{len(block)}i", *block), digest_size=16).digest()
        keys.append(previous)
    return keys
