"""The page at /ui, in a real headless browser: Debian's chromium driven by Playwright
(tools/get_chromium.sh finds or installs it; Playwright's own browsers are never
downloaded), against the session stack's gateway. Screenshots go to $UI_ARTIFACTS_DIR
(default .test-artifacts/ui/)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import uvicorn
from playwright.async_api import Browser, Page, async_playwright, expect

from gateway.stack.process import free_port
from tests.gateway_calls import submit, wait_result
from tests.test_tenants import client_for, new_key, set_tenant, slot_held
from tests.triton_requests import png_bytes

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("UI_ARTIFACTS_DIR") or ROOT / ".test-artifacts" / "ui")
# Headless on a machine with no GPU and no network but the loopback.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WAIT_MS = 20_000

# Records the request panel's state and token count at every change, to show that tokens
# appeared while the request was still running (not all at once at the end).
OBSERVE_TOKENS = """() => {
    window.tokenSamples = [];
    const panel = document.getElementById("request-panel");
    new MutationObserver(() => window.tokenSamples.push(
        {state: panel.dataset.state, tokens: Number(panel.dataset.tokens)}
    )).observe(panel, {attributes: true, attributeFilter: ["data-tokens", "data-state"]});
}"""
TOKENS_AT_LEAST = "n => Number(document.getElementById('request-panel').dataset.tokens) >= n"
TIMELINE = """items => items.map(li => ({
    step: li.dataset.step, ms: Number(li.dataset.ms), detail: li.querySelector('.step-detail').textContent
}))"""


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium (the script installs it where it can, else says what to do)."""
    found = subprocess.run(
        ["bash", str(ROOT / "tools" / "get_chromium.sh")], capture_output=True, text=True, timeout=600
    )
    if found.returncode != 0:
        pytest.fail(f"no chromium for the browser tests: {found.stderr.strip()}")
    return found.stdout.strip().splitlines()[-1]


@pytest_asyncio.fixture(scope="module")
async def browser(chromium: str) -> AsyncIterator[Browser]:
    # Playwright gives each launch a fresh temporary --user-data-dir and removes it after.
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        yield launched
        await launched.close()


@pytest_asyncio.fixture
async def page(browser: Browser, stack, request: pytest.FixtureRequest) -> AsyncIterator[Page]:
    """A fresh browser context (its own localStorage) on the page; an uncaught script
    error fails the test, and a failed test leaves a screenshot."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    context = await browser.new_context(viewport={"width": 1280, "height": 1100})
    context.set_default_timeout(WAIT_MS)
    opened = await context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    await opened.goto(f"{stack.gateway_url}/ui")
    failures = request.session.testsfailed
    yield opened
    if request.session.testsfailed > failures:  # the test's call failed (reported before teardown)
        await opened.screenshot(path=ARTIFACTS / f"ui-failed-{request.node.name}.png", full_page=True)
    await context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


async def shot(page: Page, name: str) -> None:
    await page.screenshot(path=ARTIFACTS / name, full_page=True)


async def sign_in(page: Page, key: str) -> None:
    await page.fill("#api-key", key)
    await page.click("#key-save")
    await expect(page.locator("#key-status")).to_have_attribute("data-state", "ok", timeout=WAIT_MS)


async def ask_llm(page: Page, model: str, prompt: str, max_tokens: int, mode: str | None = None) -> None:
    """Asks with the page's prompt mode for the model, or `mode` ("text", "chat") picked by hand."""
    await page.select_option("#llm-model", model)
    if mode is not None:
        await page.check(f'input[name="prompt-mode"][value="{mode}"]')
    await page.fill("#max-tokens", str(max_tokens))
    await page.fill("#prompt", prompt)
    await page.click("#submit")


def step(page: Page, name: str):
    return page.locator(f'#timeline li[data-step="{name}"]')


BARS = """items => items.map(li => ({
    id: li.dataset.requestId, total: Number(li.dataset.total), shown: li.querySelector('.bar-total').textContent,
    current: li.classList.contains('current'),
    segments: [...li.querySelectorAll('.segment')].map(s => ({
        name: s.dataset.segment, ms: Number(s.dataset.ms), px: s.getBoundingClientRect().width
    })),
    track_px: li.querySelector('.bar-track').getBoundingClientRect().width,
}))"""
PROMPT_MODE = "() => document.querySelector('input[name=\"prompt-mode\"]:checked').value"


# -- served, and the admin endpoint behind the replicas panel ----------------------------


