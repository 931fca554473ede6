"""A create call as the gateway runs it: the request for the engine, what the response
echoes, its input items and the items before them (its chain or its conversation)."""

from typing import Any

from gateway.protocol.http import InferRequest
from gateway.server import spine
from gateway.server.api.tenancy import Caller
from gateway.server.calls import requests as call_requests
from gateway.server.calls import terms
from gateway.server.calls.requests import LlmCall, Output
from gateway.server.calls.terms import Message, unsupported
from gateway.server.openai import common
from gateway.server.openai.responses.chains import (
    continued,
    conversation_items,
    conversation_of,
)
from gateway.server.openai.responses.compactions import CompactionStore
from gateway.server.openai.responses.items import (
    chat_messages,
    input_items,
    with_ids,
)
from gateway.server.openai.responses.settings import (
    ResponseSettings,
    invalid,
    response_id,
    settings_names,
)
from gateway.server.openai.responses.store import (
    ConversationStore,
    ResponseStore,
    UnstoredSettings,
    item_bytes,
    response_entry,
)
from gateway.server.openai.schemas import (
    INCLUDE_LOGPROBS,
    ResponseRequest,
    ResponseTool,
    refuse_unsupported,
)
from gateway.server.services import Services

# -- a call, as a request ---------------------------------------------------------------------


def _settings(body: ResponseRequest, tools: list[dict[str, Any]], logprobs: bool) -> ResponseSettings:
    choice: str | dict[str, Any] = "auto"
    if isinstance(body.tool_choice, str):
        choice = body.tool_choice
    elif body.tool_choice is not None:
        choice = {"type": "function", "name": body.tool_choice.name}
    text_format = body.text.format if body.text is not None else None
    text: dict[str, Any] = {"format": {"type": "text"}}
    if text_format is not None and text_format.type == "json_object":
        text = {"format": {"type": "json_object"}}
    elif text_format is not None and text_format.type == "json_schema":
        shaped = {
            "type": "json_schema",
            "name": text_format.name or "response",
            "description": text_format.description,
            "schema": text_format.schema_,
            "strict": bool(text_format.strict),
        }
        text = {"format": shaped}
    return ResponseSettings(
        background=bool(body.background),
        store=body.store is not False,
        instructions=body.instructions,
        previous_response_id=body.previous_response_id,
        conversation=_conversation_id(body),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        max_tool_calls=body.max_tool_calls,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        top_logprobs=body.top_logprobs or 0,
        logprobs=logprobs,
        # The cap that applies: the one given, else the gateway's default (a response cut by
        # either says max_output_tokens, and this says which number it was).
        max_output_tokens=body.max_output_tokens or call_requests.DEFAULT_MAX_TOKENS,
        text=text,
        metadata=dict(body.metadata or {}),
        user=body.user,
        safety_identifier=body.safety_identifier,
        prompt_cache_key=body.prompt_cache_key,
        service_tier=terms.tier(body.service_tier).name,
    )


def _conversation_id(body: ResponseRequest) -> str | None:
    found = body.conversation
    return found if isinstance(found, str) or found is None else found.id


def _function(tool: ResponseTool, where: str) -> dict[str, Any]:
    if tool.type != "function":
        raise unsupported(
            f"{where}.type",
            f"tools of type {tool.type} are not supported: only function tools (your code runs them), namespaces "
            "of them, and web_search with external_web_access false (not offered)",
        )
    if tool.name is None:
        raise invalid(f"{where}.name", f"{where}.name: a function tool needs its name")
    strict = True if tool.strict is None else tool.strict
    return {
        "type": "function",
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": strict,
    }


