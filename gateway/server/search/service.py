"""Similarity search: embed the query through Triton, ask a binder's index for the
nearest vectors of the caller's tenant, return them with their stored records.

A search is the tenant's: it holds one of the tenant's searches in flight in this process
(TENANT_SEARCH_CONCURRENCY; 429 tenant_share_exceeded beyond), is one of its requests per
minute (tenants/quotas.py; 429 rate_limited beyond) and is counted in its usage
(`searches`), so one tenant's searches cannot take Triton from the others.

The index lives in the binders (each keeps a full copy fed from the results stream),
so gateways stay stateless; any binder can answer."""

from __future__ import annotations

import logging

from gateway.protocol.http import SearchHit, SearchRequest, SearchResponse
from gateway.server.dispatch.failures import classify
from gateway.server.errors import InvalidRequest, Unavailable
from gateway.server.models import InvalidInput, ModelRegistry
from gateway.server.models.embedding import EmbeddingAdapter
from gateway.server.models.tokenize_pool import off_the_loop_if_long
from gateway.server.replicas import ReplicaPool
from gateway.server.results.reader import ResultReader
from gateway.server.search.binders import BinderClient
from gateway.server.tenants.config import TenantConfig
from gateway.server.tenants.quotas import Quotas
from gateway.server.tenants.shares import SharedPool
from gateway.server.tenants.usage import UsageLedger

log = logging.getLogger(__name__)

EMBED_TIMEOUT_S = 30.0


class SearchService:
    def __init__(
        self,
        registry: ModelRegistry,
        pool: ReplicaPool,
        results: ResultReader,
        binders: BinderClient,
        *,
        quotas: Quotas | None = None,
        usage: UsageLedger | None = None,
        tenant_concurrency: int = 4,
    ) -> None:
        """quotas, usage: where a tenant's searches are charged and counted (None: not)."""
        self.registry = registry
        self.pool = pool
        self.results = results
        self.binders = binders
        self.quotas = quotas
        self.usage = usage
        self.running = SharedPool("searches", total=None, share=tenant_concurrency)

    async def search(
        self, query: SearchRequest, tenant: str | None = None, config: TenantConfig | None = None
    ) -> tuple[SearchResponse, dict[str, str]]:
        """The hits, and the rate-limit headers of the tenant's charge. config: the
        tenant's settings, to charge the search to (None: not charged, as for an operator's
        tools)."""
        if (query.text is None) == (query.image is None):
            raise InvalidRequest("invalid_query", "give exactly one of text or image")
        kind = "text" if query.text is not None else "image"
        space = query.space or ("minilm" if kind == "text" else "clip")
        model = self.registry.embedder(space, kind)
        if model is None:
            spaces = ", ".join(self.registry.spaces(kind)) or "none"
            raise InvalidRequest("unknown_space", f"no {kind} search in space {space!r}; spaces: {spaces}")
        # The tenant's place among its searches first: a search refused for it charges nothing.
        with self.running.hold(config.tenant if config else None):
            headers: dict[str, str] = {}
            if config is not None:
                if self.quotas is not None:
                    headers = await self.quotas.admit(config, 0)
                if self.usage is not None:
                    self.usage.count(config.tenant, "searches")
            raw = {"text": query.text} if kind == "text" else {"image": query.image}
            vector = await self.embed(model, raw, config.tenant if config else None)
            hits = await self.binders.nearest(space, vector, query.k, tenant)
            records = await self.results.get_many([hit["request_id"] for hit in hits], tenant)
        response = SearchResponse(
            space=space,
            hits=[
                SearchHit(
                    request_id=h["request_id"], row=h.get("row"), score=h["score"], record=records.get(h["request_id"])
                )
                for h in hits
            ],
        )
        return response, headers

    async def embed(
        self, adapter: EmbeddingAdapter, raw_inputs: dict[str, str | None], tenant: str | None
    ) -> list[float]:
        try:
            # A large image's base64 and header scan in the tokenize pool, in the tenant's share.
            prepared = await off_the_loop_if_long(raw_inputs, lambda: adapter.validate(raw_inputs, {}), tenant=tenant)
        except InvalidInput as exc:
            raise InvalidRequest("invalid_query", exc.message) from None
        try:
            replica = await self.pool.acquire(adapter.triton_model, timeout=EMBED_TIMEOUT_S)
        except TimeoutError:
            raise Unavailable("no_replica", f"no Triton replica serves {adapter.name}") from None
        run = adapter.new_run(prepared)
        try:
            result = await replica.client.infer(
                run.triton_model, run.inputs(False), outputs=run.outputs(), client_timeout=EMBED_TIMEOUT_S
            )
        except Exception as exc:
            failure = classify(exc)
            kind = InvalidRequest if failure.code == "invalid_input" else Unavailable
            raise kind("embedding_failed", failure.message[:500]) from None
        finally:
            await self.pool.release(replica, adapter.triton_model)
        run.take(result)
        outputs, _ = run.final()
        return outputs[adapter.output_name]
