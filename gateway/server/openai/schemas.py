"""Request bodies of the OpenAI-compatible API, field by field against OpenAI's API reference
(the `openai` package's create params: chat, completions, embeddings, responses).

Every field is either honoured or refused by name: a body is read with its unknown fields
kept aside (extra="allow"), and `refuse_unsupported` answers 400 `unsupported_parameter`
naming the first field, at any depth, that is set to something other than a neutral value
(null, false, an empty list or object, or the field's documented default). Fields OpenAI
has that this gateway does not serve get a sentence saying why (UNSUPPORTED); any other
field is not a parameter of the endpoint, as OpenAI itself answers for unknown ones. The
fields declared below are honoured (some only for some models or values: the routes check
those). Known fields are typed strictly: "stream": "yes" or "max_tokens": true is refused.
Free-form JSON (tool parameters, schemas, items given back) is refused with
`unstorable_number` where it holds a number storage cannot hold (gateway.protocol.storable)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, StringConstraints, Tag

from gateway.protocol.storable import StorableDict, StorableList
from gateway.server.api.errors import ApiError
from gateway.server.calls import terms
from gateway.server.calls.terms import (
    MAX_STOP,
    Body,
    FunctionName,
    Message,
    Stop,
    Text,
)

MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)]
ServiceTier = Literal["auto", "default", "flex", "priority", "scale", "fast"]

# Why a field OpenAI has is refused (by endpoint; "*" for all).
_NO_AUDIO = "audio is not supported: these models produce text"
UNSUPPORTED: dict[str, dict[str, str]] = {
    "*": terms.UNSUPPORTED,
    "chat": {
        "audio": _NO_AUDIO,
        "modalities": "modalities other than [text] are not supported: these models produce text",
        "functions": "functions is deprecated and not supported: use tools",
        "function_call": "function_call is deprecated and not supported: use tool_choice",
        "prediction": "prediction (predicted outputs) is not supported",
        "web_search_options": "web search is not supported",
        "store": "store: true is not supported: there is no stored-completions API here (every request's "
        "record is kept under its request id)",
    },
    "completions": {
        "echo": "echo is not supported",
        "suffix": "suffix is not supported: these models do not fill in the middle",
        "best_of": "best_of other than n is not supported",
    },
    "batches": {
        "output_expires_after": "output_expires_after is not supported",
    },
    "responses": {
        "access_programs": "access_programs is not supported",
        "background_options": "background_options is not supported",
        "context_management": "context_management is not supported",
        "image": "image options are not supported: these models produce text",
        "prompt": "prompt templates are not supported",
        "truncation": "truncation auto is not supported: a prompt over the context is refused (disabled)",
    },
}
# Values of refused fields that ask for nothing (what the gateway does anyway).
_NEUTRAL: dict[str, dict[str, tuple[Any, ...]]] = {
    "*": terms.NEUTRAL,
    "chat": {"modalities": (["text"],), "store": (False,)},
    "responses": {"truncation": ("disabled",)},
}


def refuse_unsupported(body: BaseModel, endpoint: str) -> None:
    """400 unsupported_parameter for the first field set beyond what the endpoint honours
    (terms.refuse_unsupported, with the endpoint's reasons and neutral values)."""
    terms.refuse_unsupported(body, UNSUPPORTED.get(endpoint), _NEUTRAL.get(endpoint))


# -- chat ---------------------------------------------------------------------------------


class FunctionDefinition(Body):
    name: FunctionName
    description: Text | None = None
    parameters: StorableDict | None = None
    strict: bool | None = None


class Tool(Body):
    type: str = "function"  # function only (custom tools are refused by their type)
    function: FunctionDefinition | None = None


class NamedFunction(Body):
    name: FunctionName


class ToolChoice(Body):
    type: str = "function"  # function only (allowed_tools and custom are refused by their type)
    function: NamedFunction | None = None


class JsonSchemaFormat(Body):
    name: str = Field(max_length=64)
    description: Text | None = None
    schema_: StorableDict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(Body):
    include_usage: bool = False
    # OpenAI pads streamed deltas with an `obfuscation` field unless this is false.
    include_obfuscation: bool = True


class PromptCacheOptions(Body):
    # implicit: every prompt's prefix is cached and reused automatically (what the engines do).
    mode: Literal["implicit"] = "implicit"


class Sampling(Body):
    """What chat and completions share (responses has its own)."""

    model: str = Field(max_length=128)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    n: int | None = Field(default=None, ge=1, le=128)  # (more than the gateway's MAX_CHOICES is refused)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Stop | list[Stop] | None = Field(default=None)
    user: str | None = Field(default=None, max_length=256)
    service_tier: ServiceTier | None = None
    # Extensions (vLLM's names): the engines' top-k and repetition penalty.
    top_k: int | None = Field(default=None, ge=0, le=1000)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)

    def stop_words(self) -> list[str]:
        """The stop sequences; more than MAX_STOP are refused by name, never cut."""
        if self.stop is None:
            return []
        words = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(words) > MAX_STOP:
            raise ApiError(
                400, "invalid_request", f"stop may hold at most {MAX_STOP} sequences", details={"param": "stop"}
            )
        return words

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ApiError(
                400,
                "invalid_request",
                "stream_options is only allowed when stream is true",
                details={"param": "stream_options"},
            )

    @property
    def choices(self) -> int:
        return self.n or 1


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=32768)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=32768)
    metadata: Metadata | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: str | None = Field(default=None, max_length=128)


