"""API keys: `tgw_<key id>_<secret>`, random, shown once, stored in MongoDB only as the
SHA-256 of the secret (the secret is 256 random bits, so a fast hash is safe), compared
in constant time, never logged. Each key belongs to a tenant and has a role: `user`
(the API), `admin` (also manages its own tenant: its keys, settings and usage) or
`operator` (manages every tenant and the deployment; `gateway keys create --operator`, and
the local stack's own key). Through the API a tenant has at most TENANT_MAX_KEYS keys not
revoked (403 `key_quota_exceeded` beyond), each create reserved atomically beside the
others in flight (gateway.server.tenants.reservations); the operator's CLI is not limited.

Verified keys are cached (tenants/refreshing.py): a key verified before is answered from
memory, and read again behind the callers once its entry is older than a few seconds, so
a slow or absent MongoDB neither fails nor slows the requests of known keys. A revocation
or role change is announced on Redis pub/sub (`keys:changed`, naming the key): every
gateway drops that key at once (and all keys whenever its subscription reconnects, since a
message may have been missed then), so a revoked key stops working everywhere within
moments and is not brought back by an outage or by a verification that was in flight.
Keys that were not found are cached apart, in a bounded LRU: a flood of random keys cannot
push out the keys of real callers."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from cachetools import TTLCache
from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection
from redis.asyncio import Redis

from gateway.common.redis import RedisClients
from gateway.protocol.redis_keys import KEYS_CHANNEL
from gateway.server.errors import Forbidden
from gateway.server.tenants.refreshing import RefreshingCache
from gateway.server.tenants.reservations import Over, now_ms, reserve

KEYS_COLLECTION = "api_keys"
PREFIX = "tgw_"
# Cached verifications: valid keys, and keys found unknown or revoked, apart.
MAX_CACHED_KEYS = 10_000
MAX_CACHED_MISSES = 10_000
# The keys of a tenant being created now: they count against its TENANT_MAX_KEYS beside
# those not revoked (gateway.server.tenants.reservations).
RESERVATIONS_KEY = "keys:reserved:{{{tenant}}}"
Role = Literal["user", "admin", "operator"]


@dataclass(frozen=True)
class KeyInfo:
    key_id: str
    tenant: str
    role: Role
    name: str
    created_at: datetime
    revoked: bool = False

    def public(self) -> dict[str, Any]:
        return {
            "id": self.key_id,
            "tenant": self.tenant,
            "role": self.role,
            "name": self.name,
            "created_at": self.created_at.isoformat(),
            "revoked": self.revoked,
        }


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def split(token: str) -> tuple[str, str] | None:
    """(key id, secret) of a well-formed key, else None."""
    if not token.startswith(PREFIX) or len(token) > 200:
        return None
    key_id, sep, secret = token[len(PREFIX) :].partition("_")
    if not sep or not key_id.isalnum() or not secret:
        return None
    return key_id, secret


class KeyStore:
    def __init__(
        self,
        client: AsyncMongoClient,
        database: str,
        *,
        cache_s: float = 10.0,
        announce: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        """announce(key id): tell every process that this key changed (a revocation)."""
        self.collection: AsyncCollection = client[database][KEYS_COLLECTION]
        self.cache_s = cache_s
        self.announce = announce
        # By the SHA-256 of the whole key: the cache never holds a key in the clear.
        self._valid: RefreshingCache[str, KeyInfo] = RefreshingCache(fresh_s=cache_s, maxsize=MAX_CACHED_KEYS)
        self._missing: TTLCache[str, bool] = TTLCache(MAX_CACHED_MISSES, ttl=max(cache_s, 1e-3))

    def forget(self, key_id: str | None = None) -> None:
        """Drop the cached verifications of one key, or of every key (None)."""
        if key_id is None:
            self._valid.clear()
        else:
            self._valid.drop_where(lambda info: info.key_id == key_id)
        self._missing.clear()

    async def create(
        self, tenant: str, role: Role = "user", name: str = "", *, max_keys: int = 0, redis: Redis | None = None
    ) -> tuple[KeyInfo, str]:
        """A new key; returns its info and the key itself (the only time it is seen).
        Raises Forbidden (`key_quota_exceeded`) when the tenant has max_keys keys not
        revoked (0: no limit), counting the keys being created now: each is reserved in
        redis while it is stored, so keys made at the same moment cannot all pass it
        (without redis it is only checked)."""
        if not max_keys:
            return await self._create(tenant, role, name)
        counted_at_ms = now_ms()
        live = await self.collection.count_documents({"tenant": tenant, "revoked": False})
        if redis is None:
            if live >= max_keys:
                raise _over_keys(tenant, max_keys, live)
            return await self._create(tenant, role, name)
        reserved = await reserve(
            redis,
            RESERVATIONS_KEY.format(tenant=tenant),
            kept=live,
            kept_bytes=0,
            counted_at_ms=counted_at_ms,
            size=0,
            max_count=max_keys,
            max_bytes=0,
        )
        if isinstance(reserved, Over):
            raise _over_keys(tenant, max_keys, reserved.used)
        try:
            return await self._create(tenant, role, name)
        finally:
            await reserved.release()

    async def _create(self, tenant: str, role: Role, name: str) -> tuple[KeyInfo, str]:
        key_id = secrets.token_hex(6)
        secret = secrets.token_urlsafe(32)
        info = KeyInfo(key_id, tenant, role, name, datetime.now(UTC))
        await self.collection.insert_one(
            {
                "_id": key_id,
                "hash": _hash(secret),
                "tenant": tenant,
                "role": role,
                "name": name,
                "created_at": info.created_at,
                "revoked": False,
            }
        )
        return info, f"{PREFIX}{key_id}_{secret}"

    async def verify(self, token: str) -> KeyInfo | None:
        """The key's info, or None for a key that is unknown, wrong or revoked. Raises
        PyMongoError only for a key not cached while MongoDB cannot be read."""
        parts = split(token)
        if parts is None:
            return None
        key_id, secret = parts
        cache_key = _hash(token)
        if cache_key in self._missing:
            return None

        async def read() -> KeyInfo | None:
            document = await self.collection.find_one({"_id": key_id})
            if document is None or not hmac.compare_digest(document.get("hash", ""), _hash(secret)):
                return None
            info = _info(document)
            return None if info.revoked else info

        info = await self._valid.get(cache_key, read)
        if info is None:
            self._missing[cache_key] = True
        return info

    async def get(self, key_id: str) -> KeyInfo | None:
        """A key's info by its id (revoked or not), never its secret."""
        document = await self.collection.find_one({"_id": key_id})
        return _info(document) if document is not None else None

    async def set_role(self, key_id: str, role: Role) -> None:
        await self.collection.update_one({"_id": key_id}, {"$set": {"role": role}})
        self.forget(key_id)
        if self.announce is not None:
            await self.announce(key_id)

    async def list(self, tenant: str | None = None) -> list[KeyInfo]:
        query = {"tenant": tenant} if tenant else {}
        return [_info(d) async for d in self.collection.find(query).sort("created_at", 1)]

    async def revoke(self, key_id: str, tenant: str | None = None) -> bool:
        query: dict[str, Any] = {"_id": key_id}
        if tenant is not None:
            query["tenant"] = tenant
        result = await self.collection.update_one(query, {"$set": {"revoked": True}})
        self.forget(key_id)
        if result.matched_count == 1 and self.announce is not None:
            await self.announce(key_id)
        return result.matched_count == 1


