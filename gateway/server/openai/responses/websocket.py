"""WebSocket mode of the Responses API: `GET /v1/responses` upgraded to a WebSocket, as
OpenAI and the Open Responses specification define it.

- The key: `Authorization: Bearer <key>` on the upgrade (the edge passes WebSocket scopes
  through unread; this route checks the key before it accepts, answering 401 in OpenAI's
  error shape, and again for each response.create, so a key revoked meanwhile stops it).
- Each text message is a client event: `response.create` with the body of POST
  /v1/responses (`stream` is implicit; `background` is refused). The server answers with
  the same events as the SSE stream, each one JSON message, numbered alike. One response
  is in flight per socket: a response.create meanwhile is refused (response_in_progress).
- A refusal or failure is an `error` event ({type, status, error: {type, code, message,
  param}}); the socket stays open.
- `store: false`: the response is kept for the connection only: a later response.create
  on the same socket continues it with previous_response_id (the most recent one only);
  on another socket it is previous_response_not_found. A continuation that fails evicts
  the response it named. Stored responses continue from MongoDB as over HTTP.
- A response keeps running when its socket closes: a new socket opened with
  `?response_id=<id>&starting_after=<sequence_number>` gets the events after that one,
  from the request's event stream in Redis (the openai client's on_reconnecting can set
  that query), then takes response.create messages as any socket. The resumed response
  object echoes the settings it was made with: a stored one's from MongoDB, a store:
  false one's from Redis (store.UnstoredSettings, kept as long as its events).
- A socket is closed RESPONSES_WS_MAX_S (60 minutes) after it opened: once its response
  in flight has ended, an error event websocket_connection_limit_reached, then close
  1000; and after RESPONSES_WS_IDLE_S (5 minutes) with no client message and no response
  in flight: an error event websocket_idle_timeout, then close 1000.
- Bounded as an HTTP call is: a message is at most MAX_BODY_BYTES (uvicorn closes the
  socket 1009 from the frame's header, before reading it) and never deflated (serve.py);
  a process holds RESPONSES_WS_MAX sockets, a tenant its share of them (429
  tenant_share_exceeded on the upgrade, before it is accepted; 503 too_many_websockets
  when all are held); a response.create is refused (429 tenant_share_exceeded, nothing
  submitted) while the tenant holds its share of the event streams it would follow.
- The edge passes WebSocket scopes through, so this route does its part: the key before
  the accept, X-Request-ID (taken or made, bound into the logs and answered on the
  upgrade), one access line when the socket ends and the requests counter."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from fastapi import APIRouter, WebSocket
from pydantic import ValidationError
from starlette.websockets import WebSocketDisconnect

from gateway.common.logs import bind_request_ids, clear_request_ids
from gateway.server.api.edge import access_log, loggable_path
from gateway.server.api.errors import ApiError, ErrorRenderer
from gateway.server.api.request_id import HEADER, accepted_trace_id, bind_trace_id
from gateway.server.api.tenancy import Caller, identify
from gateway.server.calls import terms
from gateway.server.errors import Refused
from gateway.server.openai.errors import openai_error, openai_error_body
from gateway.server.openai.responses.call import keep, response_call
from gateway.server.openai.responses.events import response_events
from gateway.server.openai.responses.items import with_ids
from gateway.server.openai.responses.settings import ResponseSettings, request_id_of, settings_of_record
from gateway.server.openai.responses.store import ResponseStore, UnstoredSettings, item_bytes
from gateway.server.openai.schemas import ResponseRequest
from gateway.server.services import Services
from gateway.server.tenants.shares import SharedPool, share_of

log = logging.getLogger(__name__)

PATH = "/v1/responses"
# Errors in OpenAI's shape (no metrics callback: a socket's refusals are its own events).
_ERRORS = ErrorRenderer(renderers={"/v1/": openai_error})
# What the edge counts as a JSON body's values (gateway.server.api.edge).
_JSON_VALUE_MARKS = (",", ":", "[", "{")
# Fields of POST /v1/responses that a response.create does not take.
_REFUSED = {"background": "background is not supported over a WebSocket: every response streams on the socket"}

router = APIRouter(prefix="/v1", tags=["OpenAI"])


def error_event(status: int, code: str, message: str, details: Any = None) -> dict[str, Any]:
    """The WebSocket error envelope (WebSocketErrorEvent)."""
    return {"type": "error", "status": status, **openai_error_body(status, code, message, details)}


def _event_of(exc: Exception) -> dict[str, Any]:
    """A refusal or an outage as an error event; a bug is logged and said as such."""
    if isinstance(exc, ValidationError):
        answer = _ERRORS.validation(PATH, list(exc.errors(include_url=False)))
    else:
        found = _ERRORS.of(PATH, "WEBSOCKET", exc)
        if found is None:
            log.error("unhandled error on a Responses WebSocket: %s: %s", type(exc).__name__, exc, exc_info=exc)
            return error_event(500, "internal_error", "internal error; the request was logged")
        answer = found
    return {"type": "error", "status": answer.status_code, **json.loads(bytes(answer.body))}


class _Socket:
    """One connection: its sends, its response in flight, its store: false responses."""

    def __init__(self, websocket: WebSocket, svc: Services, who: Caller) -> None:
        self.websocket, self.svc, self.who = websocket, svc, who
        self.running: asyncio.Task[None] | None = None
        # The most recent store: false response made here: its id and every item it was
        # given and gave (what a continuation of it is given).
        self.local: tuple[str, list[dict[str, Any]]] | None = None
        self._sending = asyncio.Lock()
        # When the client last sent a message or the last response ended (the idle clock).
        self.active = asyncio.get_running_loop().time()

    @property
    def busy(self) -> bool:
        return self.running is not None and not self.running.done()

    def _start(self, following: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.create_task(following)
        task.add_done_callback(lambda _: setattr(self, "active", asyncio.get_running_loop().time()))
        return task

    async def send(self, payload: dict[str, Any]) -> None:
        async with self._sending:
            await self.websocket.send_text(json.dumps(payload, ensure_ascii=False))

    def _evict(self, response: str | None) -> None:
        if response is not None and self.local is not None and self.local[0] == response:
            self.local = None

    async def handle(self, text: str) -> None:
        """One client message."""
        # Counted before it is parsed, as the edge counts a JSON body (MAX_JSON_VALUES):
        # json.loads holds the loop ~0.3 µs a value, and 8 MiB of `[],` are 2.8 million.
        limit = self.svc.settings.max_json_values
        if sum(text.count(mark) for mark in _JSON_VALUE_MARKS) > limit:
            await self.send(
                error_event(
                    413,
                    "too_many_json_values",
                    f"the client event holds over {limit} JSON values (commas, colons and brackets)",
                )
            )
            return
        try:
            message = json.loads(text)
        except ValueError:
            await self.send(error_event(400, "invalid_json", "a client event is one JSON object"))
            return
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            await self.send(error_event(400, "invalid_event", "a client event is a JSON object with its type"))
            return
        if message["type"] != "response.create":
            param = {"param": "type"}
            await self.send(
                error_event(
                    400,
                    "unsupported_event",
                    f"client events of type {message['type']} are not supported: send response.create",
                    param,
                )
            )
            return
        if self.busy:
            await self.send(
                error_event(
                    409,
                    "response_in_progress",
                    "a response is in flight on this socket: send the next "
                    "response.create once it has ended (one response at a time per socket)",
                )
            )
            return
        await self.create(message)

    async def create(self, message: dict[str, Any]) -> None:
        stream_id = message.get("stream_id")
        previous = message.get("previous_response_id")
        previous = previous if isinstance(previous, str) else None
        try:
            self.who = await identify(self.svc, self.websocket.headers.get("authorization"))
            for name, why in _REFUSED.items():
                if message.get(name) not in (None, False):
                    raise ApiError(400, "unsupported_parameter", why, details={"param": name})
            fields = {k: v for k, v in message.items() if k not in ("type", "stream_id", "background")}
            body = ResponseRequest.model_validate_json(json.dumps({**fields, "stream": True}))
            held = self.local[1] if self.local is not None and previous == self.local[0] else None
            call = await response_call(body, self.svc, self.who, previous=held)
            # Its events are followed from this process: refused before it is submitted
            # (not left running unfollowed) when the tenant holds its share of followers.
            self.svc.events.admissible(self.who.tenant)
            flex = terms.tier(body.service_tier).flex
            (request_id,) = (await self.svc.submitter.submit_many(self.who, [call.native], flex=flex)).request_ids
            await keep(self.svc, self.who, call, request_id, body.model, resumable=True)
        except Exception as exc:  # refused: said on the socket, which stays open
            self._evict(previous)  # a failed continuation is not continued again
            await self.send(self._lane(_event_of(exc), stream_id))
            return
        obfuscate = body.stream_options is None or body.stream_options.include_obfuscation
        self.running = self._start(
            self.follow(request_id, body.model, call.settings, -1, stream_id, obfuscate, call, previous)
        )

    @staticmethod
    def _lane(payload: dict[str, Any], stream_id: Any) -> dict[str, Any]:
        return {**payload, "stream_id": stream_id} if isinstance(stream_id, str) else payload

    async def follow(
        self,
        request_id: str,
        model: str,
        settings: ResponseSettings,
        after: int,
        stream_id: Any = None,
        obfuscate: bool = True,
        call: Any = None,
        previous: str | None = None,
    ) -> None:
        """Send a response's events after `after` (its request runs on whether or not the
        socket stays: cancel_on_disconnect is off, so a new socket can resume it)."""
        final: dict[str, Any] | None = None
        try:
            events = response_events(
                self.svc,
                request_id,
                model,
                settings,
                after,
                tenant=self.who.tenant,
                cancel_on_disconnect=False,
                obfuscate=obfuscate,
            )
            async with contextlib.aclosing(events) as stream:  # type: ignore[type-var]
                async for payload in stream:
                    if payload["type"] in ("response.completed", "response.incomplete", "response.failed"):
                        final = payload["response"]
                    await self.send(self._lane(payload, stream_id))
        except (WebSocketDisconnect, RuntimeError, OSError):
            return  # the socket went away: the response runs on (resume it on a new socket)
        except Exception as exc:
            self._evict(previous)
            with contextlib.suppress(Exception):
                await self.send(self._lane(_event_of(exc), stream_id))
            return
        if final is None or final["status"] == "failed":
            self._evict(previous)
        elif call is not None and not settings.store:
            self._hold(final, call, request_id)

    def _hold(self, final: dict[str, Any], call: Any, request_id: str) -> None:
        """Keep a store: false response for this connection (within the chain's bytes
        limit: one over it is not kept, and continuing it is previous_response_not_found)."""
        items = [*call.context, *with_ids(call.items, request_id), *final["output"]]
        if sum(item_bytes(item) for item in items) <= self.svc.settings.response_chain_max_bytes:
            self.local = (str(final["id"]), items)
        else:
            self.local = None

    async def resume(self, response: str, after: int) -> None:
        """Follow a response this tenant made (on another socket, or over HTTP) after
        sequence number `after`."""
        try:
            request_id = request_id_of(response)
            outcome = await self.svc.results.get(request_id, self.who.scope)
            if outcome.metadata.get("api") != "responses":
                raise ApiError(404, "not_found", f"no response {response}")
            if await self.svc.results.job(request_id, self.who.scope) is None:
                raise ApiError(410, "stream_expired", f"the events of {response} are no longer kept; GET it instead")
            document = await ResponseStore(self.svc).get(self.who.scope, response)
            kept = document is not None and not document.get("deleted") and document.get("settings")
            found = document["settings"] if kept and document else None
            if found is None and outcome.metadata.get("store") == "false":
                found = await UnstoredSettings(self.svc).get(self.who.scope, request_id)
            settings = ResponseSettings.model_validate(found) if found else None
        except Exception as exc:
            await self.send(_event_of(exc))
            return
        self.running = self._start(
            self.follow(request_id, outcome.model, settings or settings_of_record(outcome), after)
        )


async def _refuse_upgrade(websocket: WebSocket, error: ApiError | Refused, trace_id: str) -> int:
    """401, 429 (or another refusal) in OpenAI's shape on the upgrade itself, where the
    server can answer one (uvicorn does: the websocket.http.response extension); else the
    socket is closed with policy violation (1008). The status answered."""
    answer = _ERRORS.of(PATH, "GET", error)
    assert answer is not None  # (an ApiError or a Refused always has its answer)
    answer.headers[HEADER] = trace_id
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(answer)
    else:
        message = error.message if isinstance(error, ApiError) else str(error)
        await websocket.close(code=1008, reason=message[:120])
    return answer.status_code


def _sockets(websocket: WebSocket, svc: Services) -> SharedPool:
    """This process's pool of Responses WebSockets (one per app)."""
    state = websocket.app.state
    pool: SharedPool | None = getattr(state, "responses_sockets", None)
    if pool is None:
        settings = svc.settings
        share = share_of(
            settings.responses_ws_max, settings.responses_ws_tenant_share, settings.responses_ws_tenant_floor
        )
        pool = SharedPool(
            "Responses WebSockets", total=settings.responses_ws_max, share=share, full_code="too_many_websockets"
        )
        state.responses_sockets = pool
    return pool