def _tools(body: ResponseRequest) -> list[dict[str, Any]]:
    """The tools offered, as the response object shows them: functions, and namespaces of
    functions; a web_search that may not reach the web is left out (the client marks it as
    one it can do without); other types refused."""
    tools: list[dict[str, Any]] = []
    for index, tool in enumerate(body.tools or []):
        where = f"tools[{index}]"
        if tool.type == "web_search" and tool.external_web_access is False:
            continue  # (no search index here either: the model is not offered it)
        if tool.type == "namespace":
            if tool.name is None or not tool.tools:
                raise invalid(where, f"{where}: a namespace tool needs its name and tools")
            inner = [_function(t, f"{where}.tools[{n}]") for n, t in enumerate(tool.tools)]
            tools.append({"type": "namespace", "name": tool.name, "description": tool.description, "tools": inner})
            continue
        tools.append(_function(tool, where))
    names = set(settings_names(tools))
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        if choice.type != "function":
            raise unsupported("tool_choice.type", f"tool_choice of type {choice.type} is not supported: use function")
        if choice.name is None:
            raise invalid("tool_choice.name", "tool_choice.name: name the function to call")
        if choice.name not in names:
            raise invalid("tool_choice", f"tool_choice names {choice.name}, which is not in tools")
    elif choice == "required" and not tools:
        raise invalid("tool_choice", "tool_choice required needs tools")
    return tools


# What Responses asks of a model that reasons: its encrypted reasoning items, given back on
# the next turn. There are none here: honoured as empty (no reasoning item in the output).
INCLUDE_REASONING = "reasoning.encrypted_content"


def ignored(body: ResponseRequest) -> list[str]:
    """The optional asks accepted and not applied (the README's table), as the response's
    Warning header names them."""
    found = []
    if body.reasoning is not None and any(v is not None for v in body.reasoning.model_dump().values()):
        found.append("reasoning")
    if INCLUDE_REASONING in (body.include or []):
        found.append(f"include {INCLUDE_REASONING}")
    if any(tool.type == "web_search" and tool.external_web_access is False for tool in body.tools or []):
        found.append("tools web_search (external_web_access false: not offered)")
    return found


class Call:
    """A create call as the gateway runs it: the request, what the response echoes, its
    input items and the chain before it."""

    def __init__(
        self,
        native: InferRequest,
        settings: ResponseSettings,
        items: list[dict[str, Any]],
        chain: list[str],
        context: list[dict[str, Any]] | None = None,
    ) -> None:
        self.native, self.settings, self.items, self.chain = native, settings, items, chain
        self.ignored: list[str] = []  # the optional asks accepted and not applied (ignored())
        self.context = context or []  # the items given before its own (chain or conversation)
        self.context_bytes = sum(item_bytes(item) for item in self.context)


def _check_call_ids(context: list[dict[str, Any]], items: list[dict[str, Any]]) -> None:
    """Each function_call_output answers a function_call made before it (in the chain, the
    conversation or the input), as OpenAI checks."""
    called = {str(item.get("call_id")) for item in context if item.get("type") == "function_call"}
    for index, item in enumerate(items):
        if item["type"] == "function_call":
            called.add(str(item["call_id"]))
        elif item["type"] == "function_call_output" and str(item["call_id"]) not in called:
            raise invalid(
                f"input[{index}].call_id",
                f"input[{index}].call_id: no function call with call_id {item['call_id']} comes before this "
                "function_call_output (in the input, or the previous response's output)",
            )


async def _summaries(
    svc: Services, who: Caller, context: list[dict[str, Any]], items: list[dict[str, Any]]
) -> dict[str, str]:
    """The summaries the compaction items given name (refused by place when not kept)."""
    references = [
        (f"input[{index}].encrypted_content" if index >= 0 else "previous_response_id", str(item["encrypted_content"]))
        for index, item in [(-1, i) for i in context] + list(enumerate(items))
        if item.get("type") == "compaction"
    ]
    return await CompactionStore(svc).summaries(who.scope, references) if references else {}