async def test_the_page_is_served_without_a_key_under_a_strict_content_security_policy(stack) -> None:
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=10) as client:
        page = await client.get("/ui")
        script = await client.get("/ui/app.js")
        missing = await client.get("/ui/secrets.txt")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert "innerHTML" not in script.text
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


async def test_admin_replicas_lists_each_replica_with_its_health_and_scraped_load(http, stack) -> None:
    response = await http.get("/admin/replicas")
    assert response.status_code == 200, response.text
    replicas = {r["url"]: r for r in response.json()["replicas"]}
    triton = replicas[stack.triton_grpc]
    assert triton["healthy"] is True
    assert {"llm_synthetic", "text_embed", "clip_image"} <= set(triton["ready_models"])
    assert triton["inflight"] >= 0 and triton["max_inflight"] >= 1
    assert triton["load"] is not None and triton["load"]["max_blocks"] > 0  # scraped from Triton's metrics


async def test_admin_replicas_refuses_a_key_that_is_not_an_admin_key(http, stack) -> None:
    created = await http.post("/admin/keys", json={"tenant": "ui-viewer", "role": "user", "name": "test_ui"})
    assert created.status_code == 201, created.text
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=10) as client:
        response = await client.get("/admin/replicas", headers={"Authorization": f"Bearer {created.json()['key']}"})
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "admin_only"


# -- in the browser ----------------------------------------------------------------------


async def test_a_wrong_key_shows_a_clear_error_and_is_not_kept(page: Page) -> None:
    await page.fill("#api-key", "gw_not-a-real-key")
    await page.click("#key-save")
    status = page.locator("#key-status")
    await expect(status).to_have_attribute("data-state", "error")
    await expect(status).to_contain_text("API key refused (invalid_api_key)")
    await expect(page.locator("#submit")).to_be_disabled()
    assert await page.evaluate("() => localStorage.length") == 0
    await shot(page, "ui-wrong-key.png")


async def test_the_key_is_kept_in_local_storage_and_sent_only_in_a_header(page: Page, stack) -> None:
    urls: list[str] = []
    page.on("request", lambda request: urls.append(request.url))
    await sign_in(page, stack.api_key)
    stored = await page.evaluate("() => Object.values({...localStorage})")
    assert stored == [stack.api_key]
    await page.reload()
    await expect(page.locator("#key-status")).to_have_attribute("data-state", "ok")
    await expect(page.locator("#submit")).to_be_enabled()
    assert urls and not [url for url in urls if stack.api_key in url]


async def test_tokens_stream_in_while_it_runs_and_the_timeline_reaches_stored(page: Page, stack, http) -> None:
    await sign_in(page, stack.api_key)
    await page.evaluate(OBSERVE_TOKENS)
    await ask_llm(page, "llm_synthetic", "Tell me about lighthouses", max_tokens=100)  # a token per 20 ms
    await page.wait_for_function(TOKENS_AT_LEAST, arg=10)
    await shot(page, "ui-streaming.png")
    await expect(step(page, "stored")).to_be_visible(timeout=30_000)
    await shot(page, "ui-timeline.png")

    samples = await page.evaluate("() => window.tokenSamples")
    counts_while_running = {s["tokens"] for s in samples if s["state"] == "running" and s["tokens"] > 0}
    assert len(counts_while_running) >= 5, samples  # shown piece by piece, not at the end
    timeline = await page.locator("#timeline li").evaluate_all(TIMELINE)
    names = [s["step"] for s in timeline]
    assert names == ["submitted", "queued", "running", "first_token", "tokens", "completed", "stored"]
    times = [s["ms"] for s in timeline]
    assert times == sorted(times)
    request_id = await page.locator("#request-panel").get_attribute("data-request-id")
    record = (await http.get(f"/results/{request_id}")).json()
    assert record["status"] == "succeeded" and record["stored"] is True
    assert f"on replica {record['replica']}" in timeline[2]["detail"]
    assert await page.locator("#output").text_content() == record["outputs"]["text_output"]
    assert await page.locator("#request-panel").get_attribute("data-tokens") == "100"
    await expect(page.locator("#request-state")).to_have_text("succeeded")


