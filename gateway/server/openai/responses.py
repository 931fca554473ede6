"""The Responses API: POST /v1/responses, GET /v1/responses/{id} (optionally streamed,
resuming with starting_after), GET /v1/responses/{id}/input_items, DELETE
/v1/responses/{id}, POST /v1/responses/{id}/cancel. Objects and events as OpenAI and the
Open Responses specification define them: every field of a response present (null where
it does not apply), each streamed event with its sequence_number and whole objects.

- Status: `queued` while the request waits for a slot, `in_progress` while it runs, then
  `completed`, `incomplete` (max_output_tokens ran out), `failed` or `cancelled`. A
  background create answers `queued` at once; a foreground stream begins in_progress.
- background=true: an ordinary durable request that survives the client's disconnect and
  a gateway restart. Streamed events get sequence numbers derived from the request's own
  event stream (which only grows), so resuming after sequence number N gives exactly what
  followed N.
- Function tools (`tools`, `tool_choice`, `parallel_tool_calls`, `max_tool_calls`) as on
  chat completions (gateway.server.llm.tools; chat.py's plan): auto reads calls from the
  text in the model's template family, required or a named function forces one call by
  guided decoding. Calls are `function_call` output items (streamed with
  response.function_call_arguments.delta/.done); text outside them is a message (with
  tools offered, its leading white space, and its trailing white space before a call, are
  left out). `function_call` and `function_call_output` input items are the calls and the
  caller's results; earlier output items given back as input (ids, statuses) are taken
  as they are, so `input = history + response.output` works.
- Conversation state (response_store.py): a stored response keeps its settings and input
  items in MongoDB with its tenant; `previous_response_id` continues it (its input and
  output items, and those of the chain before it, come first; its instructions do not),
  across gateways and restarts. `store: false` keeps nothing of the response (it cannot be
  read back or continued). input_items lists what the model was given. `conversation`
  (conversations.py) gives a response a conversation's items and adds its own to it.
- text.format json_object / json_schema is guided decoding on the engine; include
  message.output_text.logprobs (and top_logprobs) puts each token's log-probability in the
  output text; service_tier and prompt_cache_key work as on chat completions; usage has
  input_tokens_details.cached_tokens. A background response that ends is announced to the
  tenant's OpenAI webhook endpoint (the binder sends response.completed and the others).
- max_output_tokens reports the cap that applied: the one given, else the gateway's default
  (512), so a response cut by either (`incomplete_details.reason: max_output_tokens`)
  names its number.
- A function_call_output must answer a function_call before it (in the input, the chain or
  the conversation): 400 naming input[i].call_id otherwise.
- POST /v1/responses/compact (responses_compact.py) and WebSocket mode (GET /v1/responses
  upgraded: responses_ws.py) are routers of their own beside this one. A `compaction` input item is the
  summary compact made, kept for the tenant (compactions.py).
- Refused by name (400): other tool types, image input (no image model serves /v1) and
  file input, `reasoning`, `truncation: auto`, `prompt`."""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sse_starlette import ServerSentEvent

from gateway.common.result_store import record_from_document
from gateway.protocol import ResultRecord, State, request_id_time, valid_request_id
from gateway.protocol.http import InferRequest, LiveStatus
from gateway.server import spine
from gateway.server.api.errors import ApiError
from gateway.server.api.sse import EventStream
from gateway.server.api.tenancy import Caller, caller
from gateway.server.llm import tools as toolcalls
from gateway.server.openai import common
from gateway.server.openai.chat import ChatPlan, parameters
from gateway.server.openai.compactions import CompactionStore
from gateway.server.openai.response_store import (
    ConversationStore,
    ResponseStore,
    item_bytes,
    response_entry,
)
from gateway.server.openai.schemas import (
    INCLUDE_LOGPROBS,
    RESPONSE_TEXT_PARTS,
    CalledFunction,
    CompactionItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    Message,
    ResponseContentPart,
    ResponseInputMessage,
    ResponseRequest,
    ToolCall,
    refuse_unsupported,
    unsupported,
)
from gateway.server.results.events import StreamEvent
from gateway.server.services import Services, services

router = APIRouter(prefix="/v1", tags=["OpenAI"])

# Calls one output may hold (max_tool_calls may say fewer).
MAX_TOOL_CALLS = 128

_STATUS = {
    State.QUEUED: "queued",
    State.RUNNING: "in_progress",
    State.SUCCEEDED: "completed",
    State.FAILED: "failed",
    State.EXPIRED: "failed",
    State.CANCELED: "cancelled",
}


def response_id(request_id: str) -> str:
    return f"resp_{request_id}"


def request_id_of(value: str) -> str:
    request_id = value.removeprefix("resp_")
    if not valid_request_id(request_id):
        raise ApiError(404, "not_found", f"no response {value}")
    return request_id


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request", message, details={"param": param})


# -- what a response was asked for ----------------------------------------------------------


