"""The binder process: the result worker, the index follower and the webhook sender,
plus a small internal HTTP API for the gateways (search, webhook replay, health)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, Field
from pymongo import AsyncMongoClient
from redis.asyncio import Redis

from binder.indexer import IndexFollower
from binder.store import ResultStore
from binder.vectors import VectorIndex
from binder.webhooks import WebhookQueue, WebhookSender
from binder.worker import ResultWorker
from gateway.contracts import record_from_document
from gateway.logs import configure_logging
from gateway.settings import BinderSettings

log = logging.getLogger(__name__)


class SearchQuery(BaseModel):
    space: str
    vector: list[float] = Field(min_length=1)
    k: int = Field(default=5, ge=1, le=1000)


def create_app(settings: BinderSettings | None = None) -> FastAPI:
    settings = settings or BinderSettings()
    configure_logging(settings.log_level, settings.log_format)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = Redis.from_url(settings.redis_url, decode_responses=True, health_check_interval=30)
        mongo: AsyncMongoClient = AsyncMongoClient(settings.mongo_url, tz_aware=True, serverSelectionTimeoutMS=5000)
        store = ResultStore(mongo, settings.mongo_db, settings.result_retention_s)
        await store.prepare()
        queue = WebhookQueue(redis)
        worker = ResultWorker(redis, store, queue, settings)
        await worker.prepare()
        index = VectorIndex(settings.faiss_dir)
        follower = IndexFollower(redis, index, store, snapshot_interval_s=settings.snapshot_interval_s)
        await follower.prepare()
        sender = WebhookSender(
            queue, store.set_webhook_status, secrets=settings.webhook_secrets, retry_delays=settings.retry_delays,
            jitter=settings.webhook_jitter, timeout_s=settings.webhook_timeout_s,
            concurrency=settings.webhook_concurrency, allowlist=settings.webhook_allowlist,
        )
        app.state.binder = {"store": store, "queue": queue, "worker": worker, "index": index, "follower": follower}
        tasks = [
            asyncio.create_task(_forever(worker.run, "result worker"), name="result-worker"),
            asyncio.create_task(_forever(follower.run, "index follower"), name="index-follower"),
            asyncio.create_task(_forever(sender.run, "webhook sender"), name="webhook-sender"),
        ]
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
    async def healthz(request: Request) -> dict[str, Any]:
        parts = request.app.state.binder
        index: VectorIndex = parts["index"]
        return {
            "status": "ok",
            "stored": parts["worker"].stored_total,
            "index": {space: index.ntotal(space) for space in index.spaces},
            "last_applied": index.last_id,
        }

    @app.post("/search")
    async def search(query: SearchQuery, request: Request) -> dict[str, Any]:
        index: VectorIndex = request.app.state.binder["index"]
        try:
            hits = await asyncio.to_thread(index.search, query.space, query.vector, query.k)
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from None
        return {"hits": [{"request_id": rid, "score": score} for rid, score in hits]}

    @app.post("/webhooks/{request_id}/replay")
    async def replay(request_id: str, request: Request) -> dict[str, Any]:
        parts = request.app.state.binder
        document = await parts["store"].collection.find_one({"_id": request_id})
        if document is None:
            raise HTTPException(404, f"no stored result {request_id}")
        record = record_from_document(document)
        if record.webhook is None:
            raise HTTPException(409, f"{request_id} has no webhook")
        created = await parts["queue"].enqueue([record], replay=True)
        return {"request_id": request_id, "deliveries": created}

    return app


async def _forever(run: Any, what: str) -> None:
    """Keep a loop alive through transient failures (Redis or MongoDB restarting)."""
    while True:
        try:
            await run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s failed; restarting in 1 s", what)
            await asyncio.sleep(1)