class CompletionRequest(Sampling):
    prompt: Text | list[Text]
    max_tokens: int | None = Field(default=16, ge=1, le=32768)
    # The log-probabilities of the chosen tokens and of this many most likely ones (0 to 5).
    logprobs: int | None = Field(default=None, ge=0, le=5)


# -- embeddings -----------------------------------------------------------------------------


class EmbeddingRequest(Body):
    model: str = Field(max_length=128)
    input: Text | list[Text] = Field()
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)  # refused for these fixed-size models (the route says)
    user: str | None = Field(default=None, max_length=256)


# -- responses ------------------------------------------------------------------------------

ItemId = Annotated[str, StringConstraints(min_length=1, max_length=256)]
ItemStatus = Literal["in_progress", "completed", "incomplete"]
# What an input item's content parts may be here: text. Others (input_image, input_file,
# refusal, ...) are refused by their type (responses/items.py names them).
RESPONSE_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponseContentPart(Body):
    type: str = Field(default="input_text", max_length=64)
    text: Text | None = None  # required for a text part (responses/items.py says so by name)
    # An output_text part of an earlier response, given back as input: what the model
    # said, with what came with it (kept as given, not read).
    annotations: StorableList | None = None
    logprobs: StorableList | None = None


ContentParts = Annotated[list[ResponseContentPart], Field(max_length=256)]


class ResponseInputMessage(Body):
    """A message item: {role, content} (OpenAI's EasyInputMessage), or a message item as
    a response's output or input_items list has it (with its id and status)."""

    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | ContentParts
    id: ItemId | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(Body):
    """A function_call output item of an earlier response, given back as input (`namespace`:
    that of a function inside a namespace tool)."""

    type: Literal["function_call"]
    call_id: ItemId
    name: FunctionName
    arguments: Text
    id: ItemId | None = None
    status: ItemStatus | None = None
    namespace: FunctionName | None = None


class FunctionCallOutputItem(Body):
    """A function's result: what the caller's code answered to the call with call_id."""

    type: Literal["function_call_output"]
    call_id: ItemId
    output: Text | ContentParts
    id: ItemId | None = None
    status: ItemStatus | None = None
    namespace: FunctionName | None = None  # (its call_id says which call it answers)


class CompactionItem(Body):
    """A compaction item POST /v1/responses/compact made, given back as input: its
    encrypted_content names the summary the gateway keeps for the tenant."""

    type: Literal["compaction"]
    encrypted_content: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    id: ItemId | None = None
    created_by: str | None = Field(default=None, max_length=256)


class OtherInputItem(Body):
    """An input item of any other type (item_reference, reasoning, built-in tools' calls):
    refused by its type (responses/items.py)."""

    type: str = Field(max_length=64)


INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "compaction")


def _input_item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None) or "message"
    return kind if kind in INPUT_ITEM_TYPES else "other"