async def test_cancel_stops_a_long_request(page: Page, stack, http) -> None:
    await sign_in(page, stack.api_key)
    await ask_llm(page, "llm_synthetic", "Count to five hundred", max_tokens=500)  # ~10 s of tokens
    await page.wait_for_function(TOKENS_AT_LEAST, arg=3)
    await page.click("#cancel")
    await expect(step(page, "canceled")).to_be_visible()
    await expect(page.locator("#request-state")).to_have_text("canceled")
    await expect(page.locator("#cancel")).to_be_disabled()
    await expect(step(page, "cancel")).to_contain_text("canceled")
    await shot(page, "ui-canceled.png")
    tokens = int(await page.locator("#request-panel").get_attribute("data-tokens") or 0)
    assert 3 <= tokens < 500
    request_id = await page.locator("#request-panel").get_attribute("data-request-id")
    assert (await http.get(f"/results/{request_id}")).json()["status"] == "canceled"


async def test_a_chat_prompt_is_sent_as_messages(page: Page, stack, http) -> None:
    await sign_in(page, stack.api_key)
    await page.select_option("#llm-model", "llm_echo")
    await page.check('input[name="prompt-mode"][value="chat"]')
    await page.fill("#system-message", "You answer in one word.")
    await ask_llm(page, "llm_echo", "Name a bird.", max_tokens=200)  # echoes the rendered chat
    await expect(step(page, "completed")).to_be_visible()
    await expect(page.locator("#output")).to_contain_text("Name a bird.")
    request_id = await page.locator("#request-panel").get_attribute("data-request-id")
    record = (await http.get(f"/results/{request_id}")).json()
    assert record["inputs"]["messages"] == [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a bird."},
    ]


async def test_model_output_is_shown_as_text_never_as_html(page: Page, stack) -> None:
    prompt = '<img src="x" onerror="window.pwned=1"><script>window.pwned=2</script><b>bold</b>'
    await sign_in(page, stack.api_key)
    await ask_llm(page, "llm_echo", prompt, max_tokens=200, mode="text")  # echoes the prompt back
    await expect(step(page, "completed")).to_be_visible()
    await shot(page, "ui-escaped-output.png")
    assert prompt in (await page.locator("#output").text_content() or "")
    assert await page.locator("#output *").count() == 0
    assert await page.evaluate("() => window.pwned") is None


async def test_an_image_file_is_embedded_by_clip_image(page: Page, stack, tmp_path: Path) -> None:
    image = tmp_path / "red.png"
    image.write_bytes(png_bytes((220, 20, 20)))
    await sign_in(page, stack.api_key)
    await page.check('input[name="kind"][value="image"]')
    await page.select_option("#image-model", "clip_image")
    await page.set_input_files("#image-file", str(image))
    await page.click("#submit")
    await expect(step(page, "completed")).to_be_visible()
    await expect(page.locator("#output")).to_contain_text("image_embeds: ")
    await expect(page.locator("#output")).to_contain_text("-d vector [")
    await expect(step(page, "stored")).to_be_visible()
    await shot(page, "ui-image.png")


class HookReceiver:
    """A webhook receiver on the loopback that answers 204 and counts the calls."""

    def __init__(self) -> None:
        self.port = free_port()
        self.calls = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        self.calls += 1
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


@pytest_asyncio.fixture
async def receiver() -> AsyncIterator[HookReceiver]:
    app = HookReceiver()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=app.port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    yield app
    server.should_exit = True
    await task


async def test_the_timeline_shows_the_webhook_delivery(page: Page, stack, receiver: HookReceiver) -> None:
    await sign_in(page, stack.api_key)
    await page.fill("#webhook-url", f"http://127.0.0.1:{receiver.port}/hooks/ui")
    await ask_llm(page, "llm_echo", "ring the bell", max_tokens=16)
    await expect(step(page, "webhook")).to_contain_text("delivered (1 attempt)", timeout=30_000)
    await shot(page, "ui-webhook.png")
    assert receiver.calls == 1


async def test_search_shows_a_stored_text_embed_result(page: Page, stack, http) -> None:
    text = f"A glassblower shaped a cobalt vase at noon, run {time.time_ns()}"
    request_id = await submit(http, {"model": "text_embed", "inputs": {"text": text}})
    assert (await wait_result(http, request_id))["status"] == "succeeded"
    deadline = time.monotonic() + 15
    while True:  # the binder indexes it just after storing it
        hits = (await http.post("/search", json={"text": text, "k": 1})).json()["hits"]
        if hits and hits[0]["request_id"] == request_id:
            break
        assert time.monotonic() < deadline, "the result was not searchable within 15 s"
        await asyncio.sleep(0.05)

    await sign_in(page, stack.api_key)
    await page.fill("#search-text", text)
    await page.click("#search-go")
    rows = page.locator("#search-results tbody tr")
    await expect(rows.first).to_have_attribute("data-request-id", request_id)
    await expect(page.locator("#search-status")).to_contain_text("in space minilm")
    score, model, shown_id, inputs, output = await rows.first.locator("td").all_text_contents()
    assert (model, shown_id, inputs) == ("text_embed", request_id, text)
    assert float(score) > 0.9
    assert output.startswith("384-d vector [")
    await shot(page, "ui-search.png")


