"""The `gateway` commands that talk to a running gateway: infer, result, watch, cancel,
search. Results go to stdout (text, or JSON), so they can be piped; progress (state and
elapsed time) and errors go to stderr. Exit status 1 when a request fails, expires or
is canceled (other than by --stop-after-ms), or when the gateway refuses a call."""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Self

import httpx
import typer
from rich.console import Console
from rich.live import Live
from rich.spinner import Spinner

from gateway.client import DEFAULT_URL, GatewayClient, GatewayError
from gateway.client.base import _llm_inputs
from gateway.protocol import EventKind, ResultRecord, State
from gateway.protocol.vectors import is_packed, packed_shape

app = typer.Typer()

Url = Annotated[str, typer.Option("--url", envvar="GATEWAY_URL", help="The gateway's base URL")]

# A request ending in one of these is a failure for the exit status.
_UNSUCCESSFUL = {State.FAILED, State.EXPIRED, State.CANCELED}


class Progress:
    """What a command is waiting for, its state and the time since it began, on stderr:
    a spinner line redrawn ten times a second on a terminal, else one plain line per
    change of state (readable in logs and CI). stdout is left to the results."""

    def __init__(self, subject: str, state: str = "starting") -> None:
        self.subject = subject
        self.state = state
        self.tokens = 0
        self.started = time.monotonic()
        self._console = Console(stderr=True, highlight=False)
        self._spinner = Spinner("dots")
        self._live: Live | None = None
        if self._console.is_terminal:
            # stdout is never redirected through the live display: it would re-wrap the
            # results; output_follows() clears the spinner when both share a terminal.
            self._live = Live(
                console=self._console,
                get_renderable=self._render,
                refresh_per_second=10,
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._live.start()
        else:
            self._plain()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def set(self, state: str) -> None:
        if state != self.state:
            self.state = state
            if self._live is None:
                self._plain()

    def output_follows(self) -> None:
        """Results are about to be written while the work goes on (streamed text, watched
        events): they are the progress now, and a spinner cannot share their terminal."""
        if sys.stdout.isatty():
            self.stop()

    def stop(self) -> None:
        """Clear the spinner line."""
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _render(self) -> Spinner:
        tokens = f", {_tokens(self.tokens)}" if self.tokens else ""
        self._spinner.update(text=f"{self.subject} {self.state}{tokens}  {self.elapsed:.1f}s")
        return self._spinner

    def _plain(self) -> None:
        print(f"[{self.elapsed:7.2f}s] {self.subject} {self.state}", file=sys.stderr, flush=True)


def _tokens(count: int) -> str:
    return f"{count} token" if count == 1 else f"{count} tokens"


def _fail(message: str) -> typer.Exit:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return typer.Exit(1)


@contextmanager
def _reporting_errors(url: str) -> Iterator[None]:
    """A refusal or an unreachable gateway as one line on stderr and exit status 1."""
    try:
        yield
    except GatewayError as exc:
        retry = f" (retry after {exc.retry_after:g}s)" if exc.retry_after is not None else ""
        raise _fail(f"{exc.code}: {exc.message}{retry}") from None
    except httpx.TransportError as exc:
        raise _fail(f"cannot reach the gateway at {url}: {exc!r}") from None


def _check_outcome(request_id: str, status: State, record: ResultRecord | None) -> None:
    if status in _UNSUCCESSFUL:
        error = record.error if record else None
        raise _fail(f"{request_id} {status.value}" + (f": {error.code}: {error.message}" if error else ""))


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False), flush=True)


def _summary(record: ResultRecord) -> dict[str, Any]:
    """A record without its long vectors (`gateway result ID` prints them whole)."""
    outputs: dict[str, Any] = {}
    for name, value in (record.outputs or {}).items():
        if isinstance(value, list):
            outputs[name] = {"dim": len(value), "head": [round(float(v), 6) for v in value[:4]]}
        elif is_packed(value):  # a many-input request's vectors (float32 bytes)
            rows, dim = packed_shape(value)
            outputs[name] = {"rows": rows, "dim": dim}
        else:
            outputs[name] = value
    summary = {
        "request_id": record.request_id,
        "model": record.model,
        "status": record.status.value,
        "outputs": outputs,
    }
    if record.error:
        summary["error"] = record.error.model_dump()
    summary["timings"] = record.timings.model_dump(exclude_none=True)
    return summary


