"""Request bodies of Anthropic's Messages API, field by field against its reference (the
`anthropic` package's MessageCreateParams and MessageCountTokensParams).

As for the OpenAI bodies (gateway.server.openai.schemas), every field is honoured or
refused by name: unknown fields are kept aside and refused (400) when set to anything but
a neutral value; known ones are typed strictly. `cache_control` is accepted wherever
Anthropic takes it and asks for nothing: every prompt's prefix is cached by the engines
anyway. Content blocks are read as one shape whose `type` says which fields it needs
(messages.py checks them, naming the block): text, tool_use and tool_result here; other
types (image, document, thinking, server tools' blocks) are refused by their type."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.protocol.storable import StorableDict
from gateway.server.openai.schemas import Body, FunctionName, Stop, Text

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


class MessageParam(Body):
    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock] = Field()


class Tool(Body):
    """A client tool: {name, description, input_schema}. Anthropic's server tools (their
    `type` is a versioned name: web_search_20250305, bash_20250124, ...) are refused by it."""

    type: str | None = Field(default=None, max_length=64)  # custom (or none)
    name: FunctionName
    description: Text | None = None
    input_schema: StorableDict | None = None
    cache_control: CacheControl | None = None


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None  # tool
    disable_parallel_tool_use: bool | None = None


class RequestMetadata(Body):
    user_id: str | None = Field(default=None, max_length=256)


class Thinking(Body):
    type: str = Field(max_length=64)  # disabled only (messages.py refuses the others)
    budget_tokens: int | None = None


class CountTokensRequest(Body):
    """What a prompt is: POST /v1/messages/count_tokens takes this alone."""

    model: str = Field(max_length=128)
    messages: list[MessageParam] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Text | list[ContentBlock] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None  # (every prefix is cached: asks for nothing)


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