async def test_the_replicas_panel_lists_the_triton_replica_and_refreshes(page: Page, stack) -> None:
    await sign_in(page, stack.api_key)
    row = page.locator(f'#replicas tbody tr[data-url="{stack.triton_grpc}"]')
    await expect(row).to_be_visible()
    url, healthy, *_, scraped, models = await row.locator("td").all_text_contents()
    assert (url, healthy) == (stack.triton_grpc, "yes")
    assert "llm_synthetic" in models.split(", ")
    assert scraped.endswith(" s ago")
    refreshes = int(await page.locator("#replicas-panel").get_attribute("data-refreshes") or 0)
    await page.wait_for_function(  # every 2 s
        "n => Number(document.getElementById('replicas-panel').dataset.refreshes) > n", arg=refreshes, timeout=6_000
    )
    await shot(page, "ui-replicas.png")


# -- first impressions: the prompt mode, an empty answer explained, the time bars ------------


async def test_the_default_mode_for_llm_is_chat_and_a_question_gets_an_answer(page: Page, stack, http) -> None:
    question = "What is the capital of France? Answer in a sentence."
    await sign_in(page, stack.api_key)
    await expect(page.locator("#llm-model")).to_have_value("llm")
    assert await page.evaluate(PROMPT_MODE) == "chat"  # llm has a chat template (GET /models)
    await expect(page.locator("#prompt-label")).to_have_text("User message")
    # Greedy, so the tiny random test model answers alike every run: its first greedy token
    # after this chat is not its end token (its answer is noise: newlines).
    await page.fill("#temperature", "0")
    await page.fill("#prompt", question)
    await page.fill("#max-tokens", "8")
    await page.click("#submit")
    await expect(step(page, "completed")).to_be_visible()
    request_id = await page.locator("#request-panel").get_attribute("data-request-id")
    record = (await http.get(f"/results/{request_id}")).json()
    assert record["inputs"]["messages"] == [{"role": "user", "content": question}]
    assert record["usage"]["completion_tokens"] > 0
    assert record["outputs"]["text_output"]
    assert await page.locator("#output").text_content() == record["outputs"]["text_output"]

    # A model whose answer is text every time (the rendered chat, echoed), chat by default too.
    await page.select_option("#llm-model", "llm_echo")
    assert await page.evaluate(PROMPT_MODE) == "chat"
    await page.fill("#max-tokens", "200")
    await page.click("#submit")
    await expect(page.locator("#request-panel")).not_to_have_attribute("data-request-id", request_id)
    await expect(step(page, "completed")).to_be_visible()
    await expect(page.locator("#output")).to_contain_text(f"<|im_start|>user\n{question}<|im_end|>")
    await expect(page.locator("#output-note")).to_be_hidden()
    await shot(page, "ui-chat-default.png")


async def test_a_prompt_mode_picked_by_hand_is_kept_across_model_changes(page: Page, stack) -> None:
    await sign_in(page, stack.api_key)
    models = await page.evaluate("() => [...document.querySelectorAll('#llm-model option')].map(o => o.value)")
    assert {"llm", "llm_ensemble"} <= set(models)
    # Not picked by hand: the page follows the model (llm_ensemble has no chat template).
    await page.select_option("#llm-model", "llm_ensemble")
    assert await page.evaluate(PROMPT_MODE) == "text"
    await expect(page.locator('input[name="prompt-mode"][value="chat"]')).to_be_disabled()
    await page.select_option("#llm-model", "llm")
    assert await page.evaluate(PROMPT_MODE) == "chat"
    # Picked by hand: text stays text for a chat model too.
    await page.check('input[name="prompt-mode"][value="text"]')
    await page.select_option("#llm-model", "llm_ensemble")
    await page.select_option("#llm-model", "llm_echo")
    assert await page.evaluate(PROMPT_MODE) == "text"
    await expect(page.locator("#prompt-mode-hint")).to_have_text("(your choice)")


