"""Similarity search: embed the query through Triton, ask a binder's index for the
nearest vectors of the caller's tenant, return them with their stored records.

The index lives in the binders (each keeps a full copy fed from the results stream),
so gateways stay stateless; any binder can answer."""

from __future__ import annotations

import logging

from gateway.protocol.http import SearchHit, SearchRequest, SearchResponse
from gateway.server.dispatch.failures import classify
from gateway.server.errors import InvalidRequest, Unavailable
from gateway.server.models import InvalidInput, ModelRegistry
from gateway.server.models.embedding import EmbeddingAdapter
from gateway.server.replicas import ReplicaPool
from gateway.server.results.reader import ResultReader
from gateway.server.search.binders import BinderClient

log = logging.getLogger(__name__)

EMBED_TIMEOUT_S = 30.0


class SearchService:
    def __init__(
        self, registry: ModelRegistry, pool: ReplicaPool, results: ResultReader, binders: BinderClient
    ) -> None:
        self.registry = registry
        self.pool = pool
        self.results = results
        self.binders = binders

    async def search(self, query: SearchRequest, tenant: str | None = None) -> SearchResponse:
        if (query.text is None) == (query.image is None):
            raise InvalidRequest("invalid_query", "give exactly one of text or image")
        kind = "text" if query.text is not None else "image"
        space = query.space or ("minilm" if kind == "text" else "clip")
        model = self.registry.embedder(space, kind)
        if model is None:
            spaces = ", ".join(self.registry.spaces(kind)) or "none"
            raise InvalidRequest("unknown_space", f"no {kind} search in space {space!r}; spaces: {spaces}")
        vector = await self.embed(model, {"text": query.text} if kind == "text" else {"image": query.image})
        hits = await self.binders.nearest(space, vector, query.k, tenant)
        records = await self.results.get_many([hit["request_id"] for hit in hits], tenant)
        return SearchResponse(
            space=space,
            hits=[
                SearchHit(
                    request_id=h["request_id"], row=h.get("row"), score=h["score"], record=records.get(h["request_id"])
                )
                for h in hits
            ],
        )

    async def embed(self, adapter: EmbeddingAdapter, raw_inputs: dict[str, str | None]) -> list[float]:
        try:
            prepared = adapter.validate(raw_inputs, {})
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
