"""The FastAPI application: wiring of Redis, MongoDB, the replica pool, the dispatcher and
the routes, with a lifespan that starts them and, on shutdown, drains and hands over."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Annotated, Any

import httpx
from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from pymongo import AsyncMongoClient

from gateway.common import counts
from gateway.common.logs import configure_logging
from gateway.common.redis import RedisClients
from gateway.common.result_store import ResultStore
from gateway.common.retry import LoopHealth, cancel_and_wait, supervise
from gateway.protocol import ResultRecord
from gateway.server.anthropic import messages as anthropic_messages
from gateway.server.anthropic.errors import anthropic_error
from gateway.server.api import admin, events, operations, results, search
from gateway.server.api.edge import Edge
from gateway.server.api.errors import ErrorRenderer, install_error_handlers
from gateway.server.api.hot import HotRoutes
from gateway.server.api.request_id import current_trace_id
from gateway.server.api.tenancy import Caller, caller
from gateway.server.dispatch.dispatcher import Dispatcher
from gateway.server.dispatch.runner import Runner
from gateway.server.dispatch.sweeper import Sweeper
from gateway.server.metrics import GatewayMetrics
from gateway.server.models import ModelRegistry
from gateway.server.models.embedding import EmbeddingAdapter
from gateway.server.models.inputs import limit_image_pixels
from gateway.server.models.tokenize_pool import limit_tokenizing
from gateway.server.openai import chat, embeddings
from gateway.server.openai.errors import openai_error
from gateway.server.openai.files import batches, files
from gateway.server.openai.files.batch_runner import BatchRunner
from gateway.server.openai.files.batch_store import BatchStore
from gateway.server.openai.files.files import UPLOAD_FRAMING, before_upload
from gateway.server.openai.files.store import FileStore
from gateway.server.openai.responses import compact as responses_compact
from gateway.server.openai.responses import conversations
from gateway.server.openai.responses import create as responses
from gateway.server.openai.responses import websocket as responses_ws
from gateway.server.queue.jobs import JobStore
from gateway.server.replicas import Replica, ReplicaPool
from gateway.server.replicas.discovery import replica_discovery
from gateway.server.results.events import EventHub
from gateway.server.results.notifier import CompletionNotifier
from gateway.server.results.reader import ResultReader
from gateway.server.routing.load import GatewayPresence, LoadTracker
from gateway.server.routing.prefix_index import PrefixIndex
from gateway.server.routing.router import Router, RoutingSettings
from gateway.server.search.binders import BinderClient
from gateway.server.search.service import SearchService
from gateway.server.services import Services
from gateway.server.settings import GatewaySettings
from gateway.server.spine import Submitter
from gateway.server.tenants.config import TenantLimits, TenantStore
from gateway.server.tenants.keys import KeyStore, announcer, follow_key_changes
from gateway.server.tenants.quotas import Quotas
from gateway.server.tenants.shares import share_of
from gateway.server.tenants.usage import UsageLedger
from gateway.server.ui import router as ui_router

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


def metrics_urls(settings: GatewaySettings) -> Callable[[str], str | None]:
    """Where a replica's Prometheus metrics are: TRITON_METRICS_URLS (one per gRPC URL),
    else the replica's host at TRITON_METRICS_PORT."""
    explicit = dict(zip(settings.triton_grpc_urls, settings.triton_metrics_urls, strict=False))

    def url(replica: str) -> str | None:
        if replica in explicit:
            return explicit[replica]
        host = replica.rsplit(":", 1)[0]
        return f"http://{host}:{settings.triton_metrics_port}/metrics"

    return url


def count_tenant(metrics: GatewayMetrics, settings: GatewaySettings, record: ResultRecord) -> None:
    tenant = record.tenant if settings.metrics_tenant_label else "-"
    metrics.tenant_requests.labels(tenant, record.status.value).inc()
    if record.usage is not None:
        metrics.tenant_tokens.labels(tenant, "prompt").inc(record.usage.prompt_tokens)
        metrics.tenant_tokens.labels(tenant, "completion").inc(record.usage.completion_tokens)


