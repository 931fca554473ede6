// The gateway's page: submit a request and watch it live, search stored results, see the
// replicas. Plain JavaScript, no dependencies. Everything shown that came from the server
// (model output above all) is put in with textContent, never parsed as HTML.
"use strict";

const KEY_STORAGE = "triton-gateway.api-key";
const REPLICAS_EVERY_MS = 2000;
const STORED_WAIT_MS = 60_000;
const WEBHOOK_WAIT_MS = 120_000;
const WEBHOOK_FINAL = new Set(["delivered", "gone", "refused", "failed"]);
const RECENT_BARS = 5;
// The bar's segments, in order: GET /results' timings, then storing as the page saw it.
const SEGMENTS = [
  ["queue", "queue"],
  ["first_token", "to first token"],
  ["generation", "generation"],
  ["storing", "storing"],
];
// Terminal event kind -> state, and back.
const TERMINAL = { completed: "succeeded", failed: "failed", canceled: "canceled", expired: "expired" };
const TERMINAL_STATE_EVENT = Object.fromEntries(Object.entries(TERMINAL).map(([kind, state]) => [state, kind]));
const STEP_LABELS = {
  submitted: "submitted",
  queued: "queued",
  running: "running",
  first_token: "first token",
  tokens: "tokens",
  output: "output",
  cancel: "cancel sent",
  completed: "completed",
  failed: "failed",
  canceled: "canceled",
  expired: "expired",
  stored: "stored",
  webhook: "webhook",
};

const $ = (id) => document.getElementById(id);

// -- calling the API -------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
  }
}

function storedKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

async function errorFrom(response) {
  let code = `http_${response.status}`;
  let message = response.statusText || "request failed";
  try {
    const body = await response.json();
    if (body && body.error) {
      code = String(body.error.code || code);
      message = String(body.error.message || message);
    }
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(response.status, code, message);
}

// The key goes in the Authorization header, never in a URL.
async function api(path, { method = "GET", body, headers = {}, signal, key = storedKey() } = {}) {
  if (!key) throw new ApiError(0, "no_api_key", "enter your API key first");
  const init = {
    method,
    headers: { Authorization: `Bearer ${key}`, Accept: "application/json", ...headers },
    cache: "no-store",
    signal,
  };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, "unreachable", `the gateway did not answer (${err.message})`);
  }
  if (!response.ok) throw await errorFrom(response);
  return response;
}

async function apiJson(path, options) {
  const response = await api(path, options);
  return response.status === 204 ? null : response.json();
}

function explain(err) {
  if (!(err instanceof ApiError)) return `${err.name || "Error"}: ${err.message}`;
  if (err.status === 401) {
    return `API key refused (${err.code}): ${err.message}. Enter the key that \`make up\` printed.`;
  }
  if (err.status === 403) return `Not allowed (${err.code}): ${err.message}.`;
  return `${err.status ? `${err.status} ` : ""}${err.code}: ${err.message}`;
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

function onFailure(err) {
  if (err && err.name === "AbortError") return;
  if (err instanceof ApiError && err.status === 401) forgetKey(explain(err));
  showError(explain(err));
}

function delay(ms, signal) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => {
      clearTimeout(timer);
      reject(new DOMException("aborted", "AbortError"));
    });
  });
}

// -- Server-Sent Events over fetch ------------------------------------------------------
// EventSource cannot send an Authorization header, so the stream is read from fetch()'s
// body and parsed here: `id:`, `event:`, `data:` lines; a blank line ends an event;
// lines starting with ':' are comments (keep-alives). Lines end in CRLF, LF or CR.

class SseParser {
  constructor(onEvent) {
    this.onEvent = onEvent;
    this.buffer = "";
    this.lastEventId = null;
    this.reset();
  }

  reset() {
    this.type = "";
    this.data = [];
  }

  push(text) {
    let chunk = this.buffer + text;
    // A CR at the very end may be the first half of a CRLF: wait for the next chunk.
    let held = "";
    if (chunk.endsWith("\r")) {
      held = "\r";
      chunk = chunk.slice(0, -1);
    }
    const lines = chunk.split(/\r\n|\r|\n/);
    this.buffer = lines.pop() + held;
    for (const line of lines) this.line(line);
  }

