"""POST /infer and GET /results/<id>, implemented once (gateway.server.api.hot) and served
by the edge before FastAPI's routing, against the session stack's gateway: the OpenAPI
document describes them, the limits it documents are the ones enforced, their errors
keep FastAPI's shapes and check order, and the near misses (another method, a trailing
slash) get FastAPI's router's answers."""

from __future__ import annotations

import httpx
import pytest

from gateway.protocol import new_request_id
from tests.conftest import AUTH
from tests.gateway_calls import llm_body

JSON = {"content-type": "application/json"}


async def test_the_openapi_document_describes_post_infer(http) -> None:
    spec = (await http.get("/openapi.json")).json()
    infer = spec["paths"]["/infer"]["post"]
    assert infer["operationId"] == "infer_infer_post"
    assert infer["requestBody"] == {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/InferRequest"}}},
    }
    headers = {p["name"]: p for p in infer["parameters"] if p["in"] == "header"}
    assert set(headers) == {"Idempotency-Key", "prefer", "accept"} and len(infer["parameters"]) == 3
    assert headers["Idempotency-Key"]["schema"]["anyOf"][0] == {"type": "string", "maxLength": 255}
    assert "wait=N" in headers["prefer"]["description"]
    assert "text/event-stream" in headers["accept"]["description"]
    assert set(infer["responses"]) == {"200", "202", "413", "422", "429", "503"}
    assert infer["responses"]["202"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Accepted"
    }
    schemas = spec["components"]["schemas"]
    assert set(schemas["InferRequest"]["properties"]) == {
        "model",
        "inputs",
        "parameters",
        "stream",
        "webhook",
        "timeout_s",
        "priority",
        "metadata",
    }
    assert set(schemas["InferRequest"]["required"]) == {"model", "inputs"}
    assert set(schemas["Accepted"]["properties"]) >= {"request_id", "status", "urls"}


async def test_the_openapi_document_describes_get_results(http) -> None:
    spec = (await http.get("/openapi.json")).json()
    get = spec["paths"]["/results/{request_id}"]["get"]
    assert get["operationId"] == "get_result_results__request_id__get"
    parameters = {(p["name"], p["in"]): p for p in get["parameters"]}
    assert set(parameters) == {("request_id", "path"), ("wait", "query")}
    assert parameters[("request_id", "path")]["required"] is True
    assert parameters[("wait", "query")]["schema"]["anyOf"][0] == {"type": "number", "maximum": 86400, "minimum": 0}
    assert set(get["responses"]) == {"200", "404", "410", "422"}
    assert set(spec["paths"]["/results/{request_id}"]) == {"get"}
    assert set(spec["paths"]["/infer"]) == {"post"}


async def test_the_documented_idempotency_key_limit_is_the_enforced_one(http) -> None:
    spec = (await http.get("/openapi.json")).json()
    header = next(p for p in spec["paths"]["/infer"]["post"]["parameters"] if p["name"] == "Idempotency-Key")
    limit = header["schema"]["anyOf"][0]["maxLength"]
    key = new_request_id()
    longest = (key * 10)[:limit]
    accepted = await http.post("/infer", json=llm_body("at the limit", 2), headers={"Idempotency-Key": longest})
    assert accepted.status_code == 202, accepted.text
    over = longest + "x"
    refused = await http.post("/infer", json=llm_body("over the limit", 2), headers={"Idempotency-Key": over})
    assert refused.status_code == 422
    assert refused.json() == {
        "error": {
            "code": "validation_error",
            "message": f"header.Idempotency-Key: String should have at most {limit} characters",
            "details": [
                {
                    "loc": ["header", "Idempotency-Key"],
                    "msg": f"String should have at most {limit} characters",
                    "type": "string_too_long",
                }
            ],
        }
    }