def token_counter(
    quotas: Quotas,
    tenants: TenantStore,
    background: Callable[[Coroutine[Any, Any, Any]], None],
    registry: ModelRegistry,
) -> Callable[[ResultRecord], None]:
    """A finished request settles its tenant's tokens per minute (only for tenants with such
    a limit): its completion tokens are charged (its prompt's were at admission), and where
    admission reserved an upper bound of the prompt instead of its count (an embedding model
    that counts its texts' tokens itself: EmbeddingAdapter.reserved_tokens) what the usage,
    the model's count, left of it is given back, so the window holds the model's count.
    Batch lines were not charged at admission (their records carry their batch_id): nothing
    of theirs is given back."""

    def count(record: ResultRecord) -> None:
        config = tenants.cached(record.tenant)
        limited = config is None or config.effective.tokens_per_minute
        if record.usage is None or not limited:
            return
        owed = record.usage.completion_tokens - unused(record, record.usage.prompt_tokens)
        if owed:
            background(charge(record.tenant, owed))

    def unused(record: ResultRecord, prompt_tokens: int) -> int:
        adapter = registry.adapters.get(record.model)
        if not isinstance(adapter, EmbeddingAdapter) or "batch_id" in record.metadata:
            return 0
        reserved = adapter.reserved_tokens(record.inputs)
        return max(0, reserved - prompt_tokens) if reserved is not None else 0

    async def charge(tenant: str, tokens: int) -> None:
        try:
            config = await tenants.get(tenant)
            if tokens > 0:
                await quotas.used_tokens(config, tokens)
            else:
                await quotas.unreserve(config, -tokens)
        except Exception as exc:  # the limit lags a little; the request is done
            log.warning("settling %d tokens of %s failed: %s", tokens, tenant, exc)

    return count


def add_private_docs(app: FastAPI, docs_ui: bool) -> None:
    """/openapi.json, and /docs with DOCS_UI, for callers with a key (PUBLIC_DOCS=false)."""

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(who: Annotated[Caller, Depends(caller)]) -> JSONResponse:
        return JSONResponse(app.openapi())

    if not docs_ui:
        return

    @app.get("/docs", include_in_schema=False)
    async def docs(who: Annotated[Caller, Depends(caller)]) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)


def keep_collector_off_the_hot_path(young_threshold: int) -> None:
    """Once started: what exists now (modules, the app, its clients) lives as long as the
    process, so it leaves the collector's view (gc.freeze), and the youngest generation is
    collected after `young_threshold` objects rather than 700. A full collection walked
    every object of the process: ~90 ms a time, a stall every few seconds at load; and the
    objects of the requests in flight crossed 700 every few requests."""
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young_threshold, middle, old)


