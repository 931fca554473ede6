"""The gateway's settings (environment variables, see gateway.common.settings)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import Field, SecretStr, field_validator, model_validator

from gateway.common.settings import CommaList, ServiceSettings, is_loopback
from gateway.protocol.webhook_secrets import secrets_problem


class GatewaySettings(ServiceSettings):
    host: str = "127.0.0.1"
    port: int = 8080
    # Triton replicas, gRPC host:port each.
    triton_grpc_urls: CommaList = ["127.0.0.1:8001"]
    # Internal search endpoints of the binders (each holds a full copy of the index).
    binder_urls: CommaList = ["http://127.0.0.1:8090"]
    # The binders' BINDER_API_KEY, sent as `Authorization: Bearer` on every call to them.
    binder_api_key: SecretStr | None = None
    # The model registry (TOML); empty: the local profile's models.
    models_file: Path | None = None

    # -- HTTP -----------------------------------------------------------------------------
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    # A compressed body (Content-Encoding gzip, zstd) may decompress to this many times
    # what was received, once past its first MiB (413 compression_ratio_too_high beyond),
    # in at most this many gzip members or zstd frames (400 too_many_compressed_frames).
    max_compression_ratio: float = Field(default=20.0, ge=1)
    max_compressed_frames: int = Field(default=4, ge=1)
    # JSON values ([, {, "," and ":" counted as the body arrives, strings' own included) a
    # JSON body may hold (413 too_many_json_values beyond): parsing costs ~0.3 µs a value
    # on the loop, and no thread helps (json.loads holds the GIL).
    max_json_values: int = Field(default=200_000, ge=1)
    # HTTP requests one process has begun and not yet started answering, health and
    # metrics aside (503 overloaded, with Retry-After, at once beyond; 0: no limit). A
    # stream counts until its headers go out, a long poll until it answers.
    max_inflight_requests: int = Field(default=4096, ge=0)
    # How far behind its event loop may run (the loop probe's smoothed wall-clock
    # lateness: its own work or CPU the OS gives others) before the process sheds new
    # requests as it does past MAX_INFLIGHT_REQUESTS (0: never): a process that far
    # behind cannot serve more, and a refusal costs it a fraction of a served request.
    max_loop_lag_s: float = Field(default=1.0, ge=0)
    # Pixels an image input may declare (width x height, read from its header before
    # anything decodes it): more is 422 image_too_large.
    max_image_pixels: int = Field(default=50_000_000, gt=0)
    # A client must send its request headers, and then its body, within these.
    header_timeout_s: float = Field(default=10.0, gt=0)
    # The request line and headers together (431 beyond).
    max_header_bytes: int = Field(default=32 * 1024, ge=1024)
    body_timeout_s: float = Field(default=30.0, gt=0)
    keep_alive_s: float = Field(default=5.0, gt=0)
    retry_after_s: int = Field(default=1, ge=1)
    default_timeout_s: float = Field(default=300.0, gt=0)
    max_timeout_s: float = Field(default=3600.0, gt=0)
    # Upper bound for `Prefer: wait=N` and `?wait=N`.
    max_wait_s: float = Field(default=60.0, gt=0)
    idempotency_ttl_s: int = Field(default=24 * 3600, gt=0)
    sse_ping_s: float = Field(default=15.0, gt=0)
    # Event streams (SSE, /v1 streams) and long polls one process holds at once (503
    # too_many_streams beyond), and one tenant's share of them: the fraction, at least the
    # floor (429 tenant_share_exceeded beyond; gateway.server.tenants.shares).
    max_followers: int = Field(default=10_000, ge=1)
    tenant_follower_share: float = Field(default=0.25, gt=0, le=1)
    tenant_follower_floor: int = Field(default=16, ge=1)
    # Searches (POST /search) one tenant runs at once in a process (429
    # tenant_share_exceeded beyond); each is also a request of its requests per minute.
    tenant_search_concurrency: int = Field(default=4, ge=1)
    # Long inputs' validation and tokenization (over 8,192 characters of text): threads of
    # their own, jobs waiting for one (503 tokenizer_busy beyond), and one tenant's share of
    # the two together, at least one (429 tenant_share_exceeded beyond;
    # gateway.server.models.tokenize_pool). 128 waiting, so a tenant's share (33) holds
    # 16 concurrent 256-input embeddings calls, which the H200 bench saw refused at 32.
    tokenize_threads: int = Field(default=2, ge=1)
    tokenize_queue: int = Field(default=128, ge=0)
    tenant_tokenize_share: float = Field(default=0.25, gt=0, le=1)

    # -- Files and batches (OpenAI's Files and Batch APIs) -----------------------------
    # An uploaded file (POST /v1/files; the only route allowed a body this large).
    max_file_bytes: int = Field(default=200 * 1024 * 1024, gt=0)
    # How long a file is kept (an upload without expires_after, a batch's output and error
    # files; OpenAI's longest expires_after), and how often each gateway removes the
    # expired ones from GridFS.
    file_retention_s: int = Field(default=30 * 24 * 3600, ge=60)
    file_sweep_interval_s: float = Field(default=60.0, gt=0)
    batch_max_lines: int = Field(default=50_000, ge=1)
    # Lines of one batch queued or running at once: the rest wait in MongoDB, so a large
    # batch neither fills the backlog nor waits out its requests' deadlines in the queue.
    batch_window: int = Field(default=256, ge=1)
    # A gateway drives a batch while it holds its lease; a lease not renewed (the gateway
    # died) lets another gateway take the batch over.
    batch_lease_s: float = Field(default=15.0, gt=0)
    batch_poll_s: float = Field(default=0.5, gt=0)
    batch_concurrency: int = Field(default=4, ge=1)
    # A batch line longer than this (bytes, as in the file) is a failed line
    # (`line_too_large`), never stored: the same bound as a request's body.
    batch_max_line_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    # A batch whose validation was started this often without ending (its runner died or
    # lost the lease each time) fails (`validation_failed`) instead of starting again.
    batch_max_validations: int = Field(default=3, ge=1)
    # A runner drives one batch this long at a turn, then hands it back and claims again,
    # the tenant served least recently first: one tenant's many batches never hold every
    # runner while another tenant's wait.
    batch_turn_s: float = Field(default=5.0, gt=0)

    # -- What a tenant may store (0: no limit) ------------------------------------------
    # Files (uploads and batch outputs alike count; only an upload is refused, 403).
    tenant_max_files: int = Field(default=1000, ge=0)
    tenant_max_file_bytes: int = Field(default=20 * 1024**3, ge=0)
    # Batches not ended yet (429 beyond: one ends, another may start), and their lines
    # together (a batch over it fails at validation, `batch_lines_quota_exceeded`).
    tenant_max_active_batches: int = Field(default=100, ge=0)
    tenant_max_batch_lines: int = Field(default=500_000, ge=0)
    # API keys not revoked (403 beyond).
    tenant_max_keys: int = Field(default=100, ge=0)
    # Conversations (/v1/conversations): the items one holds and their bytes (JSON; a
    # response made in it counts its input items and one item for its output), 400
    # conversation_items_limit / conversation_bytes_limit beyond. A response in a
    # conversation is refused (conversation_bytes_limit) when everything it would be given
    # (outputs included) comes to more than the bytes limit.
    conversation_max_items: int = Field(default=1000, ge=0)
    conversation_max_bytes: int = Field(default=8 * 1024 * 1024, ge=0)
    # Conversations a tenant keeps (not expired; 403 conversation_count_quota_exceeded on a
    # create beyond; 0: no limit). Creating or updating one counts as a request per minute.
    tenant_max_conversations: int = Field(default=10_000, ge=0)
    # A previous_response_id chain: the responses it holds and the bytes of their items
    # (400 response_chain_too_long / response_chain_too_large beyond).
    response_chain_max: int = Field(default=100, ge=1)
    response_chain_max_bytes: int = Field(default=8 * 1024 * 1024, ge=1)
    # A Responses WebSocket (GET /v1/responses upgraded) is closed after this long (OpenAI's
    # 60 minutes): websocket_connection_limit_reached, once its response in flight has ended.
    responses_ws_max_s: float = Field(default=3600.0, gt=0)
    # ... and closed (1000, after a websocket_idle_timeout error event) once this long has
    # passed with no client message and no response in flight.
    responses_ws_idle_s: float = Field(default=300.0, gt=0)
    # Responses WebSockets one process holds open at once (503 too_many_websockets on the
    # upgrade beyond) and one tenant's share of them: the fraction, at least the floor (429
    # tenant_share_exceeded on the upgrade beyond). A message is at most MAX_BODY_BYTES
    # (closed 1009 beyond) and never deflated (gateway.server.serve).
    responses_ws_max: int = Field(default=1000, ge=1)
    responses_ws_tenant_share: float = Field(default=0.25, gt=0, le=1)
    responses_ws_tenant_floor: int = Field(default=16, ge=1)

    # -- Tenants --------------------------------------------------------------------------
    # Every call but /healthz and /readyz needs `Authorization: Bearer <API key>`. false:
    # every caller is an operator, so only with HOST on loopback (refused otherwise).
    auth_enabled: bool = True
    public_metrics: bool = True
    public_docs: bool = True
    # Swagger UI (/docs) and ReDoc (/redoc) load their scripts from a CDN, unpinned, on the
    # origin where /ui keeps the API key in the browser: off unless DOCS_UI=true (a trusted
    # network). /openapi.json is served either way (PUBLIC_DOCS).
    docs_ui: bool = False
    key_cache_s: float = Field(default=10.0, ge=0)
    # Limits of a tenant that has no `tenants` document of its own (0: no limit).
    tenant_requests_per_minute: int = Field(default=0, ge=0)
    tenant_tokens_per_minute: int = Field(default=0, ge=0)
    tenant_max_concurrent: int = Field(default=0, ge=0)
    tenant_max_queued: int = Field(default=0, ge=0)
    # Label per-tenant metrics with the tenant's name. Off by default: names of tenants are
    # not for a public /metrics, and many tenants make many series. On only with
    # PUBLIC_METRICS=false (then /metrics needs a key).
    metrics_tenant_label: bool = False
    # The binder's WEBHOOK_SECRETS (the same value): the gateway derives from them the
    # webhook secret it shows a tenant's admin (GET /admin/tenants/<t>/webhook-secret).
    webhook_secrets: CommaList = []

    # -- Admission ---------------------------------------------------------------------
    # Interactive requests waiting (not started), and payload bytes of all waiting
    # requests, beyond which a submission answers 429 backlog_full (split evenly between
    # the Redis shards).
    max_backlog: int = Field(default=1000, ge=1)
    max_backlog_bytes: int = Field(default=512 * 1024 * 1024, ge=1)
    # The batch band (Batch API lines) has its own budget: batches never fill the
    # interactive backlog.
    max_batch_backlog: int = Field(default=2000, ge=1)
    # A tenant without its own max_queued may hold this share of a backlog...
    tenant_backlog_share: float = Field(default=0.25, gt=0, le=1)
    # ... and is admitted below this many waiting requests even when the backlog is full,
    # so no other tenant's flood or batch can make it wait for a 429.
    tenant_backlog_reserve: int = Field(default=16, ge=0)
    # ... and below this many bytes of them (payloads as stored), the same for bytes: the
    # share (tenant_backlog_share of max_backlog_bytes) binds while others wait.
    tenant_backlog_reserve_bytes: int = Field(default=16 * 1024 * 1024, ge=0)

    # -- Replica pool -----------------------------------------------------------------------
    # Requests one process keeps in flight on one replica, per model (each model of a
    # Triton has its own instances and queue: one model's backlog never takes another's slots).
    replica_max_inflight: int = Field(default=32, ge=1)
    # Embedding requests of one model share Triton calls: at most this many calls of a model
    # in flight on a replica, what is ready meanwhile going in the next one (up to the
    # model's max_batch_size). 0: every request a call of its own.
    triton_batch_calls: int = Field(default=8, ge=0)
    probe_interval_s: float = Field(default=1.0, gt=0)
    probe_timeout_s: float = Field(default=2.0, gt=0)
    # A request that fails on a replica is tried again (elsewhere if possible) this often.
    max_retries: int = Field(default=3, ge=0)
    # DNS discovery (Kubernetes: a headless Service, e.g. "triton-headless" or
    # "triton-headless.<ns>.svc.cluster.local"): every address of this name is a replica's
    # gRPC endpoint at TRITON_DNS_PORT, re-resolved every DISCOVERY_INTERVAL_S. Empty: the
    # static TRITON_GRPC_URLS are used.
    triton_dns_name: str = ""
    triton_dns_port: int = Field(default=8001, ge=1, le=65535)
    discovery_interval_s: float = Field(default=5.0, gt=0)
    # Test hook: read the addresses of TRITON_DNS_NAME from this file (one host[:port] a
    # line) instead of DNS.
    discovery_test_hosts_file: Path | None = None

    # -- Routing ------------------------------------------------------------------------------
    # LLMs: cache_aware (prefix blocks against load), least_outstanding or round_robin.
    llm_routing: Literal["cache_aware", "least_outstanding", "round_robin"] = "cache_aware"
    # Weight of a block to prefill against a block in use (Dynamo's overlap weight).
    route_prefill_weight: float = Field(default=1.0, ge=0)
    # ... and of a KV block of a running request (see gateway.server.routing.router).
    route_decode_weight: float = Field(default=0.25, ge=0)
    # Load imbalance beyond which the least loaded replica is chosen (requests, ratio).
    route_balance_abs: float = Field(default=8.0, ge=0)
    route_balance_rel: float = Field(default=1.5, ge=1)
    # How long a prefix sent to a replica is assumed to stay in its KV cache.
    prefix_ttl_s: float = Field(default=600.0, gt=0)
    # Replica metrics (engine load, KV cache): scraped this often, from these URLs (one
    # per TRITON_GRPC_URLS entry), else http://<replica host>:TRITON_METRICS_PORT/metrics.
    load_scrape_s: float = Field(default=0.25, gt=0)
    triton_metrics_urls: CommaList = []
    triton_metrics_port: int = Field(default=8002, ge=1, le=65535)

    # -- Dispatcher ---------------------------------------------------------------------------
    # A running request's lease: renewed every third of it by its dispatcher's lease keeper
    # (a thread of its own: a busy event loop does not stop it; dispatch/leases.py); one
    # not renewed this long belongs to a dead dispatcher and is started again elsewhere.
    claim_idle_ms: int = Field(default=15_000, ge=50)
    # Free slots of a model kept for light tenants while others are active (at most this
    # share of the model's slots; see gateway.server.dispatch.scheduler).
    fair_headroom: float = Field(default=0.25, ge=0, le=1)
    # A request started more often than this fails instead of being run again (runs a
    # draining gateway handed on do not count).
    max_deliveries: int = Field(default=3, ge=1)
    sweep_interval_s: float = Field(default=1.0, gt=0)
    # Token events: every stream's events of the process go as one Redis call per shard,
    # sent at once when no call of the shard is in flight, else with what gathers until it
    # ends (dispatch/relay.py); above 0, also held up to this long to gather more (fewer
    # calls at many streams, for that much latency a token).
    token_window_ms: float = Field(default=0.0, ge=0)
    # How long a draining gateway lets running requests finish before handing them over.
    drain_s: float = Field(default=10.0, ge=0)
    # Once started, the process's objects leave the garbage collector's view and its youngest
    # generation is collected after this many new objects (Python's default: 700); 0 leaves
    # the collector as Python sets it (app.py keep_collector_off_the_hot_path).
    gc_young_threshold: int = Field(default=10_000, ge=0)
    # Debug: count what each hot call makes the process do (tasks, loop iterations, Redis
    # round trips, gRPC calls, JSON encodes) into its x-gateway-counts header
    # (gateway/common/counts.py); it serves on the pure-Python asyncio loop then. Costs every
    # callback: never in production.
    request_counts: bool = False

    @field_validator("webhook_secrets")
    @classmethod
    def _secrets_can_sign(cls, secrets: list[str]) -> list[str]:
        problem = secrets_problem(secrets)
        if problem:
            raise ValueError(problem)
        return secrets

    @model_validator(mode="after")
    def _no_keys_only_on_loopback(self) -> Self:
        if not self.auth_enabled and not is_loopback(self.host):
            raise ValueError(
                f"AUTH_ENABLED=false makes every caller an operator: it needs HOST on loopback (127.0.0.1), "
                f"not {self.host}"
            )
        return self

    @model_validator(mode="after")
    def _tenant_names_are_not_public(self) -> Self:
        if self.metrics_tenant_label and self.public_metrics:
            raise ValueError("METRICS_TENANT_LABEL=true needs PUBLIC_METRICS=false: tenant names are not public")
        return self
