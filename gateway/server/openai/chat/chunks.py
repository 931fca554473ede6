"""The chunks of a streamed chat completion or completion (ChunkStream), from the events of
its requests, and the random padding of their deltas (Pads)."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import ServerSentEvent

from gateway.protocol import ResultRecord, State
from gateway.server.api.sse import FrameTemplate, json_value
from gateway.server.calls import run, terms
from gateway.server.calls.terms import ChatPlan, read_calls
from gateway.server.llm import tools as toolcalls
from gateway.server.openai import common
from gateway.server.openai.chat.objects import completion_logprobs, head
from gateway.server.openai.chat.plan import chat_plan, tool_call
from gateway.server.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.server.services import Services


class Pads:
    """Random padding for one stream's deltas (common.obfuscation's), cut from a pool drawn 4 KB
    at a time: drawing for each delta cost more than the rest of its frame."""

    def __init__(self) -> None:
        self.pool, self.at = "", 0

    def take(self, length: int) -> str:
        """Padding that brings a text of `length` characters to a multiple of 16."""
        size = 16 - length % 16
        if self.at + size > len(self.pool):
            self.pool, self.at = secrets.token_urlsafe(3072), 0
        self.at += size
        return self.pool[self.at - size : self.at]


class ChunkStream:
    """The chunks of a streamed chat completion or completion, from the events of its
    requests (one per choice)."""

    def __init__(
        self,
        request_ids: list[str],
        body: ChatCompletionRequest | CompletionRequest,
        tpb: int,
        tool_format: toolcalls.ToolFormat | None = None,
    ) -> None:
        self.request_ids = request_ids
        self.body = body
        self.tpb = tpb
        self.chat = isinstance(body, ChatCompletionRequest)
        self.plan = chat_plan(body, tool_format) if isinstance(body, ChatCompletionRequest) else ChatPlan()
        options = body.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.obfuscate = options is None or options.include_obfuscation
        self.parsers = [
            toolcalls.StreamParser(self.plan.tool_format, tools=self.plan.tools)
            if self.plan.tools and not self.plan.forced
            else None
            for _ in request_ids
        ]
        self.held = [""] * len(request_ids)  # a forced call's text, parsed at the end
        self.calls = [0] * len(request_ids)  # tool calls sent per choice
        self.offsets = [0] * len(request_ids)  # text sent per choice (completions' text_offset)
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        self.base = head(kind, request_ids[0], common.created(), body.model, terms.tier(body.service_tier))
        self.templates: dict[int, FrameTemplate] = {}  # a choice's text delta (_text_frame)
        self.pads = Pads()

    def _text_frame(self, index: int, text: str) -> bytes:
        """A chat delta of text, from the choice's template: the same frame _event makes."""
        template = self.templates.get(index)
        if template is None:
            delta = {"content": FrameTemplate.hole(0)}
            choice = {"index": index, "delta": delta, "finish_reason": None, "logprobs": None}
            payload: dict[str, Any] = {**self.base, "choices": [choice]}
            if self.include_usage:
                payload["usage"] = None
            if self.obfuscate:
                payload["obfuscation"] = FrameTemplate.hole(1)
            template = self.templates[index] = FrameTemplate(payload)
        if self.obfuscate:
            return template.fill(json_value(text), f'"{self.pads.take(len(text))}"')
        return template.fill(json_value(text))

    def _event(self, choice: dict[str, Any], text: str = "") -> ServerSentEvent:
        payload: dict[str, Any] = {**self.base, "choices": [choice]}
        if self.include_usage:
            payload["usage"] = None
        if self.obfuscate:
            payload["obfuscation"] = common.obfuscation(text)
        return ServerSentEvent(data=json.dumps(payload, ensure_ascii=False))

    def _delta(self, index: int, delta: dict[str, Any]) -> ServerSentEvent:
        if self.chat:
            return self._event({"index": index, "delta": delta, "finish_reason": None, "logprobs": None})
        text = str(delta.get("content", ""))
        return self._event({"index": index, "text": text, "finish_reason": None, "logprobs": None}, text)

    def _pieces(
        self, index: int, request_id: str, items: list[str | toolcalls.ToolCall]
    ) -> list[ServerSentEvent | bytes]:
        events: list[ServerSentEvent | bytes] = []
        for item in items:
            if isinstance(item, str):
                if item:
                    events.append(self._text(index, item))
            elif self.plan.parallel or self.calls[index] == 0:
                call = tool_call(request_id, self.calls[index], item)
                events.append(self._delta(index, {"tool_calls": [{"index": self.calls[index], **call}]}))
                self.calls[index] += 1
        return events

    def _text(self, index: int, text: str) -> ServerSentEvent | bytes:
        self.offsets[index] += len(text)
        if self.chat:
            return self._text_frame(index, text)
        return self._delta(index, {"content": text})

    def on_token(self, index: int, request_id: str, text: str) -> list[ServerSentEvent | bytes]:
        if not text:
            return []
        if self.plan.forced:
            self.held[index] += text
            return []
        parser = self.parsers[index]
        if parser is not None:
            return self._pieces(index, request_id, parser.feed(text))
        return [self._text(index, text)]

    def on_end(self, index: int, record: ResultRecord) -> list[ServerSentEvent | bytes]:
        events: list[ServerSentEvent | bytes] = []
        parser = self.parsers[index]
        if parser is not None:
            events += self._pieces(index, record.request_id, parser.finish())
        if self.plan.forced:
            content, calls = read_calls(self.held[index], self.plan)
            items: list[str | toolcalls.ToolCall] = [*calls] if calls else [content or ""]
            events += self._pieces(index, record.request_id, items)
        reason = run.finish_reason(record)  # a call cut by max_tokens says "length"
        finish = "tool_calls" if self.calls[index] and reason != "length" else reason
        entries = run.logprobs_of(record)
        if self.chat:
            logprobs = {"content": entries, "refusal": None} if self.plan.logprobs else None
            choice = {"index": index, "delta": {}, "finish_reason": finish, "logprobs": logprobs}
        else:
            body = self.body
            wanted = isinstance(body, CompletionRequest) and body.logprobs is not None
            logprobs = completion_logprobs(entries) if wanted else None
            choice = {"index": index, "text": "", "finish_reason": finish, "logprobs": logprobs}
        events.append(self._event(choice))
        return events

    async def events(self, svc: Services, tenant: str) -> AsyncIterator[ServerSentEvent | bytes]:
        if self.chat:
            for index in range(len(self.request_ids)):
                yield self._delta(index, {"role": "assistant", "content": ""})
        records: list[ResultRecord] = []
        async for index, event in run.follow_all(svc, self.request_ids, tenant):
            if event.kind == "token":
                for chunk in self.on_token(index, self.request_ids[index], run.token_text(event)):
                    yield chunk
            elif event.terminal:
                record = run.record_of(event)
                if record.status != State.SUCCEEDED:
                    code = record.error.code if record.error else record.status.value
                    message = record.error.message if record.error else f"the request was {record.status.value}"
                    error = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
                    yield ServerSentEvent(data=json.dumps(error))
                    break  # (the other choices' requests are cancelled as the stream ends)
                records.append(record)
                for chunk in self.on_end(index, record):
                    yield chunk
        else:
            if self.include_usage:
                usage = common.usage(records, self.tpb)
                yield ServerSentEvent(data=json.dumps({**self.base, "choices": [], "usage": usage}))
        yield ServerSentEvent(data="[DONE]")
