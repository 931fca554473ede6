"""The binder process: the archiver, the index follower and the webhook sender, plus a
small internal HTTP API for the gateways (search, webhook replay, health)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from pymongo import AsyncMongoClient

from binder.archive import Archiver
from binder.index.follower import IndexFollower
from binder.index.vectors import VectorIndex
from binder.settings import BinderSettings
from binder.webhooks import WebhookQueue, WebhookSender
from gateway.common import redis as redis_clients
from gateway.common.logs import configure_logging
from gateway.common.result_store import ResultStore
from gateway.common.retry import LoopHealth, supervise

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


def create_app(settings: BinderSettings | None = None) -> FastAPI:
    settings = settings or BinderSettings()
    configure_logging(settings.log_level, settings.log_format)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = redis_clients.connect(
            settings.redis_url, timeout_s=settings.redis_timeout_s, max_connections=64, blocking=True
        )
        timeout_ms = int(settings.mongo_timeout_s * 1000)
        mongo: AsyncMongoClient = AsyncMongoClient(
            settings.mongo_url, tz_aware=True, serverSelectionTimeoutMS=timeout_ms, connectTimeoutMS=timeout_ms
        )
        store = ResultStore(mongo, settings.mongo_db, settings.result_retention_s)
        await store.prepare()
        queue = WebhookQueue(redis)
        archiver = Archiver(redis, store, queue, settings)
        await archiver.prepare()
        index = VectorIndex(settings.faiss_dir)
        follower = IndexFollower(redis, index, store, snapshot_interval_s=settings.snapshot_interval_s)
        await follower.prepare()
        sender = WebhookSender(
            queue,
            store.set_webhook_status,
            secrets=settings.webhook_secrets,
            retry_delays=settings.retry_delays,
            jitter=settings.webhook_jitter,
            timeout_s=settings.webhook_timeout_s,
            concurrency=settings.webhook_concurrency,
            allowlist=settings.webhook_allowlist,
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
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await sender.close()
            await asyncio.to_thread(index.snapshot)
            await mongo.close()
            await redis.aclose()

    app = FastAPI(title="binder (internal)", lifespan=lifespan)

    @app.get("/healthz")
    async def healthz(request: Request) -> Any:
        """ok while no worker loop keeps failing; 503 (with the failing ones) otherwise."""
        parts = binder(request)
        failing = {h.name: h.last_error for h in parts.health if h.failing()}
        body = {
            "status": "failing" if failing else "ok",
            "stored": parts.archiver.stored_total,
            "index": {space: parts.index.ntotal(space) for space in parts.index.spaces},
            "last_applied": parts.index.last_id,
            "failing": failing,
        }
        return JSONResponse(body, status_code=503 if failing else 200)

    @app.post("/search")
    async def search(query: SearchQuery, request: Request) -> dict[str, Any]:
        index = binder(request).index
        try:
            hits = await asyncio.to_thread(index.search, query.space, query.vector, query.k)
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from None
        return {"hits": [{"request_id": rid, "score": score} for rid, score in hits]}

    @app.post("/webhooks/{request_id}/replay")
    async def replay(request_id: str, request: Request, body: ReplayQuery | None = None) -> dict[str, Any]:
        parts = binder(request)
        record = await parts.store.get(request_id, body.tenant if body else None)
        if record is None:
            raise HTTPException(404, f"no stored result {request_id}")
        if record.webhook is None:
            raise HTTPException(409, f"{request_id} has no webhook")
        created = await parts.queue.enqueue([record], replay=True)
        return {"request_id": request_id, "deliveries": created}

    @app.post("/dead-letters/replay")
    async def replay_dead_letters(request: Request) -> dict[str, Any]:
        """Requeue dead-lettered results (once what made them fail is fixed)."""
        return {"requeued": await binder(request).archiver.replay_dead_letters()}

    return app
