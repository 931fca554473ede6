"""Request bodies of Anthropic's Messages API, field by field against its reference (the
`anthropic` package's MessageCreateParams and MessageCountTokensParams).

As for every door's bodies (gateway.server.calls.terms), every field is honoured or
refused by name: unknown fields are kept aside and refused (400) when set to anything but
a neutral value; known ones are typed strictly. `cache_control` is accepted wherever
Anthropic takes it and asks for nothing: every prompt's prefix is cached by the engines
anyway. Content blocks are read as one shape whose `type` says which fields it needs
(messages.py checks them, naming the block): text, tool_use and tool_result here; other
types (image, document, server tools' blocks) are refused by their type; a thinking block
given back (an earlier answer's, from a model that reasons) is left out of the prompt, as
Anthropic's API itself drops earlier turns' thinking.

A client's optional asks that only ask for more than these models have are accepted and
ignored (IGNORED, and the README's table): the call is served without them and the answer
says so in a `Warning` header (messages.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.protocol.storable import StorableDict, StorableList
from gateway.server.calls.terms import Body, FunctionName, Stop, Text

# Anthropic's stop_sequences, capped as the engines' stop words are.
MAX_STOP_SEQUENCES = 16
MAX_MESSAGES = 256


class CacheControl(Body):
    type: Literal["ephemeral"] = "ephemeral"
    ttl: Literal["5m", "1h"] | None = None


class ContentBlock(Body):
    type: str = Field(max_length=64)
    text: Text | None = None  # text
    id: str | None = Field(default=None, min_length=1, max_length=256)  # tool_use
    name: FunctionName | None = None  # tool_use
    input: StorableDict | None = None  # tool_use
    tool_use_id: str | None = Field(default=None, min_length=1, max_length=256)  # tool_result
    content: Text | list[ContentBlock] | None = None  # tool_result
    is_error: bool | None = None  # tool_result
    cache_control: CacheControl | None = None
    thinking: Text | None = None  # thinking (given back: left out of the prompt)
    signature: str | None = Field(default=None, max_length=65536)  # thinking
    data: str | None = Field(default=None, max_length=65536)  # redacted_thinking


class MessageParam(Body):
    # system: Claude Code's mid-conversation system text (its environment), kept in place.
    role: Literal["user", "assistant", "system"]
    content: Text | list[ContentBlock] = Field()


class Tool(Body):
    """A client tool: {name, description, input_schema}. Anthropic's server tools (their
    `type` is a versioned name: web_search_20250305, bash_20250124, ...) are refused by it."""

    type: str | None = Field(default=None, max_length=64)  # custom (or none)
    name: FunctionName
    # (Anthropic's limit is the request's size: Claude Code's reach ~40k characters.)
    description: Text | None = None
    input_schema: StorableDict | None = None
    cache_control: CacheControl | None = None
    # The tool-search beta's deferred tools: offered once a search finds them, and these
    # models run no tool search, so a deferred tool is not offered (messages.py).
    defer_loading: bool | None = None
    # Asks for how a call streams or is checked, not for what it says: accepted, ignored.
    strict: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: StorableList | None = None


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None  # tool
    disable_parallel_tool_use: bool | None = None


class RequestMetadata(Body):
    # Claude Code's is a JSON string of its device, account and session ids.
    user_id: str | None = Field(default=None, max_length=1024)


class Thinking(Body):
    """Extended thinking: enabled, adaptive or disabled. These models do not reason: a call
    that asks for thinking is served without it (no thinking block; accepted, ignored)."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=0)
    display: str | None = Field(default=None, max_length=64)


class OutputConfig(Body):
    # effort: how hard a reasoning model thinks (accepted, ignored). output_config.format
    # (structured outputs) would shape the answer: refused by name as any field not served.
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class ContextEdit(Body):
    # clear_thinking_*: drop earlier thinking blocks (there are none: accepted, ignored);
    # other edits (clear_tool_uses_*) would change the prompt: refused by type (messages.py).
    type: str = Field(max_length=64)
    keep: StorableDict | Literal["all"] | None = None


class ContextManagement(Body):
    edits: list[ContextEdit] | None = Field(default=None, max_length=16)


class CountTokensRequest(Body):
    """What a prompt is: POST /v1/messages/count_tokens takes this alone."""

    model: str = Field(max_length=128)
    messages: list[MessageParam] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Text | list[ContentBlock] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None  # (every prefix is cached: asks for nothing)
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=32768)
    stop_sequences: list[Stop] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    stream: bool | None = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=1000)
    metadata: RequestMetadata | None = None
    # auto and standard_only both run in the normal band (there is no priority capacity to
    # draw on by this field; an operator grants a tenant the high band).
    service_tier: Literal["auto", "standard_only"] | None = None
    # Betas' asks about how an answer is made or reported, not what it says (accepted, ignored).
    speed: str | None = Field(default=None, max_length=64)
    diagnostics: StorableDict | None = None