  line(line) {
    if (line === "") {
      if (this.data.length) {
        this.onEvent({ id: this.lastEventId, event: this.type || "message", data: this.data.join("\n") });
      }
      this.reset();
      return;
    }
    if (line.startsWith(":")) return;
    const colon = line.indexOf(":");
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") this.type = value;
    else if (field === "data") this.data.push(value);
    else if (field === "id" && !value.includes("\0")) this.lastEventId = value;
  }
}

// Reads an event stream to its end; the id of the last event seen (for Last-Event-ID).
async function readEvents(response, onEvent, lastEventId) {
  const parser = new SseParser(onEvent);
  parser.lastEventId = lastEventId;
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    parser.push(value);
  }
  return parser.lastEventId;
}

// -- the API key -----------------------------------------------------------------------

let models = [];

function setSignedIn(signedIn) {
  for (const id of ["submit", "search-go"]) $(id).disabled = !signedIn;
  document.body.dataset.signedIn = signedIn ? "yes" : "no";
}

function keyStatus(state, message) {
  const status = $("key-status");
  status.dataset.state = state;
  status.textContent = message;
}

function forgetKey(message) {
  localStorage.removeItem(KEY_STORAGE);
  setSignedIn(false);
  keyStatus(message ? "error" : "none", message || "Enter your API key.");
}

// A key is kept only once the gateway has accepted it (GET /models answers).
async function useKey(key) {
  clearError();
  keyStatus("checking", "Checking the key…");
  try {
    const answer = await apiJson("/models", { key });
    localStorage.setItem(KEY_STORAGE, key);
    models = answer.models || [];
    fillModels();
    setSignedIn(true);
    keyStatus("ok", `Key accepted: ${models.length} models.`);
    refreshReplicas();
  } catch (err) {
    // A refused key is forgotten; any other failure (gateway down) keeps a stored key.
    if (err instanceof ApiError && err.status === 401) forgetKey(explain(err));
    else keyStatus("error", explain(err));
  }
}

function fillSelect(select, items, preferred) {
  const previous = select.value;
  select.replaceChildren(...items.map((m) => new Option(m.id, m.id)));
  const keep = items.find((m) => m.id === previous) || items.find((m) => m.id === preferred);
  if (keep) select.value = keep.id;
}

function fillModels() {
  fillSelect($("llm-model"), models.filter((m) => m.kind === "llm"), "llm");
  fillSelect($("image-model"), models.filter((m) => m.kind === "embedding" && m.input === "image"), "clip_image");
  allowChat();
}

// -- one request, live -----------------------------------------------------------------

let current = null;

class Tracker {
  constructor() {
    this.t0 = performance.now();
    this.controller = new AbortController();
    this.id = null;
    this.tokens = 0;
    this.terminal = false;
    this.record = null;
    this.steps = new Map();
    this.body = null; // what was sent
    this.finishedMs = null; // when the terminal event arrived (page clock)
    this.storedMs = null; // when the page saw the result stored
  }

  get signal() {
    return this.controller.signal;
  }

  step(name, detail = "") {
    let item = this.steps.get(name);
    if (!item) {
      item = document.createElement("li");
      item.dataset.step = name;
      const label = document.createElement("span");
      label.className = "step-name";
      label.textContent = STEP_LABELS[name] || name;
      const what = document.createElement("span");
      what.className = "step-detail";
      const when = document.createElement("span");
      when.className = "step-time";
      item.append(label, what, when);
      this.steps.set(name, item);
      $("timeline").append(item);
    }
    const ms = performance.now() - this.t0;
    item.dataset.ms = ms.toFixed(0);
    item.querySelector(".step-time").textContent = formatMs(ms);
    item.querySelector(".step-detail").textContent = detail;
  }

  detail(name, detail) {
    const item = this.steps.get(name);
    if (item) item.querySelector(".step-detail").textContent = detail;
  }
}

function formatMs(ms) {
  return ms < 1000 ? `+${Math.round(ms)} ms` : `+${(ms / 1000).toFixed(2)} s`;
}

function setState(state) {
  $("request-panel").dataset.state = state;
  $("request-state").textContent = state;
}

function resetRequestView() {
  $("timeline").replaceChildren();
  $("output").textContent = "";
  $("request-id").textContent = "–";
  $("token-count").textContent = "0";
  $("request-panel").dataset.tokens = "0";
  $("request-panel").dataset.requestId = "";
  $("request-error").hidden = true;
  $("output-note").hidden = true;
  $("server-timings").textContent = "";
  setState("submitting");
}

