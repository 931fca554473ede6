"""One call of the official `openai` client, with its default retries, is one request:
answers about a request that was accepted (cancelled, failed, expired) tell the client
not to retry (x-should-retry: false), and /v1 honours Idempotency-Key. Counted on the
gateway's own Redis: every accepted request is one `req:` hash there."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from tests.conftest import AUTH

MODELS = """
[[model]]
name = "llm_synthetic"
kind = "llm"
mode = "engine"
tokenizer = "$LLM_MODEL_DIR"
context_length = 8192

# The engine contract sent to a model that does not speak it: every run fails in Triton.
[[model]]
name = "llm_broken"
kind = "llm"
mode = "engine"
triton_model = "clip_text"
tokenizer = "$LLM_MODEL_DIR"
"""


@pytest.fixture(scope="module")
def gateway(stack, tmp_path_factory) -> Iterator[tuple[str, redis.Redis]]:
    models = tmp_path_factory.mktemp("sdk") / "models.toml"
    models.write_text(MODELS)
    db = redis.Redis.from_url(stack.redis_db_url(11), decode_responses=True)
    db.flushdb()
    process, url = stack.start_gateway(
        "gateway-sdk", REDIS_URL=stack.redis_db_url(11), MODELS_FILE=str(models), DEFAULT_TIMEOUT_S="4"
    )
    yield url, db
    stack.stop(process)
    db.close()


def sdk(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=60)  # default retries (2)


def requests_made(db: redis.Redis) -> set[str]:
    return {key.rsplit(":", 1)[1] for key in db.scan_iter("{s0}:req:*")}


def chat(client: openai.OpenAI, model: str, max_tokens: int, **extra) -> None:
    client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "go on"}], max_tokens=max_tokens, **extra
    )


def test_an_expired_request_is_not_retried(gateway, stack) -> None:
    url, db = gateway
    before = requests_made(db)
    with pytest.raises(openai.APIStatusError) as error:
        chat(sdk(url, stack.api_key), "llm_synthetic", 600)  # 12 s of tokens, 4 s to live
    assert error.value.status_code == 504
    assert len(requests_made(db) - before) == 1


def test_a_failed_request_is_not_retried(gateway, stack) -> None:
    url, db = gateway
    before = requests_made(db)
    with pytest.raises(openai.APIStatusError) as error:
        chat(sdk(url, stack.api_key), "llm_broken", 4)
    assert error.value.status_code in (400, 502)
    assert len(requests_made(db) - before) == 1


def test_the_answer_about_a_failed_request_tells_clients_not_to_retry(gateway, stack) -> None:
    url, _ = gateway
    body = {"model": "llm_broken", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 4}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert response.status_code in (400, 502), response.text
    assert response.headers["x-should-retry"] == "false"


def test_a_cancelled_request_is_not_retried(gateway, stack) -> None:
    url, db = gateway
    before = requests_made(db)
    outcome: dict[str, BaseException] = {}

    def call() -> None:
        try:
            chat(sdk(url, stack.api_key), "llm_synthetic", 150)
        except BaseException as exc:
            outcome["error"] = exc

    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 30
    while not (new := requests_made(db) - before):
        assert time.monotonic() < deadline, "the call made no request"
        time.sleep(0.05)
    (request_id,) = new
    httpx.post(f"{url}/results/{request_id}/cancel", headers=AUTH, timeout=30).raise_for_status()
    caller.join(timeout=60)
    error = outcome.get("error")
    assert isinstance(error, openai.APIStatusError) and error.status_code == 409
    assert requests_made(db) - before == {request_id}


def test_the_same_idempotency_key_answers_with_the_first_request(gateway, stack) -> None:
    url, db = gateway
    client = sdk(url, stack.api_key)
    before = requests_made(db)
    first = client.chat.completions.with_raw_response.create(
        model="llm_synthetic",
        messages=[{"role": "user", "content": "once"}],
        max_tokens=4,
        extra_headers={"Idempotency-Key": "sdk-once-1"},
    )
    again = client.chat.completions.with_raw_response.create(
        model="llm_synthetic",
        messages=[{"role": "user", "content": "once"}],
        max_tokens=4,
        extra_headers={"Idempotency-Key": "sdk-once-1"},
    )
    assert first.headers["x-request-id"] == again.headers["x-request-id"]
    assert first.parse().choices[0].message.content == again.parse().choices[0].message.content
    assert len(requests_made(db) - before) == 1
