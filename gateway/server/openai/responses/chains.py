"""Reading what came before a response: the chain of previous_response_id and a
conversation's items, bounded (RESPONSE_CHAIN_MAX, RESPONSE_CHAIN_MAX_BYTES,
CONVERSATION_MAX_BYTES) and read in batches; and a kept response read back."""

from collections.abc import Callable
from typing import Any

from gateway.common.result_store import record_from_document
from gateway.protocol import ResultRecord, valid_request_id
from gateway.protocol.http import LiveStatus
from gateway.server.api.errors import ApiError
from gateway.server.api.tenancy import Caller
from gateway.server.calls import requests as call_requests
from gateway.server.openai.paging import following
from gateway.server.openai.responses.items import (
    function_call_id,
    output_of,
)
from gateway.server.openai.responses.settings import (
    STATUS,
    ResponseSettings,
    invalid,
    request_id_of,
    settings_of_record,
)
from gateway.server.openai.responses.store import ConversationStore, ResponseStore, item_bytes
from gateway.server.services import Services

# -- the chain of stored responses --------------------------------------------------------------

# Responses (or conversation entries) read from MongoDB at a time while their items are
# gathered: what is held is bounded by the bytes limit and one batch.
_BATCH = 16


class _Budget:
    """The bytes of the items gathered so far, against a limit (0: none)."""

    def __init__(self, most: int, over: Callable[[int], ApiError], used: int = 0) -> None:
        self.most, self.over, self.used = most, over, used

    def take(self, items: list[dict[str, Any]]) -> None:
        self.used += sum(item_bytes(item) for item in items)
        self.check()

    def check(self) -> None:
        if self.most and self.used > self.most:
            raise self.over(self.most)


def _chain_too_large(most: int) -> ApiError:
    return ApiError(
        400,
        "response_chain_too_large",
        f"the items of the previous_response_id chain come to more than {most} bytes (RESPONSE_CHAIN_MAX_BYTES): "
        "start a new chain, giving the items that matter as input",
        details={"param": "previous_response_id", "limit": "response_chain_max_bytes", "max": most},
    )


def _not_found(previous: str, why: str = "not found") -> ApiError:
    return ApiError(
        400,
        "previous_response_not_found",
        f"previous response {previous} {why}",
        details={"param": "previous_response_id"},
    )


async def continued(svc: Services, who: Caller, previous: str) -> tuple[list[str], list[dict[str, Any]]]:
    """The chain a response continuing `previous` has, and the items it was given and gave
    (at most RESPONSE_CHAIN_MAX responses and RESPONSE_CHAIN_MAX_BYTES of items: refused
    by name beyond, before the chain is read where the previous response says how much
    it was given)."""
    if not valid_request_id(previous.removeprefix("resp_")):
        raise _not_found(previous)
    store = ResponseStore(svc)
    document = await store.get(who.scope, previous)
    if document is None or document.get("deleted"):
        raise _not_found(previous, "was deleted" if document else "not found (or created with store: false)")
    chain = [*document.get("chain", []), previous]
    most = svc.settings.response_chain_max
    if len(chain) > most:
        raise ApiError(
            400,
            "response_chain_too_long",
            f"a previous_response_id chain holds at most {most} responses (RESPONSE_CHAIN_MAX): "
            "start a new chain, giving the items that matter as input",
            details={"param": "previous_response_id", "limit": "response_chain_max", "max": most},
        )
    given = document.get("context_bytes")
    if given is not None:
        known = int(given) + sum(item_bytes(item) for item in document.get("input", []))
        _Budget(svc.settings.response_chain_max_bytes, _chain_too_large, known).check()
    outcome = await svc.results.get(request_id_of(previous), who.scope)
    if not outcome.status.terminal:
        raise ApiError(
            400,
            "previous_response_in_progress",
            f"previous response {previous} is still {STATUS[outcome.status]}: continue it once it has ended",
            details={"param": "previous_response_id"},
        )
    return chain, await chain_items(svc, who, chain, {previous: document})