function base64Of(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result).split(",", 2)[1] || "");
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function requestBody() {
  const kind = document.querySelector('input[name="kind"]:checked').value;
  let body;
  if (kind === "llm") {
    const prompt = $("prompt").value;
    if (!prompt.trim()) throw new ApiError(0, "invalid_inputs", "write a prompt first");
    const inputs = { max_tokens: Number($("max-tokens").value) || 64 };
    if (document.querySelector('input[name="prompt-mode"]:checked').value === "chat") {
      const system = $("system-message").value;
      inputs.messages = [
        ...(system.trim() ? [{ role: "system", content: system }] : []),
        { role: "user", content: prompt },
      ];
    } else {
      inputs.text_input = prompt;
    }
    const parameters = {};
    if ($("temperature").value !== "") parameters.temperature = Number($("temperature").value);
    body = { model: $("llm-model").value, inputs, parameters, stream: true };
  } else {
    const file = $("image-file").files[0];
    if (!file) throw new ApiError(0, "invalid_inputs", "choose an image file first");
    body = { model: $("image-model").value, inputs: { image: await base64Of(file) } };
  }
  const webhook = $("webhook-url").value.trim();
  if (webhook) body.webhook = { url: webhook };
  return body;
}

async function startRequest() {
  clearError();
  const body = await requestBody();
  current?.controller.abort(); // a new request: stop following the previous one
  const tracker = new Tracker();
  tracker.body = body;
  current = tracker;
  resetRequestView();
  tracker.step("submitted", `POST /infer (${body.model})`);
  // Accept: text/event-stream answers with the request's events at once (no second round trip).
  const response = await api("/infer", {
    method: "POST",
    body,
    headers: { Accept: "text/event-stream" },
    signal: tracker.signal,
  });
  const location = response.headers.get("Location") || "";
  tracker.id = location.split("/").pop() || null;
  let lastEventId = null;
  if ((response.headers.get("Content-Type") || "").startsWith("text/event-stream")) {
    showId(tracker);
    lastEventId = await readEvents(response, (event) => onEvent(tracker, event), null);
  } else {
    const accepted = await response.json();
    tracker.id = tracker.id || accepted.request_id;
    showId(tracker);
  }
  await followEvents(tracker, lastEventId);
  if (tracker.terminal) await followStorage(tracker);
}

function showId(tracker) {
  if (current !== tracker) return;
  $("request-id").textContent = tracker.id || "?";
  $("request-panel").dataset.requestId = tracker.id || "";
  $("cancel").disabled = !tracker.id;
  setState("queued");
}

// The stream ended before the request did (a dropped connection): resume after the last
// event seen, a few times; 204 means nothing more will come.
async function followEvents(tracker, lastEventId) {
  for (let tries = 0; !tracker.terminal && tries < 5; tries++) {
    const headers = { Accept: "text/event-stream", ...(lastEventId ? { "Last-Event-ID": lastEventId } : {}) };
    const response = await api(`/results/${tracker.id}/events`, { headers, signal: tracker.signal });
    if (response.status === 204) break;
    lastEventId = await readEvents(response, (event) => onEvent(tracker, event), lastEventId);
  }
  if (!tracker.terminal) {
    // The events are gone (or never came): read the result itself.
    const record = await apiJson(`/results/${tracker.id}`, { signal: tracker.signal });
    if (record && TERMINAL_STATE_EVENT[record.status]) finish(tracker, TERMINAL_STATE_EVENT[record.status], record);
  }
}

function parseData(text) {
  try {
    return JSON.parse(text);
  } catch {
    return {};
  }
}

function onEvent(tracker, event) {
  if (current !== tracker) return;
  const data = parseData(event.data);
  switch (event.event) {
    case "queued":
      tracker.step("queued");
      setState("queued");
      break;
    case "running": {
      const restarted = data.restarted ? ", restarted" : "";
      const resumed = data.resume_from ? `, resuming after ${data.resume_from} tokens` : "";
      tracker.step("running", `attempt ${data.attempt ?? 1}${restarted}${resumed}`);
      setState("running");
      break;
    }
    case "token":
      if (tracker.tokens === 0) tracker.step("first_token");
      tracker.tokens += Number(data.count) || 1;
      // One text node per piece: appended as text, whatever the model wrote.
      $("output").append(document.createTextNode(String(data.text_output ?? "")));
      $("token-count").textContent = String(tracker.tokens);
      $("request-panel").dataset.tokens = String(tracker.tokens);
      tracker.step("tokens", `${tracker.tokens} tokens`);
      break;
    case "output":
      tracker.step("output", describeOutputs(data));
      if (!tracker.tokens) $("output").textContent = outputText(data);
      break;
    case "error":
      showError(`The event stream stopped: ${data.code || "error"}: ${data.message || event.data}`);
      break;
    default:
      if (TERMINAL[event.event]) finish(tracker, event.event, data);
  }
}

