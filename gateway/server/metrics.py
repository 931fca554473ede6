"""Prometheus metrics of one gateway process (scrape each process's /metrics)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # HTTP, per route template (never the path: ids would make a series each).
        self.http_requests = Counter(
            "gateway_http_requests_total",
            "HTTP requests answered, by route template, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.http_latency = Histogram(
            "gateway_http_request_duration_seconds",
            "HTTP request to the end of its response (an SSE stream's whole life)",
            ["route", "method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.accepted = Counter("gateway_requests_accepted_total", "Requests accepted (202)", ["model"], registry=r)
        self.rejected = Counter(
            "gateway_requests_rejected_total", "Requests refused with a 4xx, by error code", ["code"], registry=r
        )
        self.finished = Counter(
            "gateway_requests_finished_total",
            "Requests that reached a terminal state here",
            ["model", "outcome"],
            registry=r,
        )
        self.backlog = Gauge("gateway_backlog", "Accepted requests not yet started (all gateways)", registry=r)
        self.inflight = Gauge(
            "gateway_replica_inflight", "Requests in flight per Triton replica", ["replica"], registry=r
        )
        self.replica_healthy = Gauge(
            "gateway_replica_healthy", "1 if the replica is in rotation", ["replica"], registry=r
        )
        self.latency = Histogram(
            "gateway_request_latency_seconds", "Accepted to terminal", ["model"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds", "Accepted to started", ["model"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "gateway_time_to_first_token_seconds",
            "Started to first response from Triton",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # Per tenant (the label is "-" when METRICS_TENANT_LABEL=false, for many tenants).
        self.tenant_requests = Counter(
            "gateway_tenant_requests_total",
            "Requests finished here, by tenant and outcome",
            ["tenant", "outcome"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "gateway_tenant_tokens_total",
            "Tokens of finished requests, by tenant and kind (prompt, completion)",
            ["tenant", "kind"],
            registry=r,
        )


UNMATCHED_ROUTE = "unmatched"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _templates(routes: Iterable[Any]) -> Iterator[tuple[re.Pattern[str], str]]:
    """(path regex, template) of every route, through FastAPI's included routers."""
    for route in routes:
        if hasattr(route, "effective_route_contexts"):  # an included router (FastAPI >= 0.16x)
            yield from _templates(route.effective_route_contexts())
        elif getattr(route, "path_regex", None) is not None and getattr(route, "path_format", None):
            yield route.path_regex, route.path_format


class HttpMetricsMiddleware:
    """Counts every HTTP request by route template, method and status, and times it."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics
        self._routes: list[tuple[re.Pattern[str], str]] | None = None

    def route_template(self, scope: Scope) -> str:
        """The template of the route that handled the request ("/results/{request_id}").
        A request refused before routing (413 on its Content-Length) is matched here; one
        that matches no route is "unmatched", so scanners cannot add series."""
        template = getattr(scope.get("route"), "path_format", None)
        if template:
            return template
        if self._routes is None:
            self._routes = list(_templates(getattr(scope.get("app"), "routes", ())))
        return next((t for regex, t in self._routes if regex.match(scope["path"])), UNMATCHED_ROUTE)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the client gets if the app raises before answering

        async def timed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            route = self.route_template(scope)
            method = scope["method"] if scope["method"] in _METHODS else "other"
            self.metrics.http_requests.labels(route, method, str(status)).inc()
            self.metrics.http_latency.labels(route, method).observe(time.perf_counter() - started)
