"""The binder process: the archiver, the index follower and the webhook sender, plus a
small internal HTTP API for the gateways (search, webhook replay, health).

Start-up does no I/O: each loop prepares what it needs (MongoDB indexes, the consumer
group, the index snapshot or rebuild) when it first runs, under the supervisor. So a
binder started while MongoDB or Redis is down comes up and /healthz answers 503 with
the failing loops, until they recover; settings that cannot work (a bad signing
secret) stop it at start instead (binder/cli.py)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from pymongo import AsyncMongoClient

from binder.archive import Archiver
from binder.index.follower import IndexFollower
from binder.index.vectors import VectorIndex, hit_of
from binder.metrics import BinderMetrics
from binder.settings import BinderSettings
from binder.webhooks import WebhookQueue, WebhookSender
from binder.webhooks.secrets import TenantSecrets
from binder.webhooks.sender import TenantShare
from gateway.common.logs import configure_logging
from gateway.common.redis import MAX_BLOCK_MS, RedisClients
from gateway.common.result_store import ResultStore
from gateway.common.retry import LoopHealth, cancel_and_wait, supervise
from gateway.common.settings import is_loopback
from gateway.protocol.records import TENANTS_COLLECTION

log = logging.getLogger(__name__)


class SearchQuery(BaseModel):
    space: str = Field(max_length=64)
    vector: list[float] = Field(min_length=1, max_length=8192)
    k: int = Field(default=5, ge=1, le=1000)
    tenant: str | None = Field(default=None, max_length=128)


class ReplayQuery(BaseModel):
    tenant: str | None = Field(default=None, max_length=128)


@dataclass
class Binder:
    store: ResultStore
    queue: WebhookQueue
    archiver: Archiver
    index: VectorIndex
    follower: IndexFollower
    health: list[LoopHealth]


def binder(request: Request) -> Binder:
    return request.app.state.binder


# What probes and Prometheus read without the API key: health and metrics, never results.
PUBLIC_PATHS = frozenset({"/healthz", "/metrics"})


def api_guard(settings: BinderSettings) -> Callable[[Request], Awaitable[None]]:
    """The binder API's authentication, for every route but PUBLIC_PATHS: with
    BINDER_API_KEY, `Authorization: Bearer <BINDER_API_KEY>` (401 otherwise); without
    it, loopback peers only (403 otherwise; settings refuse a non-loopback bind then)."""
    key = settings.binder_api_key.get_secret_value().encode() if settings.binder_api_key else None

    async def authorize(request: Request) -> None:
        if request.url.path in PUBLIC_PATHS:
            return
        if key is None:
            peer = request.client.host if request.client else ""
            if not is_loopback(peer):
                raise HTTPException(403, "the binder's API serves loopback peers only without BINDER_API_KEY")
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
            raise HTTPException(
                401,
                "the binder's API needs Authorization: Bearer <BINDER_API_KEY>",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return authorize


def create_app(settings: BinderSettings | None = None) -> FastAPI:
    settings = settings or BinderSettings()
    configure_logging(settings.log_level, settings.log_format)
    metrics = BinderMetrics(  # read when scraped
        stored=lambda: app.state.binder.archiver.stored_total,
        dead_lettered=lambda: app.state.binder.archiver.dead_lettered,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Blocking reads share the main client: its timeouts allow for the longest block.
        clients = RedisClients.open(
            url=settings.redis_url,
            cluster_nodes=settings.redis_cluster_nodes,
            timeout_s=settings.redis_timeout_s + MAX_BLOCK_MS / 1000,
            max_connections=64,
        )
        redis = clients.main
        timeout_ms = int(settings.mongo_timeout_s * 1000)
        mongo: AsyncMongoClient = AsyncMongoClient(
            settings.mongo_url, tz_aware=True, serverSelectionTimeoutMS=timeout_ms, connectTimeoutMS=timeout_ms
        )
        store = ResultStore(mongo, settings.mongo_db, settings.result_retention_s)
        queue = WebhookQueue(
            redis, lease_s=settings.webhook_lease_s, shards=settings.redis_shards, keep_s=settings.webhook_keep_s
        )
        archiver = Archiver(redis, store, queue, settings)
        partition = f"{settings.index_partition}/{settings.index_partitions}" if settings.index_partitions > 1 else ""
        index = VectorIndex(settings.faiss_dir, partition=partition)
        follower = IndexFollower(
            redis,
            index,
            store,
            shards=archiver.shards,
            reader=clients.reader,
            snapshot_interval_s=settings.snapshot_interval_s,
            holds=settings.holds,
            name=settings.binder_name,
        )

        async def webhook_status(request_id: str, outcome: str, attempts: list[dict[str, Any]]) -> None:
            metrics.webhook_outcomes.labels(outcome).inc()
            await store.set_webhook_status(request_id, outcome, attempts)

        sender = WebhookSender(
            queue,
            webhook_status,
            records=store.get,
            secrets=TenantSecrets(
                mongo[settings.mongo_db][TENANTS_COLLECTION],
                settings.webhook_secrets,
                cache_s=settings.webhook_tenant_secrets_cache_s,
            ),
            retry_delays=settings.retry_delays,
            jitter=settings.webhook_jitter,
            timeout_s=settings.webhook_timeout_s,
            concurrency=settings.webhook_concurrency,
            allowlist=settings.webhook_allowlist,
            retry_after_max_s=settings.webhook_retry_after_max_s,
            expire_after_s=settings.result_retention_s,
            tenant_share=TenantShare(
                fraction=settings.webhook_tenant_share,
                floor=settings.webhook_tenant_floor,
                slow_s=settings.webhook_tenant_slow_s,
                backoff_after=settings.webhook_tenant_backoff_after,
                backoff_s=settings.webhook_tenant_backoff_s,
                backoff_max_s=settings.webhook_tenant_backoff_max_s,
            ),
        )
        loops = [
            (LoopHealth("archiver"), archiver.run),
            (LoopHealth("index follower"), follower.run),
            (LoopHealth("webhook sender"), sender.run),
        ]
        app.state.binder = Binder(store, queue, archiver, index, follower, [health for health, _ in loops])
        tasks = [asyncio.create_task(supervise(health, run), name=health.name) for health, run in loops]
        log.info("binder %s running", settings.binder_name)
        try:
            yield
        finally:
            await cancel_and_wait(tasks)
            await sender.close()
            await follower.close()
            await mongo.close()
            await clients.aclose()

    # FastAPI's own /docs and /openapi.json take no dependencies: served here as routes of
    # the app instead, behind its key like every route but PUBLIC_PATHS.
    app = FastAPI(
        title="binder (internal)",
        lifespan=lifespan,
        dependencies=[Depends(api_guard(settings))],
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_document() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

    @app.get("/healthz")
    async def healthz(request: Request) -> Any:
        """200 ok once the loops have prepared and while none keeps failing; otherwise
        503, "starting" or "failing" (with the failing loops and their last errors)."""
        parts = binder(request)
        failing = {h.name: h.last_error for h in parts.health if h.failing()}
        ready = parts.archiver.prepared and parts.follower.prepared
        status = "failing" if failing else "ok" if ready else "starting"
        body = {
            "status": status,
            "stored": parts.archiver.stored_total,
            "index": {space: parts.index.ntotal(space) for space in parts.index.spaces},
            "last_applied": parts.index.positions,
            "snapshot": parts.index.snapshotted,  # vectors per space a restart would load; null: none yet
            "partition": parts.index.partition or None,  # "i/N" with INDEX_PARTITIONS > 1
            "failing": failing,
        }
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        """Prometheus metrics: the results stream's lag, webhook outcomes, results stored."""
        archiver = binder(request).archiver
        await metrics.refresh(archiver.redis, archiver.shards)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/search")
    async def search(query: SearchQuery, request: Request) -> Any:
        """The k nearest results of the tenant (of every tenant of this binder's index
        partition when none is given); 421 for a tenant of another partition."""
        if query.tenant is not None and not settings.holds(query.tenant):
            message = f"tenant {query.tenant} is not in index partition {settings.index_partition} of this binder"
            return JSONResponse({"detail": message, "code": "wrong_partition"}, status_code=421)
        index = binder(request).index
        try:
            hits = await asyncio.to_thread(index.search, query.space, query.vector, query.k, query.tenant)
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from None
        return {"hits": [hit_of(key, score) for key, score in hits]}

    @app.post("/webhooks/{request_id}/replay")
    async def replay(request_id: str, request: Request, body: ReplayQuery | None = None) -> Any:
        """Queue the stored result's webhook once more: 404 without a stored result (of the
        tenant, when one is given), 409 without a webhook or while a replay of it is still
        pending, 429 once its tenant has used WEBHOOK_REPLAYS_PER_MINUTE (Retry-After)."""
        parts = binder(request)
        record = await parts.store.get(request_id, body.tenant if body else None)
        if record is None:
            raise HTTPException(404, f"no stored result {request_id}")
        if record.webhook is None:
            raise HTTPException(409, f"{request_id} has no webhook")
        replay = await parts.queue.replay(record, per_minute=settings.webhook_replays_per_minute)
        if replay.pending is not None:
            message = f"a replay of {request_id}'s webhook is still pending"
            return JSONResponse({"detail": message, "code": "replay_pending"}, status_code=409)
        if replay.retry_after_s is not None:
            message = (
                f"tenant {record.tenant} has replayed {settings.webhook_replays_per_minute} webhooks this minute; "
                f"retry in {replay.retry_after_s}s"
            )
            return JSONResponse(
                {"detail": message, "code": "replay_rate_limited"},
                status_code=429,
                headers={"Retry-After": str(replay.retry_after_s)},
            )
        return {"request_id": request_id, "deliveries": [replay.queued] if replay.queued else []}

    @app.get("/dead-letters")
    async def dead_letters(request: Request, limit: int = Query(default=100, ge=1, le=1000)) -> dict[str, Any]:
        """The dead-lettered results (up to `limit` per shard, oldest first), each with its
        error: why MongoDB could not store it, or that it kept failing."""
        return {"dead_letters": await binder(request).archiver.dead_letters(limit)}

    @app.post("/dead-letters/replay")
    async def replay_dead_letters(request: Request) -> dict[str, Any]:
        """Requeue dead-lettered results (once what made them fail is fixed)."""
        return {"requeued": await binder(request).archiver.replay_dead_letters()}

    return app
