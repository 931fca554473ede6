"""A response's items: the input items a call gives (refused by their place when not
served), as chat messages; and the output items read from the generated text, with the
steps (stream events) that tell of them."""

import copy
import hashlib
from typing import Annotated, Any

from fastapi import Depends, Request

from gateway.protocol import ResultRecord, State
from gateway.server.calls import run, terms
from gateway.server.calls.terms import CalledFunction, ChatPlan, Message, ToolCall, unsupported
from gateway.server.llm import tools as toolcalls
from gateway.server.openai.paging import ItemsPage, items_page
from gateway.server.openai.responses.settings import (
    ResponseSettings,
    invalid,
    namespaces,
    qualified,
)
from gateway.server.openai.schemas import (
    INCLUDE_LOGPROBS,
    RESPONSE_TEXT_PARTS,
    CompactionItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    ResponseContentPart,
    ResponseInputMessage,
    ResponseRequest,
)

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
            raise invalid(f"{where}[{index}].text", f"{where}[{index}].text: a text part needs its text")
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
            if given.namespace is not None:
                item["namespace"] = given.namespace
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
            name = qualified(item.get("namespace"), item["name"])  # (as the model was offered it)
            call = ToolCall(id=item["call_id"], function=CalledFunction(name=name, arguments=item["arguments"]))
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


def function_call_id(request_id: str, index: int) -> str:
    return "fc_" + terms.call_id(request_id, index).removeprefix("call_")


Step = tuple[str, dict[str, Any]]


class Output:
    """A response's output items from its generated text as it comes, and the steps (event
    type and fields) that tell of them: a message for the text, a function_call item for each
    call, in the order they begin. The same for a stream and for a finished record, so both
    read alike."""

    def __init__(
        self, request_id: str, plan: ChatPlan, max_calls: int, spaces: dict[str, tuple[str, str]] | None = None
    ) -> None:
        self.request_id = request_id
        self.spaces = spaces or {}  # a namespace's functions, by the name the model calls
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
        cut = succeeded and run.finish_reason(record) == "length"
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
            logprobs = run.logprobs_of(record)
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": logprobs}
            where = {"item_id": self.message_id, "output_index": self.message, "content_index": 0}
            message = self.items[self.message]
            message.update(status=status, content=[part])
            steps.append(
                ("response.output_text.done", {**where, "text": self.text, "logprobs": without_bytes(logprobs)})
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
            "id": function_call_id(self.request_id, number),
            "type": "function_call",
            "status": "in_progress",
            "call_id": terms.call_id(self.request_id, number),
            "name": call.name,
            "arguments": "",
        }
        if call.name in self.spaces:  # answered under the names the client gave
            item["namespace"], item["name"] = self.spaces[call.name]
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
    output = Output(record.request_id, settings.plan(tool_format), settings.max_calls, namespaces(settings.tools))
    if record.started_at is not None or record.status == State.SUCCEEDED:
        output.start()  # (as the stream did when it began)
    output.feed(str((record.outputs or {}).get("text_output") or ""))
    output.finish(record)
    return output


def without_bytes(logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
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


def check_include(request: Request) -> None:
    """The `include` of a list of items: only the output text's log-probabilities."""
    include = request.query_params.getlist("include") + request.query_params.getlist("include[]")
    for index, item in enumerate(include):
        if item != INCLUDE_LOGPROBS:
            raise unsupported(f"include[{index}]", f"include {item} is not supported: only {INCLUDE_LOGPROBS}")


def items_list(request: Request, page: Annotated[ItemsPage, Depends(items_page)]) -> ItemsPage:
    """The page a list of items (a conversation's, a response's input items) asks for, its
    `include` checked: the dependency of both list routes."""
    check_include(request)
    return page