function finish(tracker, kind, record) {
  tracker.terminal = true;
  tracker.record = record;
  tracker.finishedMs = performance.now() - tracker.t0;
  $("cancel").disabled = true;
  setState(record.status || TERMINAL[kind]);
  let detail = "";
  if (record.error) detail = `${record.error.code}: ${record.error.message}`;
  else if (record.usage) detail = `${record.usage.prompt_tokens} prompt + ${record.usage.completion_tokens} completion tokens`;
  tracker.step(kind, detail);
  const replica = record.replica || record.route?.replica;
  if (replica) {
    const why = record.route ? ` (${record.route.policy}: ${record.route.reason})` : "";
    tracker.detail("running", `on replica ${replica}${why}, attempt ${record.attempts || 1}`);
  }
  if (record.error) {
    $("request-error").textContent = `${record.status}: ${record.error.code}: ${record.error.message}`;
    $("request-error").hidden = false;
  }
  if (!tracker.tokens && record.outputs) $("output").textContent = outputText(record.outputs);
  const t = record.timings || {};
  const parts = [
    ["queue", t.queue_ms],
    ["first token", t.ttft_ms],
    ["run", t.run_ms],
    ["total", t.total_ms],
  ].filter(([, ms]) => typeof ms === "number");
  $("server-timings").textContent = parts.length
    ? `gateway timings: ${parts.map(([name, ms]) => `${name} ${Math.round(ms)} ms`).join(" · ")}`
    : "";
  explainEmptyAnswer(tracker, record);
  drawBar(tracker);
}

// Polls GET /results/<id> until the binder has stored the result, then, when a webhook
// was asked for, until its delivery has an outcome.
async function followStorage(tracker) {
  const signal = tracker.signal;
  let record = tracker.record;
  const storedBy = performance.now() + STORED_WAIT_MS;
  // Often at first, then less: the storing segment of the bar is no longer than the page's
  // polling makes it.
  let every = 25;
  while (!record.stored) {
    if (performance.now() > storedBy) {
      tracker.step("stored", "not stored yet (is the binder running?)");
      return;
    }
    await delay(every, signal);
    every = Math.min(every * 1.25, 500);
    record = await apiJson(`/results/${tracker.id}`, { signal });
  }
  const until = record.expires_at ? `, kept until ${new Date(record.expires_at).toLocaleString()}` : "";
  tracker.step("stored", `in MongoDB${until}`);
  tracker.storedMs = performance.now() - tracker.t0;
  drawBar(tracker);
  if (!record.webhook) return;
  const webhookBy = performance.now() + WEBHOOK_WAIT_MS;
  let seen = null;
  for (;;) {
    const status = record.webhook_status;
    const attempts = (record.webhook_attempts || []).length;
    const shown = `${status || "waiting"} (${attempts} attempt${attempts === 1 ? "" : "s"})`;
    if (shown !== seen) {
      tracker.step("webhook", `${shown} → ${record.webhook.url}`);
      seen = shown;
    }
    if (WEBHOOK_FINAL.has(status) || performance.now() > webhookBy) return;
    await delay(500, signal);
    record = await apiJson(`/results/${tracker.id}`, { signal });
  }
}

async function cancelRequest() {
  const tracker = current;
  if (!tracker?.id || tracker.terminal) return;
  $("cancel").disabled = true;
  tracker.step("cancel", "POST /results/…/cancel");
  try {
    const answer = await apiJson(`/results/${tracker.id}/cancel`, { method: "POST" });
    tracker.detail("cancel", answer.message || answer.status);
  } catch (err) {
    if (err instanceof ApiError && err.status === 409) tracker.detail("cancel", `too late: ${err.message}`);
    else onFailure(err);
  }
}

// -- an empty answer, explained --------------------------------------------------------