@pytest.mark.parametrize(
    ("bound", "past", "kind", "word"),
    [("maximum", 1, "less_than_equal", "less"), ("minimum", -1, "greater_than_equal", "greater")],
)
async def test_the_documented_wait_bounds_are_the_enforced_ones(http, bound, past, kind, word) -> None:
    spec = (await http.get("/openapi.json")).json()
    wait = next(p for p in spec["paths"]["/results/{request_id}"]["get"]["parameters"] if p["name"] == "wait")
    edge = wait["schema"]["anyOf"][0][bound]
    unknown = new_request_id()
    # At the bound the wait is valid: the id is looked up (a long wait is cut to MAX_WAIT_S,
    # and an unknown id answers at once).
    assert (await http.get(f"/results/{unknown}", params={"wait": 0})).status_code == 404
    response = await http.get(f"/results/{unknown}", params={"wait": edge + past})
    assert response.status_code == 422
    message = f"Input should be {word} than or equal to {edge}"
    assert response.json() == {
        "error": {
            "code": "validation_error",
            "message": f"query.wait: {message}",
            "details": [{"loc": ["query", "wait"], "msg": message, "type": kind}],
        }
    }


async def test_a_wait_that_is_not_a_number_is_refused_as_fastapi_refuses_it(http) -> None:
    response = await http.get(f"/results/{new_request_id()}", params={"wait": "soon"})
    assert response.status_code == 422
    message = "Input should be a valid number, unable to parse string as a number"
    assert response.json()["error"] == {
        "code": "validation_error",
        "message": f"query.wait: {message}",
        "details": [{"loc": ["query", "wait"], "msg": message, "type": "float_parsing"}],
    }


async def test_a_body_that_is_not_json_is_refused_after_the_key_and_before_the_header(stack) -> None:
    # An Idempotency-Key over the limit: the JSON is checked first, once the key is.
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as anonymous:
        response = await anonymous.post(
            "/infer", content=b'{"model": "llm", ', headers={**JSON, **AUTH, "Idempotency-Key": "k" * 300}
        )
        assert response.status_code == 422
        assert response.json() == {
            "error": {
                "code": "invalid_json",
                "message": "17: JSON decode error",
                "details": [{"loc": ["body", 17], "msg": "JSON decode error", "type": "json_invalid"}],
            }
        }
        # Without a key: 401 before the header and the body are looked at (tests/test_key_first.py).
        response = await anonymous.post("/infer", content=b'{"model": ', headers={"Idempotency-Key": "k" * 300})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "missing_api_key"
        assert response.headers["www-authenticate"] == "Bearer"


async def test_the_header_and_the_body_are_refused_together_header_first(http) -> None:
    response = await http.post(
        "/infer", json={"model": "llm", "inputs": {}, "surprise": 1}, headers={"Idempotency-Key": "k" * 256}
    )
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "validation_error"
    assert [(d["loc"], d["type"]) for d in error["details"]] == [
        (["header", "Idempotency-Key"], "string_too_long"),
        (["body", "surprise"], "extra_forbidden"),
    ]


@pytest.mark.parametrize(
    ("body", "headers"),
    [(b"", {}), (b"", JSON), (b"model=llm", {"content-type": "text/plain"}), (b"[]", JSON), (b"null", JSON)],
)
async def test_a_missing_or_non_object_body_is_422_not_an_object(http, body, headers) -> None:
    # (FastAPI's own body parsing would say "Field required" for the empty body and
    # model_attributes_type for the others: the gateway answers as it always has.)
    response = await http.post("/infer", content=body, headers=headers)
    assert response.status_code == 422, response.text
    message = "Input should be a valid dictionary or instance of InferRequest"
    assert response.json() == {
        "error": {
            "code": "validation_error",
            "message": message,
            "details": [{"loc": ["body"], "msg": message, "type": "model_type"}],
        }
    }


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/infer", "POST"),
        ("PUT", "/infer", "POST"),
        ("POST", "/results/{id}", "GET"),
        ("DELETE", "/results/{id}", "GET"),
    ],
)
async def test_another_method_is_405_naming_the_allowed_one(http, method, path, allow) -> None:
    response = await http.request(method, path.format(id=new_request_id()))
    assert response.status_code == 405
    assert response.headers["allow"] == allow
    assert response.json() == {"error": {"code": "method_not_allowed", "message": "Method Not Allowed"}}


@pytest.mark.parametrize(("method", "path"), [("POST", "/infer/"), ("GET", "/results/{id}/")])
async def test_a_trailing_slash_is_redirected_to_the_route(http, method, path) -> None:
    path = path.format(id=new_request_id())
    response = await http.request(method, path, follow_redirects=False)
    assert response.status_code == 307
    assert response.headers["location"].endswith(path.rstrip("/"))
