"""The FastAPI application: wiring of Redis, MongoDB, the replica pool, the dispatcher and
the routes, with a lifespan that starts them and, on shutdown, drains and hands over."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI
from pymongo import AsyncMongoClient

from gateway.common import redis as redis_clients
from gateway.common.logs import configure_logging
from gateway.common.result_store import ResultStore
from gateway.common.retry import LoopHealth, supervise
from gateway.common.streams import StreamConsumer
from gateway.protocol.redis_keys import DISPATCH_GROUP, QUEUE_DEAD_LETTERS
from gateway.server.api import events, operations, results, search, submit
from gateway.server.api.errors import install_error_handlers
from gateway.server.api.limits import RequestLimitsMiddleware
from gateway.server.dispatch.dispatcher import Dispatcher
from gateway.server.dispatch.runner import Runner
from gateway.server.dispatch.sweeper import Sweeper
from gateway.server.metrics import GatewayMetrics
from gateway.server.models import ModelRegistry
from gateway.server.queue.jobs import JobStore
from gateway.server.replicas import ReplicaPool
from gateway.server.results.events import EventHub
from gateway.server.results.notifier import CompletionNotifier
from gateway.server.results.reader import ResultReader
from gateway.server.search.binders import BinderClient
from gateway.server.search.service import SearchService
from gateway.server.services import Services
from gateway.server.settings import GatewaySettings

log = logging.getLogger(__name__)

DESCRIPTION = """
One front door for models served by NVIDIA Triton Inference Server.

`POST /infer` accepts a request at once (202 with its id) and never loses it. Get the
result by polling `GET /results/{id}`, long-polling `?wait=N`, Server-Sent Events at
`/results/{id}/events`, `Prefer: wait=N` on the submit, or a signed webhook.
Errors are JSON: `{"error": {"code", "message"}}` with a stable `code`.
"""


def consumer_name() -> str:
    return f"gw-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    configure_logging(settings.log_level, settings.log_format)
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = redis_clients.connect(
            settings.redis_url, timeout_s=settings.redis_timeout_s, max_connections=settings.redis_max_connections
        )
        blocking = redis_clients.connect(
            settings.redis_url, timeout_s=settings.redis_timeout_s, max_connections=8, blocking=True
        )
        timeout_ms = int(settings.mongo_timeout_s * 1000)
        mongo: AsyncMongoClient = AsyncMongoClient(
            settings.mongo_url,
            tz_aware=True,
            serverSelectionTimeoutMS=timeout_ms,
            connectTimeoutMS=timeout_ms,
            socketTimeoutMS=timeout_ms * 2,
        )
        store = ResultStore(mongo, settings.mongo_db, settings.result_retention_s)
        http = httpx.AsyncClient(timeout=10)
        registry = ModelRegistry.from_file(settings.models_file)
        jobs = JobStore(redis, live_state_ttl_s=settings.live_state_ttl_s, idempotency_ttl_s=settings.idempotency_ttl_s)
        pool = ReplicaPool(
            settings.triton_grpc_urls,
            max_inflight=settings.replica_max_inflight,
            probe_interval_s=settings.probe_interval_s,
            probe_timeout_s=settings.probe_timeout_s,
        )
        notifier = CompletionNotifier(redis)
        hub = EventHub(redis, blocking)
        binders = BinderClient(settings.binder_urls, http)
        consumer = StreamConsumer(
            redis,
            DISPATCH_GROUP,
            consumer_name(),
            QUEUE_DEAD_LETTERS,
            claim_idle_ms=settings.claim_idle_ms,
            max_deliveries=settings.max_deliveries + 2,
        )
        side_tasks: set[asyncio.Task[None]] = set()

        def background(coroutine: Coroutine[Any, Any, Any]) -> None:
            task = asyncio.ensure_future(coroutine)
            side_tasks.add(task)
            task.add_done_callback(side_tasks.discard)

        runner = Runner(registry, pool, jobs, settings, background)
        dispatcher = Dispatcher(
            redis=redis,
            blocking=blocking,
            consumer=consumer,
            jobs=jobs,
            pool=pool,
            registry=registry,
            runner=runner,
            settings=settings,
            metrics=metrics,
            notifier=notifier,
        )
        sweeper = Sweeper(redis, jobs, consumer, dispatcher.queues, pool, settings, metrics, dispatcher.count)
        reader = ResultReader(jobs, store, notifier, settings.result_retention_s)
        app.state.services = Services(
            settings=settings,
            redis=redis,
            jobs=jobs,
            store=store,
            pool=pool,
            registry=registry,
            dispatcher=dispatcher,
            results=reader,
            events=hub,
            search=SearchService(registry, pool, reader, binders),
            binders=binders,
            metrics=metrics,
        )
        await pool.start()
        await notifier.start()
        await hub.start()
        await dispatcher.start()
        sweep_health = LoopHealth("sweeper")
        sweep_task = asyncio.create_task(supervise(sweep_health, sweeper.run), name="sweeper")
        log.info("gateway ready: %d replicas, models %s", len(settings.triton_grpc_urls), registry.names)
        try:
            yield
        finally:
            log.info("gateway stopping: draining running requests (up to %.0fs)", settings.drain_s)
            sweep_task.cancel()
            await asyncio.gather(sweep_task, return_exceptions=True)
            await dispatcher.stop()
            await hub.close()
            await notifier.close()
            for task in list(side_tasks):
                task.cancel()
            await asyncio.gather(*side_tasks, return_exceptions=True)
            await pool.close()
            await http.aclose()
            await mongo.close()
            await redis.aclose()
            await blocking.aclose()

    app = FastAPI(title="Triton serving gateway", version="0.2.0", description=DESCRIPTION, lifespan=lifespan)
    app.add_middleware(
        RequestLimitsMiddleware, max_bytes=settings.max_body_bytes, body_timeout_s=settings.body_timeout_s
    )
    install_error_handlers(
        app, on_reject=lambda code: metrics.rejected.labels(code).inc(), retry_after_s=settings.retry_after_s
    )
    for module in (submit, results, events, search, operations):
        app.include_router(module.router)
    return app