def _resume_point(websocket: WebSocket) -> tuple[str, int] | None:
    response = websocket.query_params.get("response_id")
    if response is None:
        return None
    after = websocket.query_params.get("starting_after", "-1")
    try:
        return response, max(-1, int(after))
    except ValueError:
        raise ApiError(
            400, "invalid_request", "starting_after: a sequence number", details={"param": "starting_after"}
        ) from None


@router.websocket("/responses")
async def responses_socket(websocket: WebSocket) -> None:
    svc: Services = websocket.app.state.services
    started = time.perf_counter()
    trace_id = accepted_trace_id(websocket.headers.get(HEADER, "").encode("latin-1") or None)
    reset = bind_trace_id(trace_id)  # the socket's submissions store it, as an HTTP call's do
    bind_request_ids(trace_id=trace_id)
    status = 500
    pool = _sockets(websocket, svc)
    try:
        try:
            who = await identify(svc, websocket.headers.get("authorization"))
            resume = _resume_point(websocket)
            pool.check(who.tenant)
        except (ApiError, Refused) as error:
            status = await _refuse_upgrade(websocket, error, trace_id)
            return
        with pool.hold(who.tenant):  # (no await since the check: nothing came between)
            await websocket.accept(headers=[(HEADER.lower().encode(), trace_id.encode())])
            status = 101
            await _serve(websocket, svc, who, resume)
    finally:
        svc.metrics.http_requests.labels(PATH, "GET", str(status)).inc()
        elapsed_ms = (time.perf_counter() - started) * 1000
        access_log.info("WEBSOCKET %s %d %.1fms", loggable_path(websocket.scope), status, elapsed_ms)
        clear_request_ids()
        reset()


