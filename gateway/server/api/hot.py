"""The hot routes, POST /infer and GET /results/<id>, the calls every request makes:
implemented once, here.

The edge middleware (gateway.server.api.edge) serves them before FastAPI's routing,
dependency solving and response validation. FastAPI's app declares them too
(HotRoutes.declare), for two things only: the OpenAPI document (their body, parameters
and responses come from the signatures of `infer` and `get_result` below, which have no
code) and its router's answers to near misses (another method is 405 with Allow, a
trailing slash is redirected). A request that does reach a declaration (an app without
the edge in front) is answered by this same code.

The key comes first: the edge checks it from the headers before the body is read (a call
without a valid key is 401 whatever its body), and this code uses the caller it found.
Then come a body that is not JSON, then the parameters and the body, the errors in
pydantic's shape as FastAPI's validation errors, rendered by the ErrorRenderer every route
uses. The body is parsed and validated in one
pass by pydantic-core (InferRequest's JSON schema); only a body that fails takes the slow
road, which finds every error. The answers are built by gateway.server.api.submit and
results."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import parse_qsl

from fastapi import FastAPI, Header, Query
from fastapi.routing import APIRoute
from pydantic import Field, TypeAdapter, ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.common import counts
from gateway.protocol.http import Accepted, InferRequest
from gateway.server.api.errors import NESTED_TOO_DEEP, ApiError, BodyRefused, ErrorRenderer
from gateway.server.api.results import result_response
from gateway.server.api.submit import Carried, infer_response
from gateway.server.api.tenancy import identify
from gateway.server.services import Services

IDEMPOTENCY_MAX = 255  # characters of an Idempotency-Key
WAIT_MAX_S = 86400  # ?wait=N of GET /results/<id> (then cut to MAX_WAIT_S)
_BODY_ADAPTER = TypeAdapter(InferRequest)
_WAIT_ADAPTER: TypeAdapter[float] = TypeAdapter(Annotated[float, Field(ge=0, le=WAIT_MAX_S)])


class Invalid(Exception):
    """Errors in pydantic's shape, answered 422 as FastAPI answers a RequestValidationError."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__("invalid request")
        self.errors = errors


@dataclass(frozen=True)
class HotRoute:
    template: str  # for metrics, as FastAPI names the route
    name: str
    param: str = ""


_INFER = HotRoute("/infer", "infer")
_RESULT = "/results/{request_id}"


# The declarations FastAPI documents (HotRoutes.declare): signatures without code. The
# names make the operation ids (infer_infer_post, get_result_results__request_id__get).


async def infer(
    body: InferRequest,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", max_length=IDEMPOTENCY_MAX)] = None,
    prefer: Annotated[str | None, Header(description="wait=N: hold the response up to N s for the result")] = None,
    accept: Annotated[str | None, Header(description="text/event-stream: answer with the request's events")] = None,
) -> None:
    """Accept a request at once and return its id.

    With `Accept: text/event-stream` the answer is the request's event stream (as from
    /results/{id}/events), saving a round trip before the first token; the request is
    queued durably first, and `Location` names it for resuming."""


async def get_result(
    request_id: str,
    wait: Annotated[
        float | None, Query(ge=0, le=WAIT_MAX_S, description="Hold up to N s; answer the moment it ends")
    ] = None,
) -> Any:  # the record, any JSON object as far as the schema says
    pass  # (no docstring: it would be the operation's description)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _is_json(content_type: str | None) -> bool:
    if content_type is None:
        return True
    main = content_type.split(";", 1)[0].strip().lower()
    return main == "application/json" or (main.startswith("application/") and main.endswith("+json"))


def _prefixed(error: dict[str, Any], *prefix: str | int) -> dict[str, Any]:
    return {**error, "loc": (*prefix, *error.get("loc", ()))}


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


