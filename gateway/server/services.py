"""The parts of a running gateway, built once by the app's lifespan and handed to the
routes (request.app.state.services)."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class Services:
    settings: GatewaySettings
    redis: Redis
    jobs: JobStore
    store: ResultStore
    pool: ReplicaPool
    registry: ModelRegistry
    dispatcher: Dispatcher
    results: ResultReader
    events: EventHub
    search: SearchService
    binders: BinderClient
    metrics: GatewayMetrics


def services(request: Request) -> Services:
    return request.app.state.services
