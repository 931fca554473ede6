"""The FastAPI application: wiring of Redis, MongoDB, the replica pool, the dispatcher
and the routes, with a lifespan that starts and drains them."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from pymongo import AsyncMongoClient
from redis.asyncio import Redis

from gateway.api import Services, router
from gateway.binder_client import BinderClient
from gateway.body_limit import BodyLimitMiddleware
from gateway.contracts import RESULTS_COLLECTION
from gateway.dispatcher import Dispatcher
from gateway.errors import install_error_handlers
from gateway.jobs import JobStore
from gateway.logs import configure_logging
from gateway.metrics import GatewayMetrics
from gateway.notifier import CompletionNotifier
from gateway.replicas import ReplicaPool
from gateway.results import ResultReader
from gateway.search import SearchService
from gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

DESCRIPTION = """
One front door for models served by NVIDIA Triton Inference Server.

`POST /infer` accepts a request at once (202 with its id) and never loses it. Get the
result by polling `GET /results/{id}`, long-polling `?wait=N`, Server-Sent Events at
`/results/{id}/events`, `Prefer: wait=N` on the submit, or a signed webhook.
Errors are JSON: `{"error": {"code", "message"}}` with a stable `code`.
"""


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    configure_logging(settings.log_level, settings.log_format)
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = Redis.from_url(settings.redis_url, decode_responses=True, health_check_interval=30)
        mongo: AsyncMongoClient = AsyncMongoClient(settings.mongo_url, tz_aware=True, serverSelectionTimeoutMS=5000)
        http = httpx.AsyncClient(timeout=10)
        jobs = JobStore(
            redis, events_maxlen=settings.events_maxlen, live_state_ttl_s=settings.live_state_ttl_s,
            idempotency_ttl_s=settings.idempotency_ttl_s,
        )
        pool = ReplicaPool(
            settings.triton_grpc_urls, max_inflight=settings.replica_max_inflight,
            probe_interval_s=settings.probe_interval_s, probe_timeout_s=settings.probe_timeout_s,
        )
        notifier = CompletionNotifier(redis)
        binders = BinderClient(settings.binder_urls, http)
        dispatcher = Dispatcher(redis, jobs, pool, settings, metrics, notifier)
        results = ResultReader(jobs, mongo[settings.mongo_db][RESULTS_COLLECTION], notifier, settings.result_retention_s)
        app.state.services = Services(
            settings=settings, redis=redis, jobs=jobs, pool=pool, dispatcher=dispatcher, results=results,
            search=SearchService(pool, results, binders), binders=binders, metrics=metrics,
        )
        await pool.start()
        await notifier.start()
        await dispatcher.start()
        log.info("gateway ready: replicas %s", settings.triton_grpc_urls)
        try:
            yield
        finally:
            await dispatcher.stop()
            await notifier.close()
            await pool.close()
            await http.aclose()
            await mongo.close()
            await redis.aclose()

    app = FastAPI(
        title="Triton serving gateway", version="0.1.0", description=DESCRIPTION, lifespan=lifespan,
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    install_error_handlers(app, on_reject=lambda code: metrics.rejected.labels(code).inc())
    app.include_router(router)
    return app