async def test_an_answer_with_no_tokens_says_why_it_ended(page: Page, stack, http) -> None:
    await sign_in(page, stack.api_key)
    # llm_echo returns the prompt's tokens, then the end token: a prompt that is only the
    # test model's end token ends at once, with finish reason stop, every time.
    await ask_llm(page, "llm_echo", "<|endoftext|>", max_tokens=16, mode="text")
    await expect(step(page, "completed")).to_be_visible()
    note = page.locator("#output-note")
    await expect(note).to_be_visible()
    await shot(page, "ui-no-tokens.png")
    await expect(note).to_have_attribute("data-reason", "stop")
    await expect(note).to_contain_text("0 completion tokens: the model ended at once (finish reason stop)")
    # llm_echo has a chat template: the note says how such a model is usually asked.
    await expect(note).to_contain_text("chat messages are the usual way to ask it")
    request_id = await page.locator("#request-panel").get_attribute("data-request-id")
    record = (await http.get(f"/results/{request_id}")).json()
    assert record["usage"]["completion_tokens"] == 0 and record["outputs"]["finish_reason"] == "stop"

    # The note's button asks the same again as chat messages (the echo then has text).
    await page.click("#use-chat")
    await expect(page.locator("#request-panel")).not_to_have_attribute("data-request-id", request_id)
    await expect(step(page, "completed")).to_be_visible()
    assert await page.evaluate(PROMPT_MODE) == "chat"
    await expect(note).to_be_hidden()
    await expect(page.locator("#output")).to_contain_text("<|im_start|>user")


async def test_a_request_cancelled_before_its_first_token_says_so(page: Page, stack, http) -> None:
    tenant = "ui-cancel-queued"
    await set_tenant(stack, tenant, limits={"max_concurrent": 1})
    key = await new_key(stack, tenant)
    async with client_for(stack, key) as native, slot_held(native):  # so the page's request stays queued
        await sign_in(page, key)
        await ask_llm(page, "llm_synthetic", "Wait your turn", max_tokens=16, mode="text")
        await expect(page.locator("#request-state")).to_have_text("queued")
        await expect(page.locator("#cancel")).to_be_enabled()
        await page.click("#cancel")
        await expect(step(page, "canceled")).to_be_visible()
    note = page.locator("#output-note")
    await expect(note).to_have_attribute("data-reason", "canceled")
    await expect(note).to_contain_text("cancelled before its first token")
    await expect(page.locator("#use-chat")).to_be_hidden()  # a cancel is not the model's doing
    assert await page.locator("#request-panel").get_attribute("data-tokens") == "0"


async def test_the_time_bar_segments_add_up_to_the_total_shown(page: Page, stack, http) -> None:
    await sign_in(page, stack.api_key)
    ids = []
    for max_tokens in (5, 25):  # a token per 20 ms: the second bar is the longer one
        await ask_llm(page, "llm_synthetic", "Tell me about lighthouses", max_tokens=max_tokens)
        await expect(step(page, "stored")).to_be_visible(timeout=30_000)
        ids.append(await page.locator("#request-panel").get_attribute("data-request-id"))
        await expect(page.locator(f'#bars li[data-request-id="{ids[-1]}"]')).to_have_attribute("data-stored", "yes")
    await shot(page, "ui-time-bars.png")

    bars = await page.locator("#bars li").evaluate_all(BARS)
    assert [bar["id"] for bar in bars] == ids[::-1]  # newest first, and the newest is the current one
    assert [bar["current"] for bar in bars] == [True, False]
    for bar in bars:
        names = [segment["name"] for segment in bar["segments"]]
        assert names == ["queue", "first_token", "generation", "storing"]
        assert sum(segment["ms"] for segment in bar["segments"]) == bar["total"]
        assert bar["shown"] == f"{bar['total']} ms"
        record = (await http.get(f"/results/{bar['id']}")).json()
        timings = record["timings"]
        queue, first, generation, storing = (segment["ms"] for segment in bar["segments"])
        # The gateway's own figures, rounded at the segments' edges (each off by at most 1 ms).
        assert abs(queue - timings["queue_ms"]) <= 1
        assert abs(queue + first - (timings["queue_ms"] + timings["ttft_ms"])) <= 1
        assert abs(queue + first + generation - timings["total_ms"]) <= 1
        assert storing >= 0
    # One scale for all: a millisecond is as wide in every bar, the longest fills its track.
    longest = max(bars, key=lambda bar: bar["total"])
    assert abs(sum(s["px"] for s in longest["segments"]) - longest["track_px"]) <= 1
    for bar in bars:
        drawn = sum(s["px"] for s in bar["segments"]) / bar["track_px"]
        assert abs(drawn - bar["total"] / longest["total"]) <= 0.01, (bar, longest)