def _over_keys(tenant: str, max_keys: int, used: int) -> Forbidden:
    return Forbidden(
        "key_quota_exceeded",
        f"tenant {tenant} has or is creating {used} keys, its quota (TENANT_MAX_KEYS) is {max_keys}: revoke one first",
        details={"quota": "TENANT_MAX_KEYS", "limit": max_keys, "used": used},
    )


def _info(document: dict[str, Any]) -> KeyInfo:
    return KeyInfo(
        key_id=document["_id"],
        tenant=document["tenant"],
        role=document.get("role", "user"),
        name=document.get("name", ""),
        created_at=document.get("created_at") or datetime.now(UTC),
        revoked=bool(document.get("revoked")),
    )


async def follow_key_changes(keys: KeyStore, redis: RedisClients) -> None:
    """Drop a key from the cache whenever it changes anywhere (supervised: returns only by
    failing). A message may be lost while the subscription reconnects: every key is
    dropped on each (re)subscription as well."""
    async with redis.subscription(KEYS_CHANNEL) as pubsub:
        keys.forget()
        while True:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0)
            if message is None:
                await pubsub.ping()
                continue
            data = message["data"]
            key_id = data.decode() if isinstance(data, bytes) else str(data)
            keys.forget(key_id if key_id.isalnum() else None)  # not a key id: drop them all


def announcer(redis: RedisClients) -> Callable[[str], Awaitable[None]]:
    async def announce(key_id: str) -> None:
        await redis.main.publish(KEYS_CHANNEL, key_id)

    return announce
