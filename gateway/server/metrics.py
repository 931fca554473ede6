"""Prometheus metrics of one gateway process (scrape each process's /metrics)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.protocol import ResultRecord

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
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

    # Per-model children, bound once: labels() looks its child up under a lock each call.

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def count_accepted(self, model: str, count: int = 1) -> None:
        self._child(self.accepted, model).inc(count)

    def count_queue_wait(self, model: str, seconds: float) -> None:
        self._child(self.queue_wait, model).observe(seconds)

    def count_finished(self, record: ResultRecord) -> None:
        self._child(self.finished, record.model, record.status.value).inc()
        if record.timings.total_ms is not None:
            self._child(self.latency, record.model).observe(record.timings.total_ms / 1000)
        if record.timings.ttft_ms is not None:
            self._child(self.ttft, record.model).observe(record.timings.ttft_ms / 1000)