def create_app(settings: GatewaySettings | None = None) -> Edge:
    settings = settings or GatewaySettings()
    configure_logging(settings.log_level, settings.log_format)
    limit_image_pixels(settings.max_image_pixels)
    limit_tokenizing(settings.tokenize_threads, settings.tokenize_queue, settings.tenant_tokenize_share)
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.request_counts:  # debug: each request's counts (gateway/common/counts.py)
            counts.enable(asyncio.get_running_loop())
        clients = RedisClients.open(
            url=settings.redis_url,
            cluster_nodes=settings.redis_cluster_nodes,
            timeout_s=settings.redis_timeout_s,
            max_connections=settings.redis_max_connections,
            wait_replicas=settings.redis_wait_replicas,
            wait_timeout_ms=settings.redis_wait_timeout_ms,
            group_commit=settings.redis_group_commit,
        )
        redis = clients.main
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
        for name in sorted(n for n, a in registry.adapters.items() if a.shared_prefix_cache):
            log.warning(
                "model %s shares one prefix cache among tenants (its engine takes no cache salt): how soon "
                "a reply starts tells whether another tenant sent the same prefix; its records carry no "
                "time to first token. Salt its engine (cache_salt) or turn KV cache reuse off.",
                name,
            )
        jobs = JobStore(
            redis,
            shards=settings.redis_shards,
            idempotency_ttl_s=settings.idempotency_ttl_s,
            lease_ms=settings.claim_idle_ms,
            replication=clients,
        )
        pool = ReplicaPool(
            # With DNS discovery the replicas come from the name alone.
            [] if settings.triton_dns_name else settings.triton_grpc_urls,
            max_inflight=settings.replica_max_inflight,
            probe_interval_s=settings.probe_interval_s,
            probe_timeout_s=settings.probe_timeout_s,
        )
        notifier = CompletionNotifier(clients)
        hub = EventHub(
            clients.unblocker(),
            clients.reader,
            lambda request_id, entry: reader.record_json(request_id, entry),
            jobs.follow,
            max_followers=settings.max_followers,
            tenant_share=share_of(
                settings.max_followers, settings.tenant_follower_share, settings.tenant_follower_floor
            ),
        )
        binder_key = settings.binder_api_key.get_secret_value() if settings.binder_api_key else None
        binders = BinderClient(settings.binder_urls, http, partitions=settings.index_partitions, api_key=binder_key)
        side_tasks: set[asyncio.Task[None]] = set()

        def background(coroutine: Coroutine[Any, Any, Any]) -> None:
            task = asyncio.ensure_future(coroutine)
            side_tasks.add(task)
            task.add_done_callback(side_tasks.discard)

        index = PrefixIndex(redis, ttl_s=settings.prefix_ttl_s)
        consumer = consumer_name()
        loads = LoadTracker(
            pool,
            metrics_urls(settings),
            interval_s=settings.load_scrape_s,
            on_reset=index.forget,
            presence=GatewayPresence(redis, consumer),
        )

        def forget_restarted(replica: Replica) -> None:
            if replica.generation > 1:  # back after being out: its KV cache may be empty
                background(index.forget(replica.url))

        pool.on_admitted.append(forget_restarted)
        routing = RoutingSettings(
            policy=settings.llm_routing,
            prefill_weight=settings.route_prefill_weight,
            decode_weight=settings.route_decode_weight,
            balance_abs=settings.route_balance_abs,
            balance_rel=settings.route_balance_rel,
        )
        router = Router(pool, index, loads, routing, metrics.registry)
        runner = Runner(registry, pool, jobs, settings, background, router)
        defaults = TenantLimits(
            requests_per_minute=settings.tenant_requests_per_minute,
            tokens_per_minute=settings.tenant_tokens_per_minute,
            max_concurrent=settings.tenant_max_concurrent,
            max_queued=settings.tenant_max_queued,
        )
        tenants = TenantStore(mongo, settings.mongo_db, defaults)
        quotas = Quotas(
            settings.redis_url, settings.redis_cluster_nodes, clients.group, timeout_s=settings.redis_timeout_s
        )
        usage = UsageLedger(redis)
        dispatcher = Dispatcher(
            redis=clients,
            consumer=consumer,
            jobs=jobs,
            pool=pool,
            registry=registry,
            runner=runner,
            settings=settings,
            metrics=metrics,
            notifier=notifier,
        )
        pool.on_admitted.append(lambda replica: dispatcher.wake())
        dispatcher.finished_hooks.append(usage.add)
        dispatcher.finished_hooks.append(lambda record: count_tenant(metrics, settings, record))
        dispatcher.finished_hooks.append(token_counter(quotas, tenants, background, registry))
        sweeper = Sweeper(jobs, pool, settings, metrics)
        submitter = Submitter(settings, registry, jobs, quotas, dispatcher, metrics, trace_id=current_trace_id)
        reader = ResultReader(jobs, store, notifier, settings.result_retention_s)
        app.state.services = Services(
            settings=settings,
            redis=redis,
            jobs=jobs,
            store=store,
            pool=pool,
            registry=registry,
            dispatcher=dispatcher,
            submitter=submitter,
            results=reader,
            events=hub,
            search=SearchService(
                registry,
                pool,
                reader,
                binders,
                quotas=quotas,
                usage=usage,
                tenant_concurrency=settings.tenant_search_concurrency,
            ),
            binders=binders,
            metrics=metrics,
            keys=KeyStore(mongo, settings.mongo_db, cache_s=settings.key_cache_s, announce=announcer(clients)),
            tenants=tenants,
            quotas=quotas,
            usage=usage,
            files=FileStore(mongo, settings.mongo_db, settings.file_retention_s),
            batches=BatchStore(mongo, settings.mongo_db),
        )
        svc = app.state.services
        svc.batch_runner = BatchRunner(svc, svc.batches)
        await pool.start()
        discovery = replica_discovery(settings, pool, metrics)  # None: static TRITON_GRPC_URLS
        if discovery is not None:
            await discovery.start()
        await loads.start()
        await notifier.start()
        await hub.start()
        await dispatcher.start()
        loops = [
            asyncio.create_task(supervise(LoopHealth(name), run), name=name)
            for name, run in (
                ("sweeper", sweeper.run),
                ("batches", svc.batch_runner.run),
                ("expired files", lambda: svc.files.sweep_forever(settings.file_sweep_interval_s)),
                ("key changes", lambda: follow_key_changes(svc.keys, clients)),
                ("usage", usage.run),
            )
        ]
        log.info("gateway ready: %d replicas, models %s", len(pool.replicas), registry.names)
        if settings.gc_young_threshold > 0:
            keep_collector_off_the_hot_path(settings.gc_young_threshold)
        try:
            yield
        finally:
            log.info("gateway stopping: draining running requests (up to %.0fs)", settings.drain_s)
            await cancel_and_wait(loops)
            await svc.batch_runner.close()
            await dispatcher.stop()
            try:
                await usage.flush()
            except Exception as exc:
                log.warning("the last usage counts were not written: %s", exc)
            await hub.close()
            await notifier.close()
            await loads.close()
            await cancel_and_wait(list(side_tasks))
            if discovery is not None:
                await discovery.stop()
            await pool.close()
            await http.aclose()
            await mongo.close()
            await clients.aclose()

    private_docs = not settings.public_docs
    app = FastAPI(
        title="Triton serving gateway",
        version="0.2.0",
        description=DESCRIPTION,
        lifespan=lifespan,
        # The docs pages load CDN scripts: only with DOCS_UI (settings.docs_ui says why).
        docs_url="/docs" if settings.docs_ui and not private_docs else None,
        redoc_url="/redoc" if settings.docs_ui and not private_docs else None,
        openapi_url=None if private_docs else "/openapi.json",
        # The one form route (POST /v1/files) takes one file and a few fields: each part
        # a parser keeps (a field whole, a file past 1 MiB spooled to disk) is bounded.
        form_limits={"max_files": 1, "max_fields": 8, "max_part_size": 64 * 1024},
    )
    errors = ErrorRenderer(
        on_reject=lambda code: metrics.rejected.labels(code).inc(),
        retry_after_s=settings.retry_after_s,
        # OpenAI's error body under /v1, Anthropic's under its Messages API.
        renderers={"/v1/": openai_error, "/v1/messages": anthropic_error},
    )
    install_error_handlers(app, errors)
    # POST /infer and GET /results/<id>: implemented once (gateway.server.api.hot), served by
    # the edge before FastAPI's routing; declared here first, for the OpenAPI document (in
    # their place) and the router's 405s and redirects.
    hot = HotRoutes(lambda: app.state.services, errors)
    hot.declare(app)
    modules = (results, events, search, operations, admin, chat, embeddings, responses, responses_compact, responses_ws)
    for module in (*modules, files, batches):
        app.include_router(module.router)
    app.include_router(conversations.router)
    app.include_router(anthropic_messages.router)
    app.include_router(ui_router)  # the browser page at /ui (its API calls need a key; the page does not)
    if private_docs:
        add_private_docs(app, settings.docs_ui)
    # Every call crosses one middleware: ids, limits, metrics, the caller's headers, and
    # the hot routes served without FastAPI's routing (gateway.server.api.edge).
    return Edge(
        app,
        metrics=metrics,
        errors=errors,
        max_bytes=settings.max_body_bytes,
        body_timeout_s=settings.body_timeout_s,
        # An upload's multipart framing adds a little to the file itself; its quota is checked
        # before its body is read.
        uploads={"/v1/files": (settings.max_file_bytes + UPLOAD_FRAMING, max(settings.body_timeout_s, 600.0))},
        before_body={"/v1/files": before_upload},
        hot=hot,
        long_polls=lambda: app.state.services.events.long_polls,
    )
