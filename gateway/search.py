"""Similarity search: embed the query through Triton, ask a binder's index for the
nearest vectors, return them with their stored records.

The index lives in the binders (each keeps a full copy fed from the results stream),
so gateways stay stateless; any binder can answer."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from gateway.adapters import ADAPTERS
from gateway.binder_client import BinderClient
from gateway.contracts import SPACE_IMAGE_MODEL, SPACE_TEXT_MODEL
from gateway.errors import ApiError
from gateway.replicas import ReplicaPool
from gateway.results import ResultReader
from gateway.schemas import SearchHit, SearchRequest, SearchResponse

log = logging.getLogger(__name__)

EMBED_TIMEOUT_S = 30.0


class SearchService:
    def __init__(self, pool: ReplicaPool, results: ResultReader, binders: BinderClient) -> None:
        self.pool = pool
        self.results = results
        self.binders = binders

    async def search(self, query: SearchRequest) -> SearchResponse:
        if (query.text is None) == (query.image is None):
            raise ApiError(422, "invalid_query", "give exactly one of text or image")
        space = query.space or ("minilm" if query.text is not None else "clip")
        models = SPACE_TEXT_MODEL if query.text is not None else SPACE_IMAGE_MODEL
        if space not in models:
            kind = "text" if query.text is not None else "image"
            raise ApiError(422, "unknown_space", f"no {kind} search in space {space!r}; spaces: {', '.join(models)}")
        model = models[space]
        inputs = {"text": query.text} if query.text is not None else {"image": query.image}
        vector = await self.embed(model, inputs)
        hits = await self.binders.nearest(space, vector, query.k)
        records = await self.results.get_many([hit["request_id"] for hit in hits])
        return SearchResponse(
            space=space,
            hits=[SearchHit(request_id=h["request_id"], score=h["score"], record=records.get(h["request_id"])) for h in hits],
        )

    async def embed(self, model: str, raw_inputs: dict[str, Any]) -> list[float]:
        adapter = ADAPTERS[model]
        try:
            inputs, parameters = adapter.validate(raw_inputs, {})
        except ValidationError as exc:
            raise ApiError(422, "invalid_query", exc.errors()[0]["msg"]) from None
        try:
            replica = await self.pool.acquire(model, timeout=EMBED_TIMEOUT_S)
        except TimeoutError:
            raise ApiError(503, "no_replica", f"no Triton replica serves {model}") from None
        try:
            result = await replica.client.infer(
                model, adapter.triton_inputs(inputs, parameters, False), outputs=adapter.requested_outputs(),
                client_timeout=EMBED_TIMEOUT_S,
            )
        except Exception as exc:
            raise ApiError(422 if "invalid" in str(exc).lower() else 503, "embedding_failed", str(exc)) from None
        finally:
            await self.pool.release(replica)
        return adapter.parse(result)[adapter.output_name]