class HotRoutes:
    def __init__(self, services: Callable[[], Services], errors: ErrorRenderer) -> None:
        self.services = services
        self.errors = errors

    def declare(self, app: FastAPI) -> None:
        """Declare the hot routes in FastAPI's app, answered by this object: documented in
        its OpenAPI document, and known to its router (405 for another method, the redirect
        of a trailing slash), never served by FastAPI's request handling."""
        documented = APIRoute(
            "/infer",
            infer,
            methods=["POST"],
            status_code=202,
            response_model=Accepted,
            summary="Submit a request",
            responses={
                200: {"description": "With `Prefer: wait=N`: the result, if it was ready within N seconds"},
                413: {"description": "Body too large"},
                422: {
                    "description": "Invalid request (unknown_model, invalid_inputs, validation_error, "
                    "idempotency_key_reused, prompt_too_long, prompt_over_token_limit)"
                },
                429: {
                    "description": "Backlog full or a rate limit spent (backlog_full, rate_limited, "
                    "token_rate_limited); retry after `Retry-After` seconds"
                },
                503: {"description": "Redis unavailable (redis_unavailable)"},
            },
        )
        documented.app = self._served(lambda scope: _INFER)
        app.router.routes.append(documented)
        documented = APIRoute(
            _RESULT,
            get_result,
            methods=["GET"],
            summary="Get a result (long-poll with ?wait=N)",
            responses={404: {"description": "Unknown id"}, 410: {"description": "Result expired"}},
        )
        documented.app = self._served(lambda scope: HotRoute(_RESULT, "result", scope["path_params"]["request_id"]))
        app.router.routes.append(documented)

    def _served(self, route: Callable[[Scope], HotRoute]) -> ASGIApp:
        """A declaration's ASGI app: the hot route, as the edge would serve it."""

        async def serve(scope: Scope, receive: Receive, send: Send) -> None:
            scope.setdefault("state", {})
            await self.handle(route(scope), scope, receive, send)

        return serve

    def match(self, method: str, path: str) -> HotRoute | None:
        """The hot route of a call, as FastAPI's router would match the declarations."""
        if method == "POST" and path == "/infer":
            return _INFER
        if method == "GET" and path.startswith("/results/"):
            request_id = path[len("/results/") :]
            if request_id and "/" not in request_id:
                return HotRoute(_RESULT, "result", request_id)
        return None

    async def handle(self, route: HotRoute, scope: Scope, receive: Receive, send: Send) -> None:
        counted = counts.begin()  # REQUEST_COUNTS (debug): its counts in x-gateway-counts
        if counted is not None:
            send = counts.sending(send, counted)
        try:
            response = await (self._infer if route.name == "infer" else self._result)(route, scope, receive)
        except Invalid as invalid:
            response = self.errors.validation(scope["path"], invalid.errors)
        except BodyRefused:
            raise  # the edge answers it
        except Exception as exc:
            answer = self.errors.of(scope["path"], scope["method"], exc)
            response = answer if answer is not None else self.errors.unexpected(scope["path"], scope["method"], exc)
        await response(scope, receive, send)

    async def _caller(self, svc: Services, scope: Scope) -> Any:
        known = scope["state"].get("caller")
        if known is not None:  # found by the edge from the headers: the key is checked once
            return known
        who = await identify(svc, _header(scope, b"authorization"))
        scope["state"]["caller"] = who  # the edge adds the headers its calls leave (x-ratelimit-*)
        return who

    async def _infer(self, route: HotRoute, scope: Scope, receive: Receive) -> Response | Carried:
        svc = self.services()
        who = await self._caller(svc, scope)  # before a byte of the body is read
        raw = await _body(receive)
        body, parsed = self._parse(_header(scope, b"content-type"), raw)
        errors = []
        idempotency_key = _header(scope, b"idempotency-key")
        if idempotency_key is not None and len(idempotency_key) > IDEMPOTENCY_MAX:
            errors.append(
                {
                    "type": "string_too_long",
                    "loc": ("header", "Idempotency-Key"),
                    "msg": f"String should have at most {IDEMPOTENCY_MAX} characters",
                    "input": idempotency_key,
                    "ctx": {"max_length": IDEMPOTENCY_MAX},
                }
            )
        if body is None:
            try:
                body = _BODY_ADAPTER.validate_python(parsed)
            except ValidationError as exc:
                errors += [_prefixed(dict(e), "body") for e in exc.errors()]
        if errors or body is None:
            raise Invalid(errors)
        prefer, accept = _header(scope, b"prefer"), _header(scope, b"accept")
        return await infer_response(svc, who, body, idempotency_key, prefer, accept)

    @staticmethod
    def _parse(content_type: str | None, raw: bytes) -> tuple[InferRequest | None, Any]:
        """The body, valid (fast), or what FastAPI would validate later (raising at once
        for JSON that does not parse, as FastAPI does before anything else)."""
        if not raw:
            # Refused as a body that is not an object (model_type;
            # FastAPI's own parsing would say "Field required").
            return None, None
        if not _is_json(content_type):
            return None, raw  # validated as it is (and refused)
        try:
            return InferRequest.model_validate_json(raw), None
        except ValidationError:
            pass
        try:
            return None, json.loads(raw)
        except RecursionError:
            # Nested deeper than the interpreter's stack allows: 400, as FastAPI's routes answer it.
            raise ApiError(400, "bad_request", NESTED_TOO_DEEP) from None
        except json.JSONDecodeError as exc:
            raise Invalid(
                [
                    {
                        "type": "json_invalid",
                        "loc": ("body", exc.pos),
                        "msg": "JSON decode error",
                        "ctx": {"error": exc.msg},
                    }
                ]
            ) from None

    async def _result(self, route: HotRoute, scope: Scope, receive: Receive) -> Response:
        svc = self.services()
        who = await self._caller(svc, scope)
        wait = None
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True))
        if "wait" in query:
            try:
                wait = _WAIT_ADAPTER.validate_python(query["wait"])
            except ValidationError as exc:
                raise Invalid([_prefixed(dict(e), "query", "wait") for e in exc.errors()]) from None
        return await result_response(svc, who, route.param, wait)