ResponseInputItem = Annotated[
    Annotated[ResponseInputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[CompactionItem, Tag("compaction")]
    | Annotated[OtherInputItem, Tag("other")],
    Discriminator(_input_item_type),
]


class ResponseTool(Body):
    """A tool offered: {type: function, name, description, parameters, strict}; a namespace
    ({type: namespace, name, description, tools: [functions]}: functions grouped under a
    name, OpenAI's NamespaceTool); a web_search the client marks as not reaching the web
    (external_web_access false: not offered, responses/call.py). Other tool types
    (web_search that searches, file_search, custom, ...) are refused by their type."""

    type: str = Field(default="function", max_length=64)
    name: FunctionName | None = None  # required for a function (responses/call.py says so by name)
    description: Text | None = None
    parameters: StorableDict | None = None
    strict: bool | None = None
    tools: list[ResponseTool] | None = Field(default=None, max_length=128)  # a namespace's
    external_web_access: bool | None = None  # web_search
    # web_search's options (read only where it would be offered, which it never is here).
    search_context_size: str | None = Field(default=None, max_length=16)
    user_location: StorableDict | None = None
    filters: StorableDict | None = None


class ResponseToolChoice(Body):
    """{type: function, name}: this function, forced. Other types (allowed_tools, the
    built-in tools, custom) are refused by their type."""

    type: str = Field(max_length=64)
    name: FunctionName | None = None


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(default=None, max_length=64)
    description: Text | None = None
    schema_: StorableDict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Body):
    format: TextFormat | None = None


class ResponseStreamOptions(Body):
    include_obfuscation: bool = True


class ConversationParam(Body):
    id: str = Field(min_length=1, max_length=256)


INCLUDE_LOGPROBS = "message.output_text.logprobs"
# Items in one call's input (a whole conversation given back each turn fits).
MAX_INPUT_ITEMS = 2048
# A Responses input: text (its own limit, MAX_TEXT_CHARS), or at most MAX_INPUT_ITEMS items.
InputItems = Annotated[list[ResponseInputItem], Field(max_length=MAX_INPUT_ITEMS)]


class ReasoningConfig(Body):
    """How much a reasoning model thinks and whether it sums its thinking up: these models
    do not reason, so a response is served without reasoning items (accepted, ignored)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # (the older name)


ClientMetadata = Annotated[dict[MetadataKey, Annotated[str, StringConstraints(max_length=4096)]], Field(max_length=32)]


class ResponseRequest(Body):
    model: str = Field(max_length=128)
    input: Text | InputItems
    instructions: Text | None = None
    previous_response_id: str | None = Field(default=None, max_length=256)
    conversation: Annotated[str, StringConstraints(max_length=256)] | ConversationParam | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=32768)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = Field(default=None, max_length=8)
    text: TextConfig | None = None
    stream: bool | None = False
    stream_options: ResponseStreamOptions | None = None
    background: bool | None = False
    store: bool | None = None  # (true when not given, as OpenAI)
    metadata: Metadata | None = None
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=128)
    service_tier: ServiceTier | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    prompt_cache_options: PromptCacheOptions | None = None
    tools: list[ResponseTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ResponseToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1, le=128)
    reasoning: ReasoningConfig | None = None  # (accepted, ignored)
    # The client's own labels of the call (the Codex CLI's session and turn): accepted, not kept.
    client_metadata: ClientMetadata | None = None


class ResponseCompactRequest(Body):
    """POST /v1/responses/compact: the conversation to compact (input, the chain of
    previous_response_id, or both)."""

    model: str = Field(max_length=128)
    input: Text | InputItems | None = None
    instructions: Text | None = None
    previous_response_id: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    prompt_cache_options: PromptCacheOptions | None = None
    service_tier: ServiceTier | None = None


# -- batches --------------------------------------------------------------------------------

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class BatchRequest(Body):
    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str = Field(max_length=64)
    completion_window: str = "24h"
    metadata: Metadata | None = None


class BatchLine(Body):
    """One line of a batch's input file."""

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"] = "POST"
    url: str = Field(max_length=64)
    body: StorableDict