async def response_call(
    body: ResponseRequest, svc: Services, who: Caller, previous: list[dict[str, Any]] | None = None
) -> Call:
    """The call as a request. `previous`: the items of previous_response_id when the caller
    holds them (a WebSocket's store: false responses), instead of reading its chain."""
    adapter = call_requests.llm(svc, body.model, chat=True)
    items = input_items(body)
    tools = _tools(body)
    refuse_unsupported(body, "responses")
    run_as = terms.tier(body.service_tier)
    for index, item in enumerate(body.include or []):
        if item not in (INCLUDE_LOGPROBS, INCLUDE_REASONING):
            raise unsupported(
                f"include[{index}]",
                f"include {item} is not supported: only {INCLUDE_LOGPROBS} (and {INCLUDE_REASONING}, empty here)",
            )
    if body.store is False and body.background:
        raise invalid("store", "a background response needs store: true (it is read back by its id)")
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true")
    # top_logprobs asks for log-probabilities as much as the include does.
    logprobs = INCLUDE_LOGPROBS in (body.include or []) or bool(body.top_logprobs)
    settings = _settings(body, tools, logprobs)
    plan = settings.plan(call_requests.tool_format(svc, body.model))
    chain: list[str] = []
    context: list[dict[str, Any]] = []
    if body.previous_response_id and settings.conversation:
        raise invalid("conversation", "previous_response_id and conversation cannot both be given")
    if body.previous_response_id and previous is not None:
        context = previous
    elif body.previous_response_id:
        chain, context = await continued(svc, who, body.previous_response_id)
    if settings.conversation:
        if not settings.store:
            raise invalid("store", "a response in a conversation is kept with it: it needs store: true")
        await conversation_of(svc, who, settings.conversation, "conversation")
        context = await conversation_items(svc, who, settings.conversation)
    if not items and not context:
        raise invalid("input", "input must not be empty")
    _check_call_ids(context, items)
    messages = chat_messages(context + items, await _summaries(svc, who, context, items))
    if body.instructions:
        messages.insert(0, Message(role="system", content=body.instructions))
    text_format = body.text.format if body.text is not None else None
    output = None  # (a forced call is the output alone: a text.format, for text, has nothing to shape)
    if not plan.forced and text_format is not None and text_format.type != "text":
        what = f"text.format {text_format.type}"
        if text_format.type == "json_object":
            output = Output(call_requests.json_guide({"type": "object"}), "text.format", what)
        elif text_format.schema_:
            output = Output(call_requests.json_guide(text_format.schema_), "text.format", what)
        else:
            output = Output(None, "text.format", what, invalid("text.format.schema", "json_schema needs a schema"))
    labels = common.metadata(body, "responses", run_as) | {"background": "true" if body.background else "false"}
    if not settings.store:
        labels["store"] = "false"
    (request,) = call_requests.requests(
        LlmCall(
            model=body.model,
            messages=terms.messages(messages),
            max_tokens=body.max_output_tokens or call_requests.DEFAULT_MAX_TOKENS,
            plan=plan,
            output=output,
            sampling=call_requests.sampling_of(body),
            top_logprobs=body.top_logprobs or 0,
            prompt_cache_key=body.prompt_cache_key,
            stream=bool(body.stream or body.background),
            labels=labels,
        ),
        adapter,
        svc,
    )
    call = Call(request, settings, items, chain, context)
    call.ignored = ignored(body)
    return call


async def keep(svc: Services, who: Caller, call: Call, request_id: str, model: str, *, resumable: bool = False) -> None:
    """Keep a stored response's settings and input items (and its place in its
    conversation); for store: false, nothing, or (`resumable`: a WebSocket's, which runs on
    when its socket closes) its settings in Redis while its events can be resumed."""
    settings = call.settings
    store = ResponseStore(svc)
    if not settings.store:
        if resumable:
            timeout_s = call.native.timeout_s or svc.settings.default_timeout_s
            try:
                await UnstoredSettings(svc).put(who.scope, request_id, settings.model_dump(), timeout_s)
            except Exception:
                await spine.cancel(svc.jobs, request_id)  # no response that would resume without its settings
                raise
        return
    # (An Idempotency-Key's replay names a response already kept: it is not kept again.)
    if await store.get(who.scope, response_id(request_id)) is not None:
        return
    given = with_ids(call.items, request_id)
    document = {
        "model": model,
        "settings": settings.model_dump(),
        "input": given,
        "chain": call.chain,
        "context_bytes": call.context_bytes,
    }
    try:
        if settings.conversation:
            calls = settings.max_calls if settings.tools else 0
            entry = response_entry(response_id(request_id), given, f"msg_{request_id}", calls)
            (document["position"],) = await ConversationStore(svc).append(who.scope, settings.conversation, [entry])
        await store.put(who.scope, response_id(request_id), document)
    except Exception:
        await spine.cancel(svc.jobs, request_id)  # nothing half done: no response without its settings
        raise
