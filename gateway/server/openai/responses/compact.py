"""POST /v1/responses/compact: a conversation compacted into a summary, as OpenAI defines
it (a `response.compaction` object whose output is the conversation's user messages, then
one `compaction` item).

The model writes the summary: the conversation (the chain of previous_response_id, then
`input`) is sent to it with an instruction to summarise, greedily (temperature 0), at most
COMPACT_MAX_TOKENS tokens, as an ordinary request of the tenant (admission, quotas and
usage as any other; nothing is kept of it as a response). The summary is kept in MongoDB
for the tenant (compactions.py); the compaction item's `encrypted_content` names it. Given
back as input (to POST /v1/responses or a WebSocket's response.create), the item is the
summary, put to the model as a user message; another tenant's item is refused
(compaction_not_found)."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from gateway.server.api.errors import ApiError
from gateway.server.api.tenancy import Caller, caller
from gateway.server.calls import requests as call_requests
from gateway.server.calls import run, terms
from gateway.server.openai import common
from gateway.server.openai.responses.call import response_call
from gateway.server.openai.responses.compactions import CompactionStore, new_compaction
from gateway.server.openai.responses.items import with_ids
from gateway.server.openai.responses.settings import response_id
from gateway.server.openai.schemas import ResponseCompactRequest, ResponseRequest, refuse_unsupported
from gateway.server.services import services

# The summary's length at most (tokens), and what the model is asked.
COMPACT_MAX_TOKENS = 256
INSTRUCTION = (
    "Summarize the conversation above so that it can be continued from the summary alone: keep the facts, "
    "names, numbers, decisions and open tasks. Write only the summary."
)

router = APIRouter(prefix="/v1", tags=["OpenAI"])


def _summarising_request(body: ResponseCompactRequest) -> ResponseRequest:
    """The create call that writes the summary: the conversation, then the instruction."""
    given: list[Any]
    if body.input is None:
        given = []
    elif isinstance(body.input, str):
        given = [{"type": "message", "role": "user", "content": body.input}]
    else:
        given = [item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in body.input]
    call = {
        "model": body.model,
        "input": [*given, {"type": "message", "role": "user", "content": INSTRUCTION}],
        "instructions": body.instructions,
        "previous_response_id": body.previous_response_id,
        "prompt_cache_key": body.prompt_cache_key,
        "service_tier": body.service_tier,
        "max_output_tokens": COMPACT_MAX_TOKENS,
        "temperature": 0,
        "store": False,
    }
    # (Validated as JSON, as a body is: the items given were valid already.)
    return ResponseRequest.model_validate_json(json.dumps({k: v for k, v in call.items() if v is not None}))


def _user_message(item: dict[str, Any]) -> dict[str, Any]:
    """A user message of the conversation, as a compacted output keeps it."""
    content = [
        {"type": "input_text", "text": str(part.get("text") or "")}
        for part in item.get("content", [])
        if isinstance(part, dict)
    ]
    return {"id": item["id"], "type": "message", "status": "completed", "role": "user", "content": content}


@router.post("/responses/compact", summary="Compact a conversation into a summary item (OpenAI Responses API)")
async def compact_response(
    body: ResponseCompactRequest, request: Request, who: Annotated[Caller, Depends(caller)]
) -> Any:
    svc = services(request)
    refuse_unsupported(body, "responses")
    if body.input is None and body.previous_response_id is None:
        raise ApiError(
            400,
            "invalid_request",
            "input: give the conversation to compact as input, or name it with previous_response_id",
            details={"param": "input"},
        )
    call = await response_call(_summarising_request(body), svc, who)
    (request_id,) = await run.start(svc, who, request, [call.native], flex=terms.tier(body.service_tier).flex)
    record = await run.wait_record(svc, who, request_id, call.native.timeout_s or svc.settings.default_timeout_s)
    run.raise_for_record(record)
    summary = str((record.outputs or {}).get("text_output") or "").strip()
    item_id, reference = new_compaction()
    await CompactionStore(svc).put(who.scope, reference, item_id, summary, body.model)
    # The user messages of the conversation (the chain's, then the input's: the
    # instruction, last, is the gateway's own), then the summary.
    conversation = with_ids(call.context + call.items[:-1], request_id)
    users = [_user_message(i) for i in conversation if i.get("type") == "message" and i.get("role") == "user"]
    counted = common.usage([record], call_requests.tokens_per_block(svc, body.model))
    compacted = {
        "id": response_id(request_id),
        "object": "response.compaction",
        "created_at": int(time.time()),
        "output": [*users, {"id": item_id, "type": "compaction", "encrypted_content": reference}],
        "usage": {
            "input_tokens": counted["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": counted["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": counted["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counted["total_tokens"],
        },
    }
    return JSONResponse(compacted, headers={"x-request-id": request_id})
