"""The parts of a running gateway, built once by the app's lifespan and handed to the
routes (request.app.state.services)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from fastapi import Request
from redis.asyncio import Redis

from gateway.common.result_store import ResultStore
from gateway.server.dispatch.dispatcher import Dispatcher
from gateway.server.metrics import GatewayMetrics
from gateway.server.models import ModelRegistry
from gateway.server.queue.jobs import JobStore
from gateway.server.replicas import ReplicaPool
from gateway.server.results.events import EventHub
from gateway.server.results.reader import ResultReader
from gateway.server.search.binders import BinderClient
from gateway.server.search.service import SearchService
from gateway.server.settings import GatewaySettings
from gateway.server.spine import Submitter
from gateway.server.tenants.config import TenantStore
from gateway.server.tenants.keys import KeyStore
from gateway.server.tenants.quotas import Quotas
from gateway.server.tenants.usage import UsageLedger

if TYPE_CHECKING:
    # (Below the /v1 routes: these store modules import neither this module nor the routes.)
    from gateway.server.openai.files.batch_store import BatchStore
    from gateway.server.openai.files.store import FileStore


class BatchWork(Protocol):
    """What the routes and the lifespan ask of the batch runner
    (gateway.server.openai.files.batch_runner.BatchRunner). It is built from the Services it
    belongs to, so it is named here by what it does, not by its class."""

    def notice(self) -> None: ...

    async def run(self) -> None: ...

    async def close(self) -> None: ...


@dataclass
class Services:
    settings: GatewaySettings
    redis: Redis
    jobs: JobStore
    store: ResultStore
    pool: ReplicaPool
    registry: ModelRegistry
    dispatcher: Dispatcher
    submitter: Submitter
    results: ResultReader
    events: EventHub
    search: SearchService
    binders: BinderClient
    metrics: GatewayMetrics
    keys: KeyStore
    tenants: TenantStore
    quotas: Quotas
    usage: UsageLedger
    files: FileStore
    batches: BatchStore
    batch_runner: BatchWork = field(init=False)  # needs the Services it belongs to


def services(request: Request) -> Services:
    return request.app.state.services