async def _serve(websocket: WebSocket, svc: Services, who: Caller, resume: tuple[str, int] | None) -> None:
    """An accepted socket: its messages one at a time, until the client goes, it has been
    idle RESPONSES_WS_IDLE_S or open RESPONSES_WS_MAX_S."""
    socket = _Socket(websocket, svc, who)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + svc.settings.responses_ws_max_s
    idle_s = svc.settings.responses_ws_idle_s
    idle = False
    try:
        if resume is not None:
            await socket.resume(*resume)
        while (left := deadline - loop.time()) > 0:
            # A response in flight keeps the socket; the idle clock runs from its end (seen
            # at the next wake-up, at most idle_s later).
            wait = min(left, idle_s if socket.busy else socket.active + idle_s - loop.time())
            try:
                message = await asyncio.wait_for(websocket.receive(), max(wait, 0))
            except TimeoutError:
                if not socket.busy and loop.time() - socket.active >= idle_s:
                    idle = True
                    break
                continue
            if message["type"] == "websocket.disconnect":
                return
            socket.active = loop.time()
            text = message.get("text")
            if text is None:
                text = (message.get("bytes") or b"").decode("utf-8", "replace")
            await socket.handle(text)
        if socket.running is not None:
            await socket.running  # the response in flight ends first
        if idle:
            event = error_event(
                400,
                "websocket_idle_timeout",
                f"no message for {idle_s:g} s and no response in flight: the socket is closed "
                "(open a new one; continue with previous_response_id)",
            )
        else:
            minutes = svc.settings.responses_ws_max_s / 60
            event = error_event(
                400,
                "websocket_connection_limit_reached",
                f"a Responses WebSocket is closed after {minutes:g} "
                "minutes: open a new one (continue with previous_response_id)",
            )
        await socket.send(event)
        await websocket.close(code=1000)
    except (WebSocketDisconnect, RuntimeError, OSError):
        return  # the client went away
    finally:
        if socket.running is not None and not socket.running.done():
            socket.running.cancel()  # (the follower only: the response runs on)
            with contextlib.suppress(BaseException):
                await socket.running