async def _records(svc: Services, who: Caller, request_ids: list[str]) -> dict[str, ResultRecord]:
    """The records of these requests without their inputs: a response's record holds every
    item it was given, so reading them whole would read a chain's (or a conversation's)
    items again for each response in it. Those not in MongoDB yet are read as the results
    reader finds them."""
    if not request_ids:
        return {}
    found: dict[str, ResultRecord] = {}
    query = {"_id": {"$in": request_ids}, "tenant": who.scope}
    async for document in svc.store.collection.find(query, {"inputs": 0}):
        record = record_from_document(document)
        found[record.request_id] = record
    missing = [request_id for request_id in request_ids if request_id not in found]
    if missing:
        found |= await svc.results.get_many(missing, who.scope)
    return found


def _response_items(
    svc: Services, response: str, document: dict[str, Any], records: dict[str, ResultRecord]
) -> list[dict[str, Any]]:
    """A kept response's input items, then its output items once it has ended."""
    items = list(document.get("input", []))
    record = records.get(request_id_of(response))
    if record is not None:
        settings = ResponseSettings.model_validate(document.get("settings") or {})
        items += output_of(record, settings, call_requests.tool_format(svc, record.model)).items
    return items


async def chain_items(
    svc: Services, who: Caller, chain: list[str], known: dict[str, dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Each response's input items then its output items, along the chain: read _BATCH
    responses at a time, refused (response_chain_too_large) once they come to more than
    RESPONSE_CHAIN_MAX_BYTES."""
    known = known or {}
    budget = _Budget(svc.settings.response_chain_max_bytes, _chain_too_large)
    items: list[dict[str, Any]] = []
    for start in range(0, len(chain), _BATCH):
        batch = chain[start : start + _BATCH]
        documents = await ResponseStore(svc).get_many(who.scope, [r for r in batch if r not in known])
        documents |= {r: known[r] for r in batch if r in known}
        records = await _records(svc, who, [request_id_of(r) for r in batch])
        for response in batch:
            document = documents.get(response)
            if document is None or document.get("deleted"):
                raise _not_found(response, "(in the chain of previous_response_id) was deleted")
            found = _response_items(svc, response, document, records)
            budget.take(found)
            items += found
    return items


# -- conversations ----------------------------------------------------------------------------
#
# A response in a conversation whose document is gone (it expired, RESULT_RETENTION_S after
# it was made) or was deleted is no longer in the conversation: its items are not listed,
# found or given to later responses.


async def conversation_of(svc: Services, who: Caller, conversation: str, param: str | None = None) -> dict[str, Any]:
    """The tenant's conversation: 404 (naming `param`) if there is none."""
    found = await ConversationStore(svc).get(who.scope, conversation)
    if found is None:
        details = {"param": param} if param else None
        raise ApiError(404, "conversation_not_found", f"no conversation {conversation}", details=details)
    return found


Expanded = list[tuple[dict[str, Any], list[dict[str, Any]]]]


async def _expand(svc: Services, who: Caller, entries: list[dict[str, Any]]) -> Expanded:
    """Each entry with its items in order (those hidden left out): an added item, or the
    items of a response (none once it has expired or was deleted). An added item read
    without its content stands as its entry's ids."""
    responses = [str(entry["response"]) for entry in entries if "response" in entry]
    documents = await ResponseStore(svc).get_many(who.scope, responses)
    records = await _records(svc, who, [request_id_of(r) for r in responses])
    found: Expanded = []
    for entry in entries:
        hidden = set(entry.get("hidden", []))
        if "response" in entry:
            document = documents.get(entry["response"])
            gone = document is None or document.get("deleted")
            items = [] if gone else _response_items(svc, entry["response"], document or {}, records)
        else:
            items = [entry["item"]] if "item" in entry else [{"id": i} for i in entry.get("ids", [])]
        found.append((entry, [item for item in items if item.get("id") not in hidden]))
    return found


def _conversation_too_large(conversation: str) -> Callable[[int], ApiError]:
    def over(most: int) -> ApiError:
        return ApiError(
            400,
            "conversation_bytes_limit",
            f"the items of conversation {conversation}, its responses' outputs included, come to more than "
            f"{most} bytes (CONVERSATION_MAX_BYTES): delete items, or start a new conversation",
            details={"param": "conversation", "limit": "conversation_max_bytes", "max": most},
        )

    return over


async def conversation_items(
    svc: Services, who: Caller, conversation: str, before: str | None = None
) -> list[dict[str, Any]]:
    """A conversation's items in order (those before entry `before`, an entry's id), as a
    response is given them: read _BATCH entries at a time, refused
    (conversation_bytes_limit) once they come to more than CONVERSATION_MAX_BYTES."""
    store = ConversationStore(svc)
    budget = _Budget(svc.settings.conversation_max_bytes, _conversation_too_large(conversation))
    below = before.partition(":")[2] if before else None
    position: str | None = None
    found: list[dict[str, Any]] = []
    while True:
        entries = await store.page(who.scope, conversation, after=position, before=below, limit=_BATCH)
        for _, items in await _expand(svc, who, entries):
            budget.take(items)
            found += items
        if len(entries) < _BATCH:
            return found
        position = entries[-1]["position"]


async def conversation_page(
    svc: Services, who: Caller, conversation: str, *, limit: int, after: str | None, descending: bool
) -> tuple[list[dict[str, Any]], bool]:
    """A page of a conversation's items (newest first when descending), those after item
    `after`; and whether more follow. The entries are read in MongoDB's order of
    position, as many as the page needs; whether more follow is read without the content
    of the items added."""
    store = ConversationStore(svc)
    page: list[dict[str, Any]] = []
    position: str | None = None
    if after is not None:
        found = await entry_of(svc, who, conversation, after)
        if found is None:
            raise invalid("after", f"no item {after} in {conversation}")
        entry, items = found
        page = following(items[::-1] if descending else items, after) or []
        position = entry["position"]
    while len(page) <= limit:
        peek = len(page) == limit  # the page is full: only whether another item follows
        want = 4 if peek else limit - len(page)
        entries = await store.page(
            who.scope, conversation, after=position, descending=descending, limit=want, without_items=peek
        )
        for _, items in await _expand(svc, who, entries):
            page += items[::-1] if descending else items
        if len(entries) < want:
            break
        position = entries[-1]["position"]
    return page[:limit], len(page) > limit


async def entry_of(
    svc: Services, who: Caller, conversation: str, item_id: str
) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """The entry holding item `item_id` and its items (None: no such item): found by the
    ids the entry keeps, or, for a function call a response made, by the ids its calls
    have."""
    store = ConversationStore(svc)
    entry = await store.entry_holding(who.scope, conversation, item_id)
    if entry is None and item_id.startswith("fc_"):
        for candidate in await store.entries_with_calls(who.scope, conversation):
            request_id = request_id_of(str(candidate["response"]))
            if any(function_call_id(request_id, n) == item_id for n in range(int(candidate["calls"]))):
                entry = candidate
                break
    if entry is None:
        return None
    ((_, items),) = await _expand(svc, who, [entry])
    return (entry, items) if any(item.get("id") == item_id for item in items) else None


async def kept(svc: Services, who: Caller, response: str) -> dict[str, Any] | None:
    """The stored response's document: 404 for one deleted or created with store: false."""
    document = await ResponseStore(svc).get(who.scope, response)
    if document is not None and document.get("deleted"):
        raise ApiError(404, "not_found", f"response {response} was deleted")
    return document


async def read(svc: Services, who: Caller, response: str) -> tuple[ResultRecord | LiveStatus, ResponseSettings]:
    request_id = request_id_of(response)
    document = await kept(svc, who, response)
    outcome = await svc.results.get(request_id, who.scope)
    if document is None and outcome.metadata.get("store") == "false":
        raise ApiError(404, "not_found", f"response {response} was created with store: false: it is not kept")
    if outcome.metadata.get("api") != "responses":
        raise ApiError(404, "not_found", f"no response {response}")
    settings = ResponseSettings.model_validate(document["settings"]) if document else settings_of_record(outcome)
    return outcome, settings