def _infer_inputs(
    prompt: str | None, model: str | None, image: Path | None, max_tokens: int, raw: bool = False
) -> tuple[str, dict[str, Any]]:
    if image is not None:
        model = model or "clip_image"
        if model != "clip_image":
            raise typer.BadParameter("an image goes to --model clip_image", param_hint="--image")
        if prompt:
            raise typer.BadParameter("give a PROMPT or --image, not both", param_hint="--image")
        return model, {"image": base64.b64encode(image.read_bytes()).decode("ascii")}
    model = model or "llm"
    if not prompt:
        raise typer.BadParameter("give a PROMPT (or --image PATH for clip_image)", param_hint="PROMPT")
    if model.startswith("llm"):
        # The ensemble takes text only; engine models take the prompt as a chat turn.
        return model, _llm_inputs(prompt, max_tokens, None, raw=raw or model == "llm_ensemble")
    if model == "clip_image":
        raise typer.BadParameter("clip_image embeds an image: give --image PATH", param_hint="--image")
    return model, {"text": prompt}  # the gateway names the models it serves if this one is unknown


def _parameters(pairs: list[str], seed: int | None) -> dict[str, Any]:
    parameters: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"{pair!r} is not key=value", param_hint="--param")
        try:  # numbers and true/false as JSON, so that temperature=0.7 goes as a number
            parameters[key.strip()] = json.loads(raw)
        except ValueError:
            parameters[key.strip()] = raw
    if seed is not None:
        parameters["seed"] = seed
    return parameters


class _StopAfter:
    """--stop-after-ms: cancel the request once the time is up. The main thread is blocked
    reading events, so a timer thread sends the cancel, through its own client; the event
    stream then ends with `canceled` and the record holds what was generated by then."""

    def __init__(self, url: str, request_id: str, seconds: float, progress: Progress) -> None:
        self.url, self.request_id, self.progress = url, request_id, progress
        self.sent = False
        self._timer = threading.Timer(seconds, self._cancel)
        self._timer.daemon = True
        self._timer.start()

    def _cancel(self) -> None:
        self.progress.set("stopping")
        try:
            with GatewayClient(self.url) as client:
                client.cancel(self.request_id)
            self.sent = True
        except GatewayError as exc:
            if exc.code != "already_finished":  # it ended first: nothing to stop
                print(f"warning: could not stop {self.request_id}: {exc}", file=sys.stderr, flush=True)
        except httpx.TransportError as exc:
            print(f"warning: could not stop {self.request_id}: {exc!r}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self._timer.cancel()
        if self._timer.is_alive():
            self._timer.join()


def _follow(client: GatewayClient, request_id: str, progress: Progress, print_tokens: bool) -> ResultRecord:
    """Follow the request's events to its end, streaming tokens to stdout if asked."""
    for event in client.events(request_id):
        if event.kind == EventKind.TOKEN:
            progress.tokens += 1
            if print_tokens:
                progress.output_follows()
                sys.stdout.write(event.text)
                sys.stdout.flush()
        elif event.terminal:
            return event.record
        elif event.kind != EventKind.OUTPUT:
            progress.set(event.kind)
    raise AssertionError("unreachable: events() ends with a terminal event or raises")


@app.command()
def infer(
    prompt: Annotated[str | None, typer.Argument(help="The prompt (llm), or the text to embed")] = None,
    model: Annotated[
        str | None,
        typer.Option(help="llm, clip_text, text_embed or clip_image (default: llm; clip_image with --image)"),
    ] = None,
    image: Annotated[
        Path | None, typer.Option(exists=True, dir_okay=False, help="An image file to embed (clip_image)")
    ] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="llm: tokens to generate at most")] = 64,
    stream: Annotated[bool, typer.Option("--stream", help="llm: print the text as it is generated")] = False,
    raw: Annotated[bool, typer.Option("--raw", help="llm: continue the prompt as raw text (no chat template)")] = False,
    stop_after_ms: Annotated[
        int | None, typer.Option(min=1, help="Cancel the request after N ms and print what arrived by then")
    ] = None,
    param: Annotated[
        list[str] | None,
        typer.Option(
            "--param", "-p", help="llm parameter key=value (temperature, top_k, top_p, repetition_penalty); repeatable"
        ),
    ] = None,
    seed: Annotated[int | None, typer.Option(help="llm: sampling seed")] = None,
    timeout_s: Annotated[
        float | None, typer.Option(help="Deadline: the request expires after this many seconds")
    ] = None,
    priority: Annotated[int, typer.Option(min=-10, max=10, help=">0 runs before 0, <0 after")] = 0,
    url: Url = DEFAULT_URL,
) -> None:
    """Run a request and print its result: the text (llm), or a JSON summary (embeddings)."""
    model_name, inputs = _infer_inputs(prompt, model, image, max_tokens, raw)
    parameters = _parameters(param or [], seed)
    progress = Progress("request", "submitting")
    stopper: _StopAfter | None = None
    request_id = ""
    try:
        with _reporting_errors(url), GatewayClient(url) as client, progress:
            accepted = client.submit(
                model_name, inputs, parameters=parameters, stream=stream, timeout_s=timeout_s, priority=priority
            )
            request_id = progress.subject = accepted.request_id
            progress.set(accepted.status.value)
            if stop_after_ms is not None:
                stopper = _StopAfter(url, request_id, stop_after_ms / 1000, progress)
            record = _follow(client, request_id, progress, print_tokens=stream)
    except KeyboardInterrupt:
        if not request_id:
            raise typer.Exit(130) from None
        print(
            f"\ndetached: {request_id} goes on (gateway result {request_id}, gateway cancel {request_id})",
            file=sys.stderr,
            flush=True,
        )
        raise typer.Exit(130) from None
    finally:
        if stopper is not None:
            stopper.close()

    text = (record.outputs or {}).get("text_output")
    if isinstance(text, str):
        if stream and progress.tokens:
            print(flush=True)  # end the streamed line
        elif text:
            print(text, flush=True)
    elif record.outputs:
        _print_json(_summary(record))
    stopped = stopper is not None and stopper.sent and record.status == State.CANCELED
    tokens = f", {_tokens(progress.tokens)}" if progress.tokens else ""
    note = f" (stopped after {stop_after_ms} ms)" if stopped else ""
    print(f"{request_id} {record.status.value} in {progress.elapsed:.2f}s{tokens}{note}", file=sys.stderr, flush=True)
    if not stopped:
        _check_outcome(request_id, record.status, record)