const FINISH_REASONS = {
  stop: "the model ended at once (finish reason stop): the first token it chose was its end of sequence, or a stop sequence matched",
  length: "the token limit left no room (finish reason length: max tokens, or the model's context, was used up)",
};

// An LLM answer with no text says why beside the output, and, for a chat model sent raw
// text, that chat messages are the usual way to ask it.
function explainEmptyAnswer(tracker, record) {
  const inputs = tracker.body?.inputs || {};
  if (!("text_input" in inputs || "messages" in inputs)) return; // not an LLM request
  const completion = record.usage?.completion_tokens ?? tracker.tokens;
  let reason = null;
  let why = "";
  if (record.status === "canceled" && !completion) {
    reason = "canceled";
    why = "No answer: the request was cancelled before its first token.";
  } else if (record.status === "succeeded" && !completion) {
    reason = record.outputs?.finish_reason || "unknown";
    why = `0 completion tokens: ${FINISH_REASONS[reason] || `it ended without a token (finish reason ${reason})`}.`;
  } else if (record.status === "succeeded" && !$("output").textContent.trim()) {
    reason = "blank";
    why = `${completion} completion token${completion === 1 ? "" : "s"}, none of them visible text.`;
  }
  if (!reason) return;
  const model = models.find((m) => m.id === tracker.body.model);
  // A cancel is the user's doing, not the model's: no advice on how to ask it then.
  const chatModel = reason !== "canceled" && model?.chat_template === true && "text_input" in inputs;
  if (chatModel) {
    why +=
      ` ${model.id} is a chat model (it has a chat template): given raw text it often ends at once;` +
      " chat messages are the usual way to ask it.";
  }
  $("output-note").dataset.reason = reason;
  $("output-note-text").textContent = why;
  $("use-chat").hidden = !chatModel;
  $("output-note").hidden = false;
}

// -- where the time went: one bar per request ------------------------------------------

// The last few requests sent from this page that finished, newest first.
const recent = [];

// Whole milliseconds per segment, rounded at the segments' edges so that they add up to
// the total exactly. Queue, first token and generation are the gateway's timings (run =
// first token + generation; a run with no token is all waiting for the first); storing is
// from the result reaching the page to the page seeing it stored (the page's clock, as
// close as its polling gets).
function segmentsOf(tracker) {
  const t = tracker.record?.timings || {};
  const run = Math.max(0, t.run_ms ?? 0);
  const queue = Math.max(0, t.queue_ms ?? (t.run_ms == null ? (t.total_ms ?? 0) : 0));
  const first = t.ttft_ms == null ? run : Math.min(Math.max(0, t.ttft_ms), run);
  const storing = tracker.storedMs == null ? 0 : Math.max(0, tracker.storedMs - tracker.finishedMs);
  let sum = 0;
  let edge = 0;
  const ms = [queue, first, run - first, storing].map((value) => {
    sum += value;
    const next = Math.round(sum);
    const width = next - edge;
    edge = next;
    return width;
  });
  return { ms, total: edge };
}

function drawBar(tracker) {
  if (!tracker.id || !tracker.record) return;
  if (!recent.includes(tracker)) {
    recent.unshift(tracker);
    recent.splice(RECENT_BARS);
  }
  const rows = recent.map((t) => ({ tracker: t, ...segmentsOf(t) }));
  const scale = Math.max(1, ...rows.map((row) => row.total));
  $("bars").replaceChildren(...rows.map((row) => barRow(row, scale)));
  $("bars-panel").hidden = false;
}

function barRow({ tracker, ms, total }, scale) {
  const item = document.createElement("li");
  item.dataset.requestId = tracker.id;
  item.dataset.total = String(total);
  item.dataset.state = tracker.record.status || "";
  item.dataset.stored = tracker.storedMs == null ? "no" : "yes";
  if (tracker === current) item.className = "current";
  const label = document.createElement("span");
  label.className = "bar-label";
  const state = tracker.record.status && tracker.record.status !== "succeeded" ? ` (${tracker.record.status})` : "";
  label.textContent = `${tracker.body.model}${state}`;
  label.title = tracker.id;
  const track = document.createElement("span");
  track.className = "bar-track";
  SEGMENTS.forEach(([name, text], i) => {
    const segment = document.createElement("span");
    segment.className = "segment";
    segment.dataset.segment = name;
    segment.dataset.ms = String(ms[i]);
    segment.style.width = `${(ms[i] / scale) * 100}%`; // CSSOM: allowed under the page's CSP
    segment.title = `${text}: ${ms[i]} ms`;
    track.append(segment);
  });
  const sum = document.createElement("span");
  sum.className = "bar-total";
  sum.textContent = `${total} ms`;
  sum.title =
    tracker.storedMs == null
      ? "queue + first token + generation (not stored yet)"
      : "queue + first token + generation + storing";
  item.append(label, track, sum);
  return item;
}

