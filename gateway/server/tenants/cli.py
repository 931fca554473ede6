"""`gateway keys create|list|revoke`: manage API keys directly in MongoDB (MONGO_URL,
MONGO_DB), as an operator does, also before any admin key exists. The admin API
(/admin/keys) does the same over HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

if TYPE_CHECKING:
    from gateway.server.tenants.keys import Role

app = typer.Typer(help="API keys: create, list, revoke (in MongoDB: MONGO_URL, MONGO_DB).", no_args_is_help=True)

T = TypeVar("T")


def _with_keys(work: Callable[[Any], Awaitable[T]]) -> T:
    from pymongo import AsyncMongoClient

    from gateway.common.redis import RedisClients
    from gateway.common.settings import ServiceSettings
    from gateway.server.tenants.keys import KeyStore, announcer

    settings = ServiceSettings()

    async def announce(key_id: str) -> None:
        """Tell the running gateways (through Redis) to drop the key from their caches."""
        redis = RedisClients.open(
            url=settings.redis_url, cluster_nodes=settings.redis_cluster_nodes, timeout_s=2.0, max_connections=8
        )
        try:
            await announcer(redis)(key_id)
        except Exception as exc:
            why = type(exc).__name__
            typer.echo(f"warning: Redis not reachable ({why}); gateways forget the key within 10 s", err=True)
        finally:
            await redis.aclose()

    async def run() -> T:
        client: AsyncMongoClient = AsyncMongoClient(settings.mongo_url, tz_aware=True, serverSelectionTimeoutMS=5000)
        try:
            return await work(KeyStore(client, settings.mongo_db, cache_s=0, announce=announce))
        finally:
            await client.close()

    return asyncio.run(run())


@app.command()
def create(
    tenant: Annotated[str, typer.Option(help="The tenant the key belongs to")],
    admin: Annotated[
        bool, typer.Option("--admin", help="An admin key: manages its own tenant (keys, settings, usage)")
    ] = False,
    operator: Annotated[
        bool, typer.Option("--operator", help="An operator key: manages every tenant and the deployment")
    ] = False,
    name: Annotated[str, typer.Option(help="A label for the key")] = "",
) -> None:
    """Create a key and print it (it is shown only this once)."""
    role: Role = "operator" if operator else "admin" if admin else "user"
    info, key = _with_keys(lambda keys: keys.create(tenant, role, name))
    typer.echo(json.dumps({**info.public(), "key": key}, indent=2))


@app.command("list")
def list_keys(tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys")] = None) -> None:
    """List keys (never the keys themselves)."""
    found = _with_keys(lambda keys: keys.list(tenant))
    typer.echo(json.dumps([k.public() for k in found], indent=2))


@app.command()
def revoke(key_id: Annotated[str, typer.Argument(help="The key's id (from `list`)")]) -> None:
    """Revoke a key: the running gateways are told through Redis and stop accepting it at once."""
    if not _with_keys(lambda keys: keys.revoke(key_id)):
        typer.echo(f"error: no key {key_id}", err=True)
        raise typer.Exit(1)
    typer.echo(f"revoked {key_id}")


def ensure_local_key(path: Path, mongo_url: str, database: str, tenant: str = "local") -> tuple[str, bool]:
    """The local stack's key, an operator key of `tenant` (it manages every tenant): the one
    saved at `path` if MongoDB still knows it (made an operator if it was an admin key of an
    earlier version), else a new one, saved there (0600). Returns (key, created)."""
    from pymongo import AsyncMongoClient

    from gateway.server.tenants.keys import KeyStore

    saved = path.read_text().strip() if path.exists() else ""

    async def run() -> tuple[str, bool]:
        client: AsyncMongoClient = AsyncMongoClient(mongo_url, tz_aware=True, serverSelectionTimeoutMS=10000)
        try:
            keys = KeyStore(client, database, cache_s=0)
            info = await keys.verify(saved) if saved else None
            if info is not None:
                if info.role != "operator":
                    await keys.set_role(info.key_id, "operator")
                return saved, False
            _, key = await keys.create(tenant, "operator", "local stack")
            return key, True
        finally:
            await client.close()

    key, created = asyncio.run(run())
    if created:
        path.write_text(key + "\n")
        path.chmod(0o600)
    return key, created
