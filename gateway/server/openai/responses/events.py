"""OpenAI's response stream events, numbered, from the request's own events (the same for
SSE and for a WebSocket)."""

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from gateway.protocol import request_id_time
from gateway.server.calls import requests as call_requests
from gateway.server.calls import run
from gateway.server.llm import tools as toolcalls
from gateway.server.openai import common
from gateway.server.openai.responses.items import (
    Output,
    Step,
)
from gateway.server.openai.responses.objects import blank_object, response_object
from gateway.server.openai.responses.settings import (
    ResponseSettings,
    namespaces,
)
from gateway.server.results.events import StreamEvent
from gateway.server.services import Services

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
        self.output = Output(request_id, settings.plan(tool_format), settings.max_calls, namespaces(settings.tools))

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
            yield from self._steps(self.output.feed(run.token_text(event)))
        elif event.terminal:
            record = run.record_of(event)
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
    tenant: str,
    cancel_on_disconnect: bool,
    obfuscate: bool = True,
) -> AsyncIterator[dict[str, Any]]:
    """A response's events (as JSON objects) after sequence number `after`, read from its
    request's own events (in Redis), held against the share of `tenant` (the caller's):
    the same for SSE and for a WebSocket."""
    tpb = call_requests.tokens_per_block(svc, model)
    # (The time in the request's id: the same in a resumed stream as in the first.)
    created = int(request_id_time(request_id) or time.time())
    numbering = ResponseEvents(
        request_id, model, created, settings, tpb, call_requests.tool_format(svc, model), obfuscate
    )
    events = (
        run.follow(svc, request_id, tenant)
        if cancel_on_disconnect
        else svc.events.follow(request_id, "0-0", tenant=tenant)
    )
    async for event in events:
        for sequence, payload in numbering.of(event):
            if sequence > after:
                yield payload