// -- showing outputs -------------------------------------------------------------------

function excerpt(value, limit = 160) {
  const text = typeof value === "string" ? value : JSON.stringify(value) ?? "";
  return text.length > limit ? `${text.slice(0, limit - 1)}…` : text;
}

function vectorText(vector) {
  const head = vector.slice(0, 4).map((x) => Number(x).toFixed(4));
  return `${vector.length}-d vector [${head.join(", ")}${vector.length > 4 ? ", …" : ""}]`;
}

function outputText(outputs) {
  if (!outputs) return "";
  if (typeof outputs.text_output === "string") return outputs.text_output;
  const lines = Object.entries(outputs).map(([name, value]) =>
    Array.isArray(value) && value.every((x) => typeof x === "number") ? `${name}: ${vectorText(value)}` : `${name}: ${excerpt(value, 400)}`,
  );
  return lines.join("\n");
}

function describeOutputs(outputs) {
  return Object.entries(outputs || {})
    .map(([name, value]) => (Array.isArray(value) ? `${name} (${value.length} values)` : name))
    .join(", ");
}

function outputExcerpt(record) {
  if (!record) return "(record not found)";
  if (record.error) return `${record.status}: ${record.error.code}`;
  const outputs = record.outputs || {};
  if (typeof outputs.text_output === "string") return excerpt(outputs.text_output);
  const vector = Object.values(outputs).find(Array.isArray);
  return vector ? vectorText(vector) : excerpt(outputs);
}