@app.command()
def result(
    request_id: Annotated[str, typer.Argument(help="The request id")],
    wait: Annotated[float | None, typer.Option(min=0, help="Wait up to N s for the request to end")] = None,
    url: Url = DEFAULT_URL,
) -> None:
    """Print a request's record (or its live state if it has not ended) as JSON."""
    progress = Progress(request_id, f"waiting up to {wait:g}s" if wait else "fetching")
    with _reporting_errors(url), GatewayClient(url) as client, progress:
        try:
            outcome = client.wait(request_id, timeout=wait) if wait else client.result(request_id)
        except TimeoutError:  # still going: show where it is
            outcome = client.result(request_id)
    _print_json(outcome.model_dump(mode="json"))
    _check_outcome(request_id, outcome.status, outcome if isinstance(outcome, ResultRecord) else None)


@app.command()
def watch(
    request_id: Annotated[str, typer.Argument(help="The request id")],
    last_event_id: Annotated[str | None, typer.Option(help="Resume after this event id")] = None,
    url: Url = DEFAULT_URL,
) -> None:
    """Follow a request's events until it ends, each as a JSON line {id, event, data}."""
    record: ResultRecord | None = None
    with _reporting_errors(url), GatewayClient(url) as client, Progress(request_id, "connecting") as progress:
        for event in client.events(request_id, last_event_id):
            progress.output_follows()
            print(json.dumps({"id": event.id, "event": event.kind, "data": event.data}, ensure_ascii=False), flush=True)
            if event.kind == EventKind.TOKEN:
                progress.tokens += 1
            elif event.terminal:
                record = event.record
            else:
                progress.set(event.kind)
    if record is not None:
        print(f"{request_id} {record.status.value}", file=sys.stderr, flush=True)
        _check_outcome(request_id, record.status, record)


@app.command()
def cancel(
    request_id: Annotated[str, typer.Argument(help="The request id")],
    url: Url = DEFAULT_URL,
) -> None:
    """Cancel a request: queued work never runs, running work stops."""
    with _reporting_errors(url), GatewayClient(url) as client, Progress(request_id, "canceling"):
        answer = client.cancel(request_id)
    _print_json(answer.model_dump(mode="json"))


@app.command()
def search(
    text: Annotated[str | None, typer.Argument(help="Find stored results nearest this text")] = None,
    image: Annotated[
        Path | None, typer.Option(exists=True, dir_okay=False, help="...or nearest this image (clip space)")
    ] = None,
    space: Annotated[
        str | None, typer.Option(help="minilm or clip (default: minilm for text, clip for images)")
    ] = None,
    k: Annotated[int, typer.Option("-k", min=1, max=100, help="How many hits")] = 5,
    url: Url = DEFAULT_URL,
) -> None:
    """Print the stored results nearest a text or an image, as JSON (records without vectors)."""
    if (text is None) == (image is None):
        raise typer.BadParameter("give a TEXT or --image PATH", param_hint="TEXT")
    encoded = base64.b64encode(image.read_bytes()).decode("ascii") if image is not None else None
    with _reporting_errors(url), GatewayClient(url) as client, Progress("search", "searching"):
        found = client.search(text=text, image=encoded, space=space, k=k)
    hits = [
        {
            "request_id": hit.request_id,
            "score": hit.score,
            **({"model": hit.record.model, "inputs": hit.record.inputs} if hit.record else {}),
        }
        for hit in found.hits
    ]
    _print_json({"space": found.space, "hits": hits})
