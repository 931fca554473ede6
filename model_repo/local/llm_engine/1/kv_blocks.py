"""A block-based prefix KV cache, like TensorRT-LLM's enable_kv_cache_reuse.

A prompt is split into blocks of `tokens_per_block` tokens; each whole block is keyed by
the hash chain of all tokens up to its end, so a key names a prefix, not just a block.
A request reuses the longest cached run of whole blocks from its start and prefills
only the rest. Blocks are evicted least recently used first when the cache is full.

`max_blocks` is the KV budget of the engine in blocks (what the metrics report as `max`);
the engine may lower the cache's `capacity` below it while running sequences need the
memory, as TensorRT-LLM reuses only blocks that are free."""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

_ROOT = b"\x00" * 16


def salt_root(cache_salt_id: int) -> bytes:
    """Where a salted chain starts (TensorRT-LLM's cache_salt_id; 0: unsalted)."""
    return cache_salt_id.to_bytes(8, "little") + b"\x00" * 8 if cache_salt_id else _ROOT


def block_keys(tokens: Sequence[int], tokens_per_block: int, cache_salt_id: int = 0) -> list[bytes]:
    """The hash chain of every whole block of `tokens` (the same function as the gateway's
    prefix index, so both name a prefix alike), from the request's cache salt: the same
    tokens under two salts (two tenants) share no block."""
    keys, previous = [], salt_root(cache_salt_id)
    for start in range(0, len(tokens) - tokens_per_block + 1, tokens_per_block):
        block = tokens[start : start + tokens_per_block]
        previous = hashlib.blake2b(previous + struct.pack(f"<{len(block)}i", *block), digest_size=16).digest()
        keys.append(previous)
    return keys


class BlockCache:
    def __init__(self, tokens_per_block: int, max_blocks: int) -> None:
        self.tokens_per_block = tokens_per_block
        self.max_blocks = max_blocks
        self.capacity = max_blocks  # blocks this cache may hold now
        self._blocks: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.reused_total = 0  # blocks served from the cache, ever
        self.lookups = 0

    def match(self, keys: list[bytes]) -> list[Any]:
        """The payloads of the longest run of cached blocks from the start."""
        found = []
        with self._lock:
            self.lookups += 1
            for key in keys:
                if key not in self._blocks:  # (a payload may be None: the synthetic engine's)
                    break
                self._blocks.move_to_end(key)
                found.append(self._blocks[key])
            self.reused_total += len(found)
        return found

    def insert(self, keys: list[bytes], payloads: list[Any]) -> None:
        with self._lock:
            for key, payload in zip(keys, payloads, strict=True):
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    continue
                self._blocks[key] = payload
            self._evict()

    def limit(self, capacity: int) -> None:
        """Hold at most `capacity` blocks from now on (at most max_blocks), evicting the
        least recently used."""
        with self._lock:
            self.capacity = max(0, min(capacity, self.max_blocks))
            self._evict()

    def _evict(self) -> None:
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._blocks)