function inputsExcerpt(inputs) {
  if (!inputs) return "";
  for (const name of ["text", "text_input"]) if (typeof inputs[name] === "string") return excerpt(inputs[name]);
  if (Array.isArray(inputs.messages)) return excerpt(inputs.messages.map((m) => `${m.role}: ${m.content}`).join(" | "));
  return excerpt(inputs);
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

// -- search ----------------------------------------------------------------------------

async function search() {
  clearError();
  const text = $("search-text").value.trim();
  if (!text) {
    $("search-status").textContent = "Enter some text to search for.";
    return;
  }
  const body = { text, k: Number($("search-k").value) || 5 };
  if ($("search-space").value) body.space = $("search-space").value;
  $("search-status").textContent = "Searching…";
  const started = performance.now();
  try {
    const answer = await apiJson("/search", { method: "POST", body });
    const ms = Math.round(performance.now() - started);
    const hits = `${answer.hits.length} hit${answer.hits.length === 1 ? "" : "s"}`;
    $("search-status").textContent = `${hits} in space ${answer.space} (${ms} ms)`;
    const rows = answer.hits.map((hit) => {
      const tr = document.createElement("tr");
      tr.dataset.requestId = hit.request_id;
      tr.append(
        cell(Number(hit.score).toFixed(4), "num"),
        cell(hit.record?.model || "?", "nowrap"),
        cell(hit.request_id, "id"),
        cell(inputsExcerpt(hit.record?.inputs)),
        cell(outputExcerpt(hit.record)),
      );
      return tr;
    });
    $("search-results").tBodies[0].replaceChildren(...rows);
  } catch (err) {
    $("search-status").textContent = explain(err);
    onFailure(err);
  }
}

// -- replicas --------------------------------------------------------------------------

let replicaRefreshes = 0;

function number(value) {
  return typeof value === "number" ? String(Math.round(value * 10) / 10) : "–";
}

function replicaRow(replica) {
  const tr = document.createElement("tr");
  tr.dataset.url = replica.url;
  const load = replica.load;
  const pending = load
    ? Object.entries(load.pending || {})
        .filter(([, n]) => n > 0)
        .map(([model, n]) => `${model}: ${n}`)
        .join(", ") || "0"
    : "–";
  const healthy = cell(replica.removed ? "removed" : replica.healthy ? "yes" : "no", replica.healthy ? "yes" : "no");
  if (replica.last_error) healthy.title = replica.last_error;
  tr.append(
    cell(replica.url, "nowrap"),
    healthy,
    cell(`${replica.inflight} / ${replica.max_inflight}`, "num"),
    cell(load ? number(load.requests) : "–", "num"),
    cell(load ? `${number(load.used_blocks)} / ${number(load.max_blocks)}` : "–", "num"),
    cell(pending),
    cell(load ? `${load.scraped_s_ago.toFixed(1)} s ago` : "not scraped", "num"),
    cell((replica.ready_models || []).join(", ")),
  );
  return tr;
}

async function refreshReplicas() {
  const status = $("replicas-status");
  if (!storedKey()) {
    status.textContent = "Needs an operator key.";
    return;
  }
  try {
    const answer = await apiJson("/admin/replicas");
    $("replicas").tBodies[0].replaceChildren(...answer.replicas.map(replicaRow));
    replicaRefreshes += 1;
    $("replicas-panel").dataset.refreshes = String(replicaRefreshes);
    const healthy = answer.replicas.filter((r) => r.healthy).length;
    status.textContent = `${healthy} of ${answer.replicas.length} healthy · updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    status.textContent =
      err instanceof ApiError && err.status === 403
        ? `The replicas need an operator key (${err.code}).`
        : `Could not read the replicas: ${explain(err)}`;
  }
}

async function replicasLoop() {
  await refreshReplicas();
  setTimeout(replicasLoop, REPLICAS_EVERY_MS);
}

// -- wiring ----------------------------------------------------------------------------

function showKindInputs() {
  const kind = document.querySelector('input[name="kind"]:checked').value;
  $("llm-inputs").hidden = kind !== "llm";
  $("image-inputs").hidden = kind !== "image";
}

// The prompt mode the user picked by hand; null until they do.
let chosenMode = null;

function modeRadio(mode) {
  return document.querySelector(`input[name="prompt-mode"][value="${mode}"]`);
}

// Chat messages only for a model with a chat template (GET /models says which), and by
// default for one: a chat model given raw text often ends at once. A mode the user picked
// by hand is kept across model changes wherever the model allows it.
function allowChat() {
  const model = models.find((m) => m.id === $("llm-model").value);
  const chat = model?.chat_template === true;
  modeRadio("chat").disabled = !chat;
  modeRadio(chat ? (chosenMode ?? "chat") : "text").checked = true;
  $("prompt-mode-hint").textContent = !model
    ? ""
    : chat
      ? chosenMode
        ? "(your choice)"
        : "(chat model: messages by default)"
      : "(no chat template: text only)";
  showPromptMode();
}

function showPromptMode() {
  const chat = document.querySelector('input[name="prompt-mode"]:checked').value === "chat";
  $("chat-system-row").hidden = !chat;
  $("prompt-label").textContent = chat ? "User message" : "Prompt";
}

function start() {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault(); // a form submission would put the key in the URL
    const key = $("api-key").value.trim();
    $("api-key").value = "";
    if (key) useKey(key);
  });
  $("key-forget").addEventListener("click", () => forgetKey());
  $("submit-form").addEventListener("submit", (event) => {
    event.preventDefault();
    startRequest().catch((err) => {
      if (err && err.name === "AbortError") return;
      if (current) {
        setState("error");
        $("cancel").disabled = true;
      }
      onFailure(err);
    });
  });
  $("cancel").addEventListener("click", () => cancelRequest());
  $("search-form").addEventListener("submit", (event) => {
    event.preventDefault();
    search();
  });
  for (const radio of document.querySelectorAll('input[name="kind"]')) radio.addEventListener("change", showKindInputs);
  for (const radio of document.querySelectorAll('input[name="prompt-mode"]')) {
    radio.addEventListener("change", () => {
      chosenMode = radio.value; // only a user's click fires change
      allowChat();
    });
  }
  $("use-chat").addEventListener("click", () => {
    if (current?.body) $("llm-model").value = current.body.model;
    chosenMode = "chat";
    allowChat();
    $("submit-form").requestSubmit();
  });
  $("llm-model").addEventListener("change", allowChat);
  $("image-file").addEventListener("change", () => {
    const file = $("image-file").files[0];
    const preview = $("image-preview");
    if (preview.src) URL.revokeObjectURL(preview.src);
    preview.hidden = !file;
    if (file) preview.src = URL.createObjectURL(file);
  });
  setSignedIn(false);
  const key = storedKey();
  if (key) useKey(key);
  replicasLoop();
}

start();