class ResponseSettings(BaseModel):
    """What a response object echoes of its request, and how its output is read (kept in
    MongoDB with a stored response)."""

    background: bool = False
    store: bool = True
    instructions: str | None = None
    previous_response_id: str | None = None
    conversation: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)  # as the response object shows them
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0
    logprobs: bool = False
    max_output_tokens: int | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str = "default"

    def plan(self, tool_format: toolcalls.ToolFormat | None) -> ChatPlan:
        """How the output is read: chat completions' plan for these tools and this choice."""
        offered = [_chat_tool(tool) for tool in self.tools]
        choice = self.tool_choice
        forced = isinstance(choice, dict) or choice == "required"
        if isinstance(choice, dict):
            offered = [t for t in offered if t["function"]["name"] == choice.get("name")]
        return ChatPlan(
            tools=offered if offered and choice != "none" else None,
            forced=forced and bool(offered),
            parallel=self.parallel_tool_calls,
            logprobs=self.logprobs,
            tier=common.tier(self.service_tier),
            tool_format=tool_format,
        )

    @property
    def max_calls(self) -> int:
        return 1 if not self.parallel_tool_calls else self.max_tool_calls or MAX_TOOL_CALLS


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool in chat completions' shape (what the templates render)."""
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


# Labels the gateway keeps with a response's record (not the caller's metadata).
_OWN_LABELS = (
    "api",
    "background",
    "store",
    "service_tier",
    "text_format",
    "text_format_name",
    "user",
    "safety_identifier",
)


def _text_config(labels: dict[str, str], inputs: dict[str, Any]) -> dict[str, Any]:
    """The text format of a response kept before its settings were (from its labels)."""
    kind = labels.get("text_format")
    if kind == "json_object":
        return {"format": {"type": "json_object"}}
    if kind == "json_schema":
        guide = (inputs.get("guided_decoding") or {}).get("guide") or "{}"
        name = labels.get("text_format_name") or "response"
        return {"format": {"type": "json_schema", "name": name, "schema": json.loads(guide), "strict": True}}
    return {"format": {"type": "text"}}


def settings_of_record(outcome: ResultRecord | LiveStatus) -> ResponseSettings:
    """What a response without kept settings echoes: what its record says."""
    labels = dict(outcome.metadata)
    found = ResponseSettings(
        background=labels.get("background", "false") == "true",
        store=labels.get("store") != "false",
        metadata={k: v for k, v in labels.items() if k not in _OWN_LABELS},
        user=labels.get("user"),
        safety_identifier=labels.get("safety_identifier"),
        service_tier=labels.get("service_tier", "default"),
    )
    if isinstance(outcome, ResultRecord):
        native = outcome.parameters
        greedy = native.get("top_k") == 1 and native.get("temperature") is None  # (temperature 0: openai_sampling)
        found.text = _text_config(labels, outcome.inputs)
        found.top_logprobs = int(native.get("top_logprobs") or 0)
        found.logprobs = bool(native.get("logprobs"))
        found.temperature = 0.0 if greedy else float(native.get("temperature") or 1.0)
        found.top_p = float(native.get("top_p") or 1.0)
        found.max_output_tokens = outcome.inputs.get("max_tokens")
    return found


# -- input items ------------------------------------------------------------------------------


def _parts(parts: list[ResponseContentPart], where: str, model: str) -> list[dict[str, Any]]:
    shaped = []
    for index, part in enumerate(parts):
        if part.type not in RESPONSE_TEXT_PARTS:
            why = f"{model} reads text only"
            if part.type == "input_image":
                why += ", and no model that reads images is served on /v1"
            raise unsupported(f"{where}[{index}].type", f"content of type {part.type} is not supported: {why}")
        if part.text is None:
            raise _invalid(f"{where}[{index}].text", f"{where}[{index}].text: a text part needs its text")
        item: dict[str, Any] = {"type": part.type, "text": part.text}
        if part.type == "output_text":
            item["annotations"] = []
        shaped.append(item)
    return shaped


