"""The answer to POST /infer: a request accepted at once (it is in Redis before the answer
goes out). The route itself, its checks and its OpenAPI entry are gateway.server.api.hot."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from contextlib import ExitStack, nullcontext

from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from gateway.protocol import State
from gateway.protocol.http import Accepted, InferRequest, result_urls
from gateway.server.api.events import SSE_HEADERS, sse_events
from gateway.server.api.sse import EventStream
from gateway.server.api.tenancy import Caller
from gateway.server.errors import Refused
from gateway.server.services import Services

_PREFER_WAIT = re.compile(r"(?:^|[,;\s])wait\s*=\s*(\d{1,6}(?:\.\d{1,6})?)", re.IGNORECASE)


def location(request_id: str) -> dict[str, str]:
    return {"Location": f"/results/{request_id}"}


def accepted(request_id: str, status: State) -> JSONResponse:
    body = Accepted(request_id=request_id, status=status, urls=result_urls(request_id))
    return JSONResponse(body.model_dump(mode="json"), status_code=202, headers=location(request_id))


def prefer_wait(prefer: str | None, limit: float) -> float | None:
    match = _PREFER_WAIT.search(prefer or "")
    return min(float(match.group(1)), limit) if match else None


async def infer_response(
    svc: Services,
    who: Caller,
    body: InferRequest,
    idempotency_key: str | None,
    prefer: str | None,
    accept: str | None,
) -> Response | Carried:
    """The answer to POST /infer, its key, body and headers checked (gateway.server.api.hot)."""
    wait = prefer_wait(prefer, svc.settings.max_wait_s)
    stream = bool(accept and "text/event-stream" in accept)
    # Waited for, and started here: carried to its end by this call's own task (Carried),
    # unless its tenant holds its share of the long polls (answered at once: answer()).
    carry_here = bool(wait) and not stream and svc.events.room_for(who.tenant)
    submission = await svc.submitter.submit(who, body, idempotency_key=idempotency_key, carry_here=carry_here)
    request_id = submission.request_id
    if submission.carry is not None and wait:
        return Carried(svc, who, request_id, wait, submission.carry)
    if submission.existing:
        return await answer(svc, who, request_id, wait)
    if wait and not stream:
        # Started here (held by the dispatcher after all): nothing to read yet. Watch for its
        # end first (no await since it was started, so the end cannot come before the
        # watch), read only if it does not come.
        # Queued: another process may have taken and ended it meanwhile: read first.
        return await answer(svc, who, request_id, wait, fresh=submission.started_here)
    if stream:
        return EventStream(
            sse_events(svc, request_id, "0-0", who.tenant),
            ping=svc.settings.sse_ping_s,
            headers={**SSE_HEADERS, **location(request_id)},
        )
    if not wait:
        return accepted(request_id, State.QUEUED)
    return await answer(svc, who, request_id, wait)


class Carried:
    """The answer to a `Prefer: wait` POST /infer whose request SUBMIT started in this
    process, as an ASGI app: the request carried to its end in the call's own task (run,
    finish, deliver: spine.carry), the record's JSON as FINISH wrote it the 200's body,
    with no task, future or read between. Past the wait, the 202 with its state goes out
    first (from a task made then) and the run goes on in this task: ASGI lets an app go
    on after its response. A run that does not finish it (another run took the request
    over; this process hands it on as it stops) is answered with what a read finds."""

    def __init__(
        self, svc: Services, who: Caller, request_id: str, wait: float, carry: Callable[[], Awaitable[str | None]]
    ) -> None:
        self.svc, self.who, self.request_id, self.wait, self.carry = svc, who, request_id, wait, carry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        late: asyncio.Task[None] | None = None
        waiting = ExitStack()  # a place of the long polls' pool until the answer, as answer()'s
        wait = self.wait
        try:
            waiting.enter_context(self.svc.events.holding(self.who.tenant))
        except Refused:
            wait = 0  # its tenant's share taken meanwhile: answered at once, as answer() would

        def wait_over() -> None:
            nonlocal late
            waiting.close()
            late = loop.create_task(self._answer(scope, receive, send, None))

        timer = loop.call_later(wait, wait_over)  # a handle, cancelled: no iteration of its own
        try:
            record = await self.carry()
        finally:
            timer.cancel()
            waiting.close()
            if late is not None:
                await late
        if late is not None:
            return  # answered 202 at the wait's end
        if record is None:
            await self._answer(scope, receive, send, None)
            return
        headers = {**location(self.request_id), "Preference-Applied": f"wait={self.wait:g}"}
        await Response(record, status_code=200, headers=headers, media_type="application/json")(scope, receive, send)

    async def _answer(self, scope: Scope, receive: Receive, send: Send, wait: float | None) -> None:
        try:
            response: Response = await answer(self.svc, self.who, self.request_id, wait)
        except Exception:  # its state unread (Redis away): accepted, running here all the same
            response = accepted(self.request_id, State.RUNNING)
        await response(scope, receive, send)


async def answer(svc: Services, who: Caller, request_id: str, wait: float | None, fresh: bool = False) -> Response:
    """200 with the result if it has ended (within wait), else 202 with the state. fresh:
    the request was accepted by this very call. A tenant that holds its share of the
    process's long polls is answered at once (its request is accepted all the same)."""
    if wait and not svc.events.room_for(who.tenant):
        wait = None
    with svc.events.holding(who.tenant) if wait else nullcontext():
        final, body, status = await svc.results.wait_json(request_id, wait or 0, who.scope, fresh=fresh)
    if final:
        headers = {**location(request_id), **({"Preference-Applied": f"wait={wait:g}"} if wait else {})}
        return Response(body, status_code=200, headers=headers, media_type="application/json")
    return accepted(request_id, status)
