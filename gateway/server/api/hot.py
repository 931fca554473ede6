"""The hot routes, served by the edge middleware without FastAPI's routing, dependency
solving and response validation: POST /infer and GET /results/<id>, the calls every
request makes. They answer exactly what FastAPI's routes for them answer (the routes stay
declared there, for the OpenAPI document): the same checks in the same order (a body
that is not JSON first, then the key, then the parameters and the body), the same
validation errors, and the same response objects (gateway.server.api.submit and
results build them for both).

The body is parsed and validated in one pass by pydantic-core (InferRequest's JSON
schema); only a body that fails takes the slow road, which reproduces FastAPI's errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import parse_qsl

from pydantic import Field, TypeAdapter, ValidationError
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.protocol.http import InferRequest
from gateway.server.api.errors import NESTED_TOO_DEEP, ApiError, BodyRefused, ErrorRenderer
from gateway.server.api.results import result_response
from gateway.server.api.submit import infer_response
from gateway.server.api.tenancy import identify
from gateway.server.services import Services

_BODY_ADAPTER = TypeAdapter(InferRequest)
_WAIT_ADAPTER: TypeAdapter[float] = TypeAdapter(Annotated[float, Field(ge=0, le=86400)])
IDEMPOTENCY_MAX = 255


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

    def match(self, method: str, path: str) -> HotRoute | None:
        if method == "POST" and path == "/infer":
            return _INFER
        if method == "GET" and path.startswith("/results/"):
            request_id = path[len("/results/") :]
            if request_id and "/" not in request_id:
                return HotRoute("/results/{request_id}", "result", request_id)
        return None

    async def handle(self, route: HotRoute, scope: Scope, receive: Receive, send: Send) -> None:
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
        who = await identify(svc, _header(scope, b"authorization"))
        scope["state"]["caller"] = who  # the edge adds the headers its calls leave (x-ratelimit-*)
        return who

    async def _infer(self, route: HotRoute, scope: Scope, receive: Receive) -> Response:
        svc = self.services()
        raw = await _body(receive)
        body, parsed = self._parse(_header(scope, b"content-type"), raw)
        who = await self._caller(svc, scope)
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
            return None, None  # "Field required", after the key is checked
        if not _is_json(content_type):
            return None, raw  # validated as it is (and refused), after the key is checked
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