def input_items(body: ResponseRequest) -> list[dict[str, Any]]:
    """The call's input as items of OpenAI's shapes (ids given later, where none is given);
    what is not served is refused by its place in the input."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": body.input}]}]
    return items_of(body.input, body.model)


def items_of(given_items: list[Any], model: str = "this model", param: str = "input") -> list[dict[str, Any]]:
    """Input items (ResponseInputItem) as items of OpenAI's shapes; what is not served is
    refused by its place (param[i]...)."""
    items: list[dict[str, Any]] = []
    for index, given in enumerate(given_items):
        where = f"{param}[{index}]"
        if isinstance(given, ResponseInputMessage):
            if isinstance(given.content, str):
                kind = "output_text" if given.role == "assistant" else "input_text"
                content = _parts([ResponseContentPart(type=kind, text=given.content)], f"{where}.content", model)
            else:
                content = _parts(given.content, f"{where}.content", model)
            item: dict[str, Any] = {"type": "message", "role": given.role, "content": content}
        elif isinstance(given, FunctionCallItem):
            item = {"type": "function_call", "call_id": given.call_id, "name": given.name, "arguments": given.arguments}
        elif isinstance(given, FunctionCallOutputItem):
            output = given.output
            shaped = output if isinstance(output, str) else _parts(output, f"{where}.output", model)
            item = {"type": "function_call_output", "call_id": given.call_id, "output": shaped}
        elif isinstance(given, CompactionItem):
            item = {"type": "compaction", "encrypted_content": given.encrypted_content}
        else:
            kind = given.type
            why = "give the item itself" if kind == "item_reference" else "this gateway serves function tools only"
            raise unsupported(f"{where}.type", f"input items of type {kind} are not supported: {why}")
        if given.id is not None:
            item["id"] = given.id
        items.append(item)
    return items


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "compaction": "cmp"}


def with_ids(items: list[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    """Input items with ids (those given kept; others derived from the request, so the same
    call again names them alike) and statuses, as input_items lists them."""
    found = []
    for index, item in enumerate(items):
        digest = hashlib.sha256(f"{request_id}:input:{index}".encode()).hexdigest()[:32]
        given = {k: v for k, v in item.items() if k != "id"}
        status = {} if item["type"] == "compaction" else {"status": "completed"}  # (a compaction item has none)
        found.append({"id": item.get("id") or f"{_ID_PREFIX[item['type']]}_{digest}", **given, **status})
    return found


def _text_of(content: str | list[dict[str, Any]]) -> str:
    return content if isinstance(content, str) else "".join(str(part.get("text") or "") for part in content)


# How a compaction item's summary is put to the model: a user message (chat templates
# take a system message first only).
SUMMARY_PREFIX = "A summary of the conversation so far:\n"


def chat_messages(items: list[dict[str, Any]], summaries: dict[str, str] | None = None) -> list[Message]:
    """Items as chat messages: a function_call joins the assistant message before it (or
    makes one), a function_call_output is a tool message, a compaction item its summary
    (`summaries`, by encrypted_content) as a user message."""
    shaped: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type")
        if kind == "compaction":
            summary = (summaries or {}).get(str(item.get("encrypted_content")), "")
            shaped.append({"role": "user", "content": SUMMARY_PREFIX + summary, "tool_calls": []})
        elif kind == "message":
            shaped.append({"role": item["role"], "content": _text_of(item["content"]), "tool_calls": []})
        elif kind == "function_call":
            call = ToolCall(id=item["call_id"], function=CalledFunction(name=item["name"], arguments=item["arguments"]))
            last = shaped[-1] if shaped else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"].append(call)
            else:
                shaped.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            shaped.append({"role": "tool", "content": _text_of(item["output"]), "tool_call_id": item["call_id"]})
    return [
        Message(
            role=m["role"],
            content=m["content"],
            tool_calls=m.get("tool_calls") or None,
            tool_call_id=m.get("tool_call_id"),
        )
        for m in shaped
    ]


# -- output items -----------------------------------------------------------------------------


def _function_call_id(request_id: str, index: int) -> str:
    return "fc_" + common.call_id(request_id, index).removeprefix("call_")


Step = tuple[str, dict[str, Any]]


class Output:
    """A response's output items from its generated text as it comes, and the steps (event
    type and fields) that tell of them: a message for the text, a function_call item for each
    call, in the order they begin. The same for a stream and for a finished record, so both
    read alike."""

    def __init__(self, request_id: str, plan: ChatPlan, max_calls: int) -> None:
        self.request_id = request_id
        self.plan = plan
        self.max_calls = max_calls
        self.parser = (
            toolcalls.StreamParser(plan.tool_format, tools=plan.tools) if plan.tools and not plan.forced else None
        )
        self.items: list[dict[str, Any]] = []
        self.message: int | None = None  # the message's output index, once it begins
        self.text = ""  # the message's text so far
        self.held = ""  # white space held back (tools offered), or a forced call's text
        self.calls = 0  # calls read (some may be over max_calls: not output)
        self.started = False

    @property
    def message_id(self) -> str:
        return f"msg_{self.request_id}"

    def start(self) -> list[Step]:
        """The generation began: plain text opens its message at once."""
        self.started = True
        return self._open() if self.plan.tools is None else []

    def feed(self, piece: str) -> list[Step]:
        if not piece:
            return []
        if self.plan.tools is None:
            return self._text(piece) if self.message is not None else self._open() + self._text(piece)
        if self.plan.forced:
            self.held += piece
            return []
        assert self.parser is not None
        steps: list[Step] = []
        for item in self.parser.feed(piece):
            steps += self._read(item)
        return steps

    def finish(self, record: ResultRecord) -> list[Step]:
        succeeded = record.status == State.SUCCEEDED
        cut = succeeded and common.finish_reason(record) == "length"
        steps: list[Step] = []
        if self.parser is not None:
            for item in self.parser.finish():
                steps += self._read(item)
            if not self.calls and self.held and self.message is not None:
                steps += self._text(self.held)
            self.held = ""
        if self.plan.forced and succeeded:
            call = toolcalls.parse_forced(self.held, self.plan.tools)
            steps += self._call(call, "incomplete" if cut else "completed")
        if self.message is None and not self.items and succeeded:
            steps += self._open()
        if self.message is not None:
            status = "completed" if succeeded and not cut else "incomplete"
            logprobs = common.logprobs_of(record)
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": logprobs}
            where = {"item_id": self.message_id, "output_index": self.message, "content_index": 0}
            message = self.items[self.message]
            message.update(status=status, content=[part])
            steps.append(
                ("response.output_text.done", {**where, "text": self.text, "logprobs": _without_bytes(logprobs)})
            )
            steps.append(("response.content_part.done", {**where, "part": copy.deepcopy(part)}))
            steps.append(("response.output_item.done", {"output_index": self.message, "item": copy.deepcopy(message)}))
        return steps

    def _read(self, item: str | toolcalls.ToolCall) -> list[Step]:
        if isinstance(item, toolcalls.ToolCall):
            self.calls += 1
            return self._call(item, "completed") if self.calls <= self.max_calls else []
        if self.message is None:
            self.held += item
            if not self.held.strip():
                return []
            text, self.held = self.held.lstrip(), ""
            return self._open() + self._held_text(text)
        return self._held_text(self.held + item)

    def _held_text(self, text: str) -> list[Step]:
        """Text to send, but its trailing white space held (a call may follow)."""
        body = text.rstrip()
        self.held = text[len(body) :]
        return self._text(body) if body else []

    def _open(self) -> list[Step]:
        self.message = len(self.items)
        item = {"id": self.message_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        self.items.append(item)
        where = {"item_id": self.message_id, "output_index": self.message, "content_index": 0}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            ("response.output_item.added", {"output_index": self.message, "item": copy.deepcopy(item)}),
            ("response.content_part.added", {**where, "part": part}),
        ]

    def _text(self, text: str) -> list[Step]:
        self.text += text
        where = {"item_id": self.message_id, "output_index": self.message, "content_index": 0}
        return [("response.output_text.delta", {**where, "delta": text, "logprobs": []})]

    def _call(self, call: toolcalls.ToolCall, status: str) -> list[Step]:
        index = len(self.items)
        number = sum(1 for item in self.items if item["type"] == "function_call")
        item = {
            "id": _function_call_id(self.request_id, number),
            "type": "function_call",
            "status": "in_progress",
            "call_id": common.call_id(self.request_id, number),
            "name": call.name,
            "arguments": "",
        }
        self.items.append(item)
        added = copy.deepcopy(item)
        item.update(arguments=call.arguments, status=status)
        where = {"item_id": item["id"], "output_index": index}
        return [
            ("response.output_item.added", {"output_index": index, "item": added}),
            ("response.function_call_arguments.delta", {**where, "delta": call.arguments}),
            ("response.function_call_arguments.done", {**where, "arguments": call.arguments}),
            ("response.output_item.done", {"output_index": index, "item": copy.deepcopy(item)}),
        ]


def output_of(record: ResultRecord, settings: ResponseSettings, tool_format: toolcalls.ToolFormat | None) -> Output:
    """The output items of a finished (or failed) request, read from its record."""
    output = Output(record.request_id, settings.plan(tool_format), settings.max_calls)
    if record.started_at is not None or record.status == State.SUCCEEDED:
        output.start()  # (as the stream did when it began)
    output.feed(str((record.outputs or {}).get("text_output") or ""))
    output.finish(record)
    return output


# -- the response object ------------------------------------------------------------------------


def response_object(
    outcome: ResultRecord | LiveStatus,
    settings: ResponseSettings | None = None,
    tpb: int = 32,
    tool_format: toolcalls.ToolFormat | None = None,
    output: list[dict[str, Any]] | None = None,
    status: str | None = None,
) -> dict[str, Any]:
    """The response object of a request, every field present: its output from the record
    (or `output`, a stream's), `status` instead of the request's when given."""
    settings = settings or settings_of_record(outcome)
    found = status or _STATUS[outcome.status]
    fields: dict[str, Any] = {}
    if isinstance(outcome, ResultRecord):
        fields["output"] = output if output is not None else output_of(outcome, settings, tool_format).items
        if outcome.status == State.SUCCEEDED and common.finish_reason(outcome) == "length":
            found = "incomplete"
            fields["incomplete_details"] = {"reason": "max_output_tokens"}
            made = outcome.usage.completion_tokens if outcome.usage else None
            if made and settings.max_output_tokens and made < settings.max_output_tokens:
                # Cut before the cap asked: the model's own (its context's room after the
                # prompt, or its most output tokens) applied, and this is that number.
                fields["max_output_tokens"] = made
        if found == "completed" and outcome.finished_at is not None:
            fields["completed_at"] = int(outcome.finished_at.timestamp())
        if outcome.error and outcome.status in (State.FAILED, State.EXPIRED):
            error = outcome.error
            fields["error"] = {"code": "server_error", "message": f"{error.code}: {error.message}"}
        counted = common.usage([outcome], tpb)
        fields["usage"] = {
            "input_tokens": counted["prompt_tokens"],
            "output_tokens": counted["completion_tokens"],
            "total_tokens": counted["total_tokens"],
            # (What the engines' prefix caches wrote is not reported: none is counted.)
            "input_tokens_details": {
                "cached_tokens": counted["prompt_tokens_details"]["cached_tokens"],
                "cache_write_tokens": 0,
            },
            "output_tokens_details": {"reasoning_tokens": 0},
        }
    created = int(outcome.created_at.timestamp())
    return {**blank_object(outcome.request_id, outcome.model, created, found, settings), **fields}


def blank_object(
    request_id: str, model: str, created_at: int, status: str, settings: ResponseSettings
) -> dict[str, Any]:
    """A response object before its request has ended: no output, no usage yet."""
    return {
        "id": response_id(request_id),
        "object": "response",
        "created_at": created_at,
        "completed_at": None,
        "status": status,
        "background": settings.background,
        "error": None,
        "incomplete_details": None,
        "model": model,
        "instructions": settings.instructions,
        "previous_response_id": settings.previous_response_id,
        "conversation": {"id": settings.conversation} if settings.conversation else None,
        "output": [],
        "tools": settings.tools,
        "tool_choice": settings.tool_choice,
        "parallel_tool_calls": settings.parallel_tool_calls,
        "max_tool_calls": settings.max_tool_calls,
        "max_output_tokens": settings.max_output_tokens,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "presence_penalty": settings.presence_penalty,
        "frequency_penalty": settings.frequency_penalty,
        "top_logprobs": settings.top_logprobs,
        "text": {**settings.text, "verbosity": "medium"},
        "truncation": "disabled",
        "reasoning": None,
        "store": settings.store,
        "service_tier": settings.service_tier,
        "metadata": settings.metadata,
        "user": settings.user,
        "safety_identifier": settings.safety_identifier,
        "prompt_cache_key": settings.prompt_cache_key,
        "prompt_cache_retention": None,
        "prompt_cache_options": None,
        "prompt": None,
        "usage": None,
        # OpenAI's fields for what this gateway does not do.
        "access_programs": None,
        "image": None,
        "input_transformations": None,
        "moderation": None,
        "prompt_cache_diagnostics": None,
        "tool_usage": None,
    }


# -- a call, as a request ---------------------------------------------------------------------


def _settings(body: ResponseRequest, tools: list[dict[str, Any]], logprobs: bool) -> ResponseSettings:
    choice: str | dict[str, Any] = "auto"
    if isinstance(body.tool_choice, str):
        choice = body.tool_choice
    elif body.tool_choice is not None:
        choice = {"type": "function", "name": body.tool_choice.name}
    text_format = body.text.format if body.text is not None else None
    text: dict[str, Any] = {"format": {"type": "text"}}
    if text_format is not None and text_format.type == "json_object":
        text = {"format": {"type": "json_object"}}
    elif text_format is not None and text_format.type == "json_schema":
        shaped = {
            "type": "json_schema",
            "name": text_format.name or "response",
            "description": text_format.description,
            "schema": text_format.schema_,
            "strict": bool(text_format.strict),
        }
        text = {"format": shaped}
    return ResponseSettings(
        background=bool(body.background),
        store=body.store is not False,
        instructions=body.instructions,
        previous_response_id=body.previous_response_id,
        conversation=_conversation_id(body),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        max_tool_calls=body.max_tool_calls,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        top_logprobs=body.top_logprobs or 0,
        logprobs=logprobs,
        # The cap that applies: the one given, else the gateway's default (a response cut by
        # either says max_output_tokens, and this says which number it was).
        max_output_tokens=body.max_output_tokens or common.DEFAULT_MAX_TOKENS,
        text=text,
        metadata=dict(body.metadata or {}),
        user=body.user,
        safety_identifier=body.safety_identifier,
        prompt_cache_key=body.prompt_cache_key,
        service_tier=common.tier(body.service_tier).name,
    )


def _conversation_id(body: ResponseRequest) -> str | None:
    found = body.conversation
    return found if isinstance(found, str) or found is None else found.id


def _tools(body: ResponseRequest) -> list[dict[str, Any]]:
    """The function tools offered, as the response object shows them; other types refused."""
    tools: list[dict[str, Any]] = []
    for index, tool in enumerate(body.tools or []):
        if tool.type != "function":
            raise unsupported(
                f"tools[{index}].type",
                f"tools of type {tool.type} are not supported: only function tools (your code runs them)",
            )
        if tool.name is None:
            raise _invalid(f"tools[{index}].name", f"tools[{index}].name: a function tool needs its name")
        strict = True if tool.strict is None else tool.strict
        tools.append(
            {
                "type": "function",
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.parameters,
                "strict": strict,
            }
        )
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        if choice.type != "function":
            raise unsupported("tool_choice.type", f"tool_choice of type {choice.type} is not supported: use function")
        if choice.name is None:
            raise _invalid("tool_choice.name", "tool_choice.name: name the function to call")
        if choice.name not in {t["name"] for t in tools}:
            raise _invalid("tool_choice", f"tool_choice names {choice.name}, which is not in tools")
    elif choice == "required" and not tools:
        raise _invalid("tool_choice", "tool_choice required needs tools")
    return tools


def _refuse_reasoning(body: ResponseRequest) -> None:
    """A `reasoning` that asks for nothing (every option null) is no refusal."""
    extra = body.model_extra
    reasoning = extra.get("reasoning") if extra else None
    if extra is not None and isinstance(reasoning, dict) and all(v is None for v in reasoning.values()):
        del extra["reasoning"]


class Call:
    """A create call as the gateway runs it: the request, what the response echoes, its
    input items and the chain before it."""

    def __init__(
        self,
        native: InferRequest,
        settings: ResponseSettings,
        items: list[dict[str, Any]],
        chain: list[str],
        context: list[dict[str, Any]] | None = None,
    ) -> None:
        self.native, self.settings, self.items, self.chain = native, settings, items, chain
        self.context = context or []  # the items given before its own (chain or conversation)
        self.context_bytes = sum(item_bytes(item) for item in self.context)


def _check_call_ids(context: list[dict[str, Any]], items: list[dict[str, Any]]) -> None:
    """Each function_call_output answers a function_call made before it (in the chain, the
    conversation or the input), as OpenAI checks."""
    called = {str(item.get("call_id")) for item in context if item.get("type") == "function_call"}
    for index, item in enumerate(items):
        if item["type"] == "function_call":
            called.add(str(item["call_id"]))
        elif item["type"] == "function_call_output" and str(item["call_id"]) not in called:
            raise _invalid(
                f"input[{index}].call_id",
                f"input[{index}].call_id: no function call with call_id {item['call_id']} comes before this "
                "function_call_output (in the input, or the previous response's output)",
            )


async def _summaries(
    svc: Services, who: Caller, context: list[dict[str, Any]], items: list[dict[str, Any]]
) -> dict[str, str]:
    """The summaries the compaction items given name (refused by place when not kept)."""
    references = [
        (f"input[{index}].encrypted_content" if index >= 0 else "previous_response_id", str(item["encrypted_content"]))
        for index, item in [(-1, i) for i in context] + list(enumerate(items))
        if item.get("type") == "compaction"
    ]
    return await CompactionStore(svc).summaries(who.scope, references) if references else {}


async def response_call(
    body: ResponseRequest, svc: Services, who: Caller, previous: list[dict[str, Any]] | None = None
) -> Call:
    """The call as a request. `previous`: the items of previous_response_id when the caller
    holds them (a WebSocket's store: false responses), instead of reading its chain."""
    adapter = common.llm(svc, body.model, chat=True)
    items = input_items(body)
    tools = _tools(body)
    _refuse_reasoning(body)
    refuse_unsupported(body, "responses")
    run_as = common.tier(body.service_tier)
    for index, item in enumerate(body.include or []):
        if item != INCLUDE_LOGPROBS:
            raise unsupported(f"include[{index}]", f"include {item} is not supported: only {INCLUDE_LOGPROBS}")
    if body.store is False and body.background:
        raise _invalid("store", "a background response needs store: true (it is read back by its id)")
    if body.stream_options is not None and not body.stream:
        raise _invalid("stream_options", "stream_options is only allowed when stream is true")
    # top_logprobs asks for log-probabilities as much as the include does.
    logprobs = INCLUDE_LOGPROBS in (body.include or []) or bool(body.top_logprobs)
    settings = _settings(body, tools, logprobs)
    plan = settings.plan(common.tool_format(svc, body.model))
    chain: list[str] = []
    context: list[dict[str, Any]] = []
    if body.previous_response_id and settings.conversation:
        raise _invalid("conversation", "previous_response_id and conversation cannot both be given")
    if body.previous_response_id and previous is not None:
        context = previous
    elif body.previous_response_id:
        chain, context = await _continued(svc, who, body.previous_response_id)
    if settings.conversation:
        if not settings.store:
            raise _invalid("store", "a response in a conversation is kept with it: it needs store: true")
        await conversation_of(svc, who, settings.conversation, "conversation")
        context = await conversation_items(svc, who, settings.conversation)
    if not items and not context:
        raise _invalid("input", "input must not be empty")
    _check_call_ids(context, items)
    messages = chat_messages(context + items, await _summaries(svc, who, context, items))
    if body.instructions:
        messages.insert(0, Message(role="system", content=body.instructions))
    inputs: dict[str, Any] = {
        "messages": common.messages(messages),
        "max_tokens": body.max_output_tokens or common.DEFAULT_MAX_TOKENS,
    }
    if plan.tools:
        common.require(adapter, "tools", "tools")
        inputs["tools"] = plan.tools
    text_format = body.text.format if body.text is not None else None
    if plan.forced:
        common.require(adapter, "guided_decoding", "tool_choice", "a forced tool call (tool_choice required or named)")
        # (The output is the call alone: a text.format, for text, has nothing to shape.)
        schema = toolcalls.forced_call_schema(plan.tools or [])
        inputs["guided_decoding"] = {"guide_type": "json_schema", "guide": json.dumps(schema)}
    elif text_format is not None and text_format.type != "text":
        common.require(adapter, "guided_decoding", "text.format", f"text.format {text_format.type}")
        if text_format.type == "json_object":
            guide: dict[str, Any] = {"type": "object"}
        elif text_format.schema_:
            guide = text_format.schema_
        else:
            raise _invalid("text.format.schema", "json_schema needs a schema")
        inputs["guided_decoding"] = {"guide_type": "json_schema", "guide": json.dumps(guide)}
    labels = common.metadata(body, "responses", run_as) | {"background": "true" if body.background else "false"}
    if not settings.store:
        labels["store"] = "false"
    native = parameters(
        body,
        adapter,
        logprobs=logprobs,
        top_logprobs=body.top_logprobs or 0,
        prompt_cache_key=body.prompt_cache_key,
    )
    request = InferRequest(
        model=body.model,
        inputs=inputs,
        parameters=native,
        stream=bool(body.stream or body.background),
        metadata=labels,
        priority=run_as.priority,
        timeout_s=common.timeout_for(svc, run_as),
    )
    return Call(request, settings, items, chain, context)


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


async def _continued(svc: Services, who: Caller, previous: str) -> tuple[list[str], list[dict[str, Any]]]:
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
            f"previous response {previous} is still {_STATUS[outcome.status]}: continue it once it has ended",
            details={"param": "previous_response_id"},
        )
    return chain, await _chain_items(svc, who, chain, {previous: document})


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
        items += output_of(record, settings, common.tool_format(svc, record.model)).items
    return items


async def _chain_items(
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
            raise _invalid("after", f"no item {after} in {conversation}")
        entry, items = found
        ordered = items[::-1] if descending else items
        page = ordered[[item.get("id") for item in ordered].index(after) + 1 :]
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
            if any(_function_call_id(request_id, n) == item_id for n in range(int(candidate["calls"]))):
                entry = candidate
                break
    if entry is None:
        return None
    ((_, items),) = await _expand(svc, who, [entry])
    return (entry, items) if any(item.get("id") == item_id for item in items) else None


async def _kept(svc: Services, who: Caller, response: str) -> dict[str, Any] | None:
    """The stored response's document: 404 for one deleted or created with store: false."""
    document = await ResponseStore(svc).get(who.scope, response)
    if document is not None and document.get("deleted"):
        raise ApiError(404, "not_found", f"response {response} was deleted")
    return document


async def _read(svc: Services, who: Caller, response: str) -> tuple[ResultRecord | LiveStatus, ResponseSettings]:
    request_id = request_id_of(response)
    document = await _kept(svc, who, response)
    outcome = await svc.results.get(request_id, who.scope)
    if document is None and outcome.metadata.get("store") == "false":
        raise ApiError(404, "not_found", f"response {response} was created with store: false: it is not kept")
    if outcome.metadata.get("api") != "responses":
        raise ApiError(404, "not_found", f"no response {response}")
    settings = ResponseSettings.model_validate(document["settings"]) if document else settings_of_record(outcome)
    return outcome, settings


# -- streams ------------------------------------------------------------------------------------


class ResponseEvents:
    """OpenAI's response events from the request's own events, numbered as they go."""

    def __init__(
        self,
        request_id: str,
        model: str,
        created_at: int,
        settings: ResponseSettings,
        tpb: int = 32,
        tool_format: toolcalls.ToolFormat | None = None,
        obfuscate: bool = True,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.created_at = created_at
        self.settings = settings
        self.tpb = tpb
        self.tool_format = tool_format
        self.obfuscate = obfuscate
        self.sequence = -1
        self.output = Output(request_id, settings.plan(tool_format), settings.max_calls)

    def _event(self, kind: str, **fields: Any) -> tuple[int, dict[str, Any]]:
        self.sequence += 1
        return self.sequence, {"type": kind, "sequence_number": self.sequence, **fields}

    def _live(self, status: str) -> dict[str, Any]:
        return blank_object(self.request_id, self.model, self.created_at, status, self.settings)

    def _steps(self, steps: list[Step]) -> Iterator[tuple[int, dict[str, Any]]]:
        for kind, fields in steps:
            if self.obfuscate and kind.endswith(".delta"):
                fields = {**fields, "obfuscation": common.obfuscation(fields["delta"])}
            yield self._event(kind, **fields)

    def of(self, event: StreamEvent) -> Iterator[tuple[int, dict[str, Any]]]:
        if event.kind == "queued":
            status = "queued" if self.settings.background else "in_progress"
            yield self._event("response.created", response=self._live(status))
            if self.settings.background:
                yield self._event("response.queued", response=self._live(status))
        elif event.kind == "running" and not self.output.started:
            yield self._event("response.in_progress", response=self._live("in_progress"))
            yield from self._steps(self.output.start())
        elif event.kind == "token":
            yield from self._steps(self.output.feed(common.token_text(event)))
        elif event.terminal:
            record = common.record_of(event)
            yield from self._steps(self.output.finish(record))
            final = response_object(record, self.settings, self.tpb, self.tool_format, self.output.items)
            kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(final["status"])
            yield self._event(kind or "response.failed", response=final)


async def response_events(
    svc: Services,
    request_id: str,
    model: str,
    settings: ResponseSettings,
    after: int,
    *,
    cancel_on_disconnect: bool,
    obfuscate: bool = True,
) -> AsyncIterator[dict[str, Any]]:
    """A response's events (as JSON objects) after sequence number `after`, read from its
    request's own events (in Redis): the same for SSE and for a WebSocket."""
    tpb = common.tokens_per_block(svc, model)
    # (The time in the request's id: the same in a resumed stream as in the first.)
    created = int(request_id_time(request_id) or time.time())
    numbering = ResponseEvents(request_id, model, created, settings, tpb, common.tool_format(svc, model), obfuscate)
    events = common.follow(svc, request_id) if cancel_on_disconnect else svc.events.follow(request_id, "0-0")
    async for event in events:
        for sequence, payload in numbering.of(event):
            if sequence > after:
                yield payload


async def _stream(
    svc: Services,
    request_id: str,
    model: str,
    settings: ResponseSettings,
    after: int,
    *,
    cancel_on_disconnect: bool,
    obfuscate: bool = True,
) -> AsyncIterator[ServerSentEvent]:
    events = response_events(
        svc, request_id, model, settings, after, cancel_on_disconnect=cancel_on_disconnect, obfuscate=obfuscate
    )
    async for payload in events:
        yield ServerSentEvent(data=json.dumps(payload, ensure_ascii=False), event=payload["type"])


# -- routes -------------------------------------------------------------------------------------


async def keep(svc: Services, who: Caller, call: Call, request_id: str, model: str) -> None:
    """Keep a stored response's settings and input items (and its place in its
    conversation); nothing for store: false."""
    settings = call.settings
    store = ResponseStore(svc)
    # (An Idempotency-Key's replay names a response already kept: it is not kept again.)
    if not settings.store or await store.get(who.scope, response_id(request_id)) is not None:
        return
    given = with_ids(call.items, request_id)
    document = {
        "model": model,
        "settings": settings.model_dump(),
        "input": given,
        "chain": call.chain,
        "context_bytes": call.context_bytes,
    }
    try:
        if settings.conversation:
            calls = settings.max_calls if settings.tools else 0
            entry = response_entry(response_id(request_id), given, f"msg_{request_id}", calls)
            (document["position"],) = await ConversationStore(svc).append(who.scope, settings.conversation, [entry])
        await store.put(who.scope, response_id(request_id), document)
    except Exception:
        await spine.cancel(svc.jobs, request_id)  # nothing half done: no response without its settings
        raise


@router.post("/responses", summary="Create a response (OpenAI Responses API)")
async def create_response(body: ResponseRequest, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    svc = services(request)
    call = await response_call(body, svc, who)
    settings = call.settings
    (request_id,) = await common.start(svc, who, request, [call.native], flex=common.tier(body.service_tier).flex)
    headers = {"x-request-id": request_id}
    await keep(svc, who, call, request_id, body.model)
    tpb = common.tokens_per_block(svc, body.model)
    fmt = common.tool_format(svc, body.model)
    if body.stream:
        obfuscate = body.stream_options is None or body.stream_options.include_obfuscation
        # A background stream survives a disconnect (resume it with starting_after).
        stream = _stream(
            svc, request_id, body.model, settings, -1, cancel_on_disconnect=not body.background, obfuscate=obfuscate
        )
        return EventStream(stream, ping=svc.settings.sse_ping_s, headers=headers)
    if body.background:
        outcome = await svc.results.get(request_id, who.scope)
        # Accepted just now: queued (unless an Idempotency-Key named one that has ended).
        status = None if outcome.status.terminal else "queued"
        return JSONResponse(response_object(outcome, settings, tpb, fmt, status=status), headers=headers)
    record = await common.wait_record(svc, who, request_id, call.native.timeout_s or svc.settings.default_timeout_s)
    return JSONResponse(response_object(record, settings, tpb, fmt), headers=headers)


@router.get("/responses/{response}", summary="Get a response; stream=true resumes its events")
async def get_response(
    response: str,
    request: Request,
    who: Annotated[Caller, Depends(caller)],
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=-1, le=10_000_000)] = None,
) -> Any:
    svc = services(request)
    outcome, settings = await _read(svc, who, response)
    model = outcome.model
    if not stream:
        return JSONResponse(
            response_object(outcome, settings, common.tokens_per_block(svc, model), common.tool_format(svc, model))
        )
    request_id = request_id_of(response)
    job = await svc.results.job(request_id, who.scope)
    if job is None:
        raise ApiError(410, "stream_expired", f"the events of {response} are no longer kept; GET it without stream")
    after = -1 if starting_after is None else starting_after
    return EventStream(
        _stream(svc, request_id, model, settings, after, cancel_on_disconnect=False),
        ping=svc.settings.sse_ping_s,
    )


def check_include(request: Request) -> None:
    """The `include` of a list of items: only the output text's log-probabilities."""
    include = request.query_params.getlist("include") + request.query_params.getlist("include[]")
    for index, item in enumerate(include):
        if item != INCLUDE_LOGPROBS:
            raise unsupported(f"include[{index}]", f"include {item} is not supported: only {INCLUDE_LOGPROBS}")


@router.get("/responses/{response}/input_items", summary="List the items a response was given")
async def list_input_items(
    response: str,
    request: Request,
    who: Annotated[Caller, Depends(caller)],
    after: Annotated[str | None, Query(max_length=256)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> Any:
    svc = services(request)
    check_include(request)
    await _read(svc, who, response)
    document = await _kept(svc, who, response)
    if document is None:
        raise ApiError(404, "not_found", f"the input items of {response} were not kept")
    items = await _chain_items(svc, who, list(document.get("chain", []))) + list(document.get("input", []))
    conversation = (document.get("settings") or {}).get("conversation")
    if conversation and await ConversationStore(svc).get(who.scope, conversation) is not None:
        items = await conversation_items(svc, who, conversation, document.get("position")) + items
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise _invalid("after", f"no item {after} in the input items of {response}")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


@router.delete("/responses/{response}", summary="Delete a stored response")
async def delete_response(response: str, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    svc = services(request)
    outcome, _ = await _read(svc, who, response)
    if not outcome.status.terminal:
        await spine.cancel(svc.jobs, outcome.request_id)  # deleted: nobody could read what it makes
    await ResponseStore(svc).delete(who.scope, response)
    return JSONResponse({"id": response, "object": "response", "deleted": True})


@router.post("/responses/{response}/cancel", summary="Cancel a background response")
async def cancel_response(response: str, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    svc = services(request)
    outcome, settings = await _read(svc, who, response)
    if not outcome.status.terminal:
        await spine.cancel(svc.jobs, outcome.request_id)
        outcome = await svc.results.wait(outcome.request_id, 5.0, who.scope)
    model = outcome.model
    return JSONResponse(
        response_object(outcome, settings, common.tokens_per_block(svc, model), common.tool_format(svc, model))
    )


def _without_bytes(logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The logprobs as the output_text.done event carries them: OpenAI's event has no
    `bytes` (the output_text part has them)."""
    return [
        {
            "token": entry["token"],
            "logprob": entry["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in entry.get("top_logprobs", [])],
        }
        for entry in logprobs
    ]

