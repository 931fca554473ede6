"""The gateway's HTTP API against the real local stack: submit, poll, long-poll,
Prefer: wait, idempotency, and clear 4xx errors for bad input."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
from datetime import datetime

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from gateway.protocol import new_request_id
from gateway.protocol.records import replica_name
from gateway.server.settings import GatewaySettings
from tests.gateway_calls import llm_body, submit, wait_result
from tests.triton_requests import png_bytes


async def test_submit_answers_202_with_id_and_location_then_poll_gives_text(http) -> None:
    response = await http.post("/infer", json=llm_body("Hello", 8))
    assert response.status_code == 202
    body = response.json()
    request_id = body["request_id"]
    assert len(request_id) == 36 and request_id.isalnum()
    assert response.headers["location"] == f"/results/{request_id}"
    assert body["urls"] == {
        "result": f"/results/{request_id}",
        "events": f"/results/{request_id}/events",
        "cancel": f"/results/{request_id}/cancel",
    }
    assert body["status"] == "queued"
    record = await wait_result(http, request_id)
    assert record["status"] == "succeeded"
    assert isinstance(record["outputs"]["text_output"], str) and record["outputs"]["text_output"]
    assert record["replica"] and record["timings"]["total_ms"] > 0


async def test_a_record_names_its_replica_without_its_address(http, stack) -> None:
    submitted = await http.post("/infer", json=llm_body("Where did I run?", 4))
    record = await wait_result(http, submitted.json()["request_id"])
    host, port = stack.triton_grpc.rsplit(":", 1)
    assert record["replica"] == record["route"]["replica"] == replica_name(stack.triton_grpc)
    assert host not in json.dumps(record) and port not in json.dumps(record["route"])


async def test_prefer_wait_returns_200_with_the_result(http) -> None:
    response = await http.post(
        "/infer", json={"model": "text_embed", "inputs": {"text": "hello"}}, headers={"Prefer": "wait=20"}
    )
    assert response.status_code == 200
    assert response.headers["preference-applied"] == "wait=20"
    record = response.json()
    assert record["status"] == "succeeded"
    assert len(record["outputs"]["embedding"]) == 384


async def test_prefer_wait_shorter_than_the_work_gives_202(http) -> None:
    response = await http.post("/infer", json=llm_body(max_tokens=200), headers={"Prefer": "wait=0.01"})
    assert response.status_code == 202
    await wait_result(http, response.json()["request_id"])


async def test_long_poll_returns_on_completion_not_at_its_wait(http) -> None:
    wait_s = 30
    request_id = await submit(http, llm_body(max_tokens=150))
    response = await http.get(f"/results/{request_id}", params={"wait": wait_s})
    returned = time.time()
    record = response.json()
    assert response.status_code == 200 and record["status"] == "succeeded"
    finished = datetime.fromisoformat(record["finished_at"]).timestamp()
    # A long-poll does not poll: the completion message wakes it (milliseconds on an idle
    # machine), or else it answers only when its wait runs out. A third of the wait tells the
    # two apart with room for a loaded machine.
    assert returned - finished < wait_s / 3, f"long-poll answered {returned - finished:.3f}s after completion"


async def test_long_poll_of_a_running_request_returns_its_state_at_the_timeout(http) -> None:
    request_id = await submit(http, llm_body(max_tokens=250))
    response = await http.get(f"/results/{request_id}", params={"wait": 0.05})
    # 250 tokens take far longer than 50 ms: an answer with the state, not the record, is one
    # given when the wait ran out (a long-poll that overstayed it would bring the record).
    assert response.status_code == 200, response.text
    assert response.json()["status"] in ("queued", "running"), response.text
    await wait_result(http, request_id)


async def test_same_idempotency_key_and_body_give_the_same_request(http) -> None:
    key = f"key-{time.time_ns()}"
    first = await http.post("/infer", json=llm_body("idempotent", 4), headers={"Idempotency-Key": key})
    second = await http.post("/infer", json=llm_body("idempotent", 4), headers={"Idempotency-Key": key})
    assert first.status_code == 202
    assert second.status_code in (200, 202)
    assert second.json()["request_id"] == first.json()["request_id"]


async def test_same_idempotency_key_with_another_body_is_422(http) -> None:
    key = f"key-{time.time_ns()}"
    await submit(http, llm_body("first body", 4), **{"Idempotency-Key": key})
    response = await http.post("/infer", json=llm_body("other body", 4), headers={"Idempotency-Key": key})
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "idempotency_key_reused"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "nope", "inputs": {"text": "x"}}, 422, "unknown_model"),
        ({"model": "llm"}, 422, "validation_error"),
        ({"model": "llm", "inputs": {"max_tokens": 4}}, 422, "invalid_inputs"),
        ({"model": "llm", "inputs": {"text_input": "x", "max_tokens": "ten"}}, 422, "invalid_inputs"),
        ({"model": "llm", "inputs": {"text_input": "x"}, "parameters": {"top_p": 7}}, 422, "invalid_inputs"),
        ({"model": "clip_image", "inputs": {"image": "not base64!!"}}, 422, "invalid_inputs"),
        ({"model": "clip_image", "inputs": {"image": base64.b64encode(b"plain text").decode()}}, 422, "invalid_inputs"),
        ({"model": "text_embed", "inputs": {"text": "x"}, "webhook": {"url": "ftp://x"}}, 422, "validation_error"),
        ({"model": "text_embed", "inputs": {"text": "x"}, "timeout_s": 99999}, 422, "timeout_too_long"),
        ({"model": "text_embed", "inputs": {"text": "x"}, "priority": 99}, 422, "validation_error"),
        ({"model": "text_embed", "inputs": {"text": "x"}, "surprise": 1}, 422, "validation_error"),
    ],
)
async def test_bad_input_gets_a_4xx_with_a_stable_code(http, body, status, code) -> None:
    response = await http.post("/infer", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"]


async def test_malformed_json_is_422_invalid_json(http) -> None:
    response = await http.post("/infer", content=b'{"model": "llm", ', headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"model": "llm", "inputs": {"text_input": "x", "max_tokens": True}}, "invalid_inputs"),
        ({"model": "llm", "inputs": {"text_input": "x", "max_tokens": "8"}}, "invalid_inputs"),
        ({"model": "llm", "inputs": {"text_input": "x", "max_tokens": 8}, "stream": "yes"}, "validation_error"),
    ],
)
async def test_a_value_of_the_wrong_json_type_is_refused_not_coerced(http, body, code) -> None:
    response = await http.post("/infer", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == code


@pytest.mark.parametrize("field", [{"max_tokens": True}, {"stream": "yes"}])
async def test_a_v1_value_of_the_wrong_json_type_is_a_400_in_openais_shape(http, field) -> None:
    body = {"model": "llm", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, **field}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == next(iter(field))


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32-le"])
async def test_a_body_not_in_utf8_is_422_invalid_json(http, encoding: str) -> None:
    # A valid request, in an encoding Python's json.loads would detect and read.
    body = json.dumps(llm_body("hello", 4)).encode(encoding)
    response = await http.post("/infer", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid_json"


async def test_huge_body_is_413(http) -> None:
    huge = {"model": "text_embed", "inputs": {"text": "x" * (9 * 1024 * 1024)}}
    response = await http.post("/infer", json=huge)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "payload_too_large"


async def test_huge_streamed_body_without_length_is_413(http) -> None:
    async def chunks():
        for _ in range(10):
            yield b"x" * (1024 * 1024)

    response = await http.post("/infer", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413


@pytest.mark.parametrize("path", [f"/results/{new_request_id()}", "/results/unknown-id", "/results/unknown-id/events"])
async def test_unknown_request_id_is_404(http, path) -> None:
    response = await http.get(path)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


async def test_an_id_older_than_the_retention_is_410_expired(http) -> None:
    old = new_request_id(time.time() - 30 * 86400)
    response = await http.get(f"/results/{old}")
    assert response.status_code == 410
    assert response.json()["error"]["code"] == "result_expired"


async def test_cancel_of_unknown_id_is_404(http) -> None:
    response = await http.post("/results/unknown-id/cancel")
    assert response.status_code == 404


async def test_an_image_triton_cannot_decode_fails_with_invalid_input(http) -> None:
    # Its header reads (the gateway checks that), its pixel data is cut off.
    broken = base64.b64encode(png_bytes()[:40]).decode()
    request_id = await submit(http, {"model": "clip_image", "inputs": {"image": broken}})
    record = await wait_result(http, request_id)
    assert record["status"] == "failed"
    assert record["error"]["code"] == "invalid_input"
    assert record["attempts"] == 1


async def test_image_request_succeeds_and_stores_a_digest_not_the_bytes(http) -> None:
    image = png_bytes()
    response = await http.post(
        "/infer",
        json={"model": "clip_image", "inputs": {"image": base64.b64encode(image).decode()}},
        headers={"Prefer": "wait=20"},
    )
    record = response.json()
    assert record["status"] == "succeeded"
    assert len(record["outputs"]["image_embeds"]) == 32
    assert record["inputs"] == {"image": {"sha256": hashlib.sha256(image).hexdigest(), "bytes": len(image)}}


async def test_many_concurrent_requests_all_succeed(http) -> None:
    ids = await asyncio.gather(*(submit(http, {"model": "clip_text", "inputs": {"text": f"t{i}"}}) for i in range(40)))
    records = await asyncio.gather(*(wait_result(http, rid) for rid in ids))
    assert {r["status"] for r in records} == {"succeeded"}


async def test_health_readiness_and_metrics(http) -> None:
    assert (await http.get("/healthz")).json() == {"status": "ok"}
    ready = await http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["replicas_ready"] >= 1
    assert "127.0.0.1" not in ready.text  # no addresses in a public answer
    await submit(http, {"model": "clip_text", "inputs": {"text": "metrics"}})
    metrics = (await http.get("/metrics")).text
    for name in (
        "gateway_requests_accepted_total",
        "gateway_requests_finished_total",
        "gateway_backlog",
        "gateway_replica_inflight",
        "gateway_request_latency_seconds",
        "gateway_time_to_first_token_seconds",
    ):
        assert name in metrics


def _tenant_requests_counted(metrics: str) -> float:
    families = text_string_to_metric_families(metrics)
    return sum(s.value for f in families if f.name == "gateway_tenant_requests" for s in f.samples)


async def test_public_metrics_do_not_name_tenants(stack, http) -> None:
    tenant = "tenant-kept-off-metrics-q7z"
    created = await http.post("/admin/keys", json={"tenant": tenant, "role": "user", "name": "test"})
    assert created.status_code == 201, created.text
    tenant_key = {"Authorization": f"Bearer {created.json()['key']}"}
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=60) as public:  # no key: /metrics is public
        before = _tenant_requests_counted((await public.get("/metrics")).text)
        body = {"model": "clip_text", "inputs": {"text": "counted"}}
        response = await public.post("/infer", json=body, headers={**tenant_key, "Prefer": "wait=30"})
        assert response.json()["status"] == "succeeded", response.text
        deadline = time.monotonic() + 30
        while True:
            metrics = await public.get("/metrics")
            assert metrics.status_code == 200
            if _tenant_requests_counted(metrics.text) > before:  # the tenant's request is counted
                break
            assert time.monotonic() < deadline, "the request was not counted"
            await asyncio.sleep(0.1)
    assert tenant not in metrics.text


def test_tenant_labels_on_public_metrics_are_refused() -> None:
    assert GatewaySettings(metrics_tenant_label=True, public_metrics=False).metrics_tenant_label
    with pytest.raises(ValidationError, match="tenant names are not public"):
        GatewaySettings(metrics_tenant_label=True, public_metrics=True)


async def test_openapi_docs_are_served(http) -> None:
    spec = (await http.get("/openapi.json")).json()
    assert {"/infer", "/results/{request_id}", "/results/{request_id}/events", "/search"} <= set(spec["paths"])
    assert (await http.get("/docs")).status_code == 200


async def test_unknown_route_is_a_json_404(http) -> None:
    response = await http.get("/nowhere")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
