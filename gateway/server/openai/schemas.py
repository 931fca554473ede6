"""Request bodies of the OpenAI-compatible API. Unknown fields are ignored (OpenAI's SDKs
send fields a server may not know); fields we cannot honour are refused by name."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from gateway.server.models.inputs import MAX_TEXT_CHARS

Text = Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]
Stop = Annotated[str, StringConstraints(min_length=1, max_length=256)]
MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)]


class Lenient(BaseModel):
    """Unknown fields are ignored (the SDKs send fields a server may not know), but the
    known ones are typed strictly: "stream": "yes" or "max_tokens": true is refused."""

    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(Lenient):
    type: str = "text"
    text: Text = ""


class Message(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or a list of content parts of which text ones are used.
    content: Text | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if part.type in ("text", "input_text", "output_text"))
        return self.content or ""


class StreamOptions(Lenient):
    include_usage: bool = False


class Sampling(Lenient):
    """What chat, completions and responses share."""

    model: str = Field(max_length=128)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | list[Stop] | None = Field(default=None)
    user: str | None = Field(default=None, max_length=256)
    metadata: Metadata | None = None

    def stop_words(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)[:16]


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=32768)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=32768)


class CompletionRequest(Sampling):
    prompt: Text | list[Text]
    max_tokens: int | None = Field(default=16, ge=1, le=32768)
    echo: bool = False
    suffix: str | None = None


class EmbeddingRequest(Lenient):
    model: str = Field(max_length=128)
    input: Text | list[Text] = Field()
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = Field(default=None, max_length=256)


class ResponseInputMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    type: str | None = None

    def as_message(self) -> Message:
        return Message(role=self.role, content=self.content)


class ResponseRequest(Sampling):
    input: Text | list[ResponseInputMessage]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=32768)
    background: bool = False
    store: bool = True
    previous_response_id: str | None = None


def unsupported(body: BaseModel, fields: dict[str, Any]) -> str | None:
    """The first field set to a value we cannot honour, if any."""
    for name, neutral in fields.items():
        value = getattr(body, name, neutral)
        if value not in (neutral, None):
            return name
    return None


BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class BatchRequest(Lenient):
    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str = Field(max_length=64)
    completion_window: str = "24h"
    metadata: Metadata | None = None


class BatchLine(Lenient):
    """One line of a batch's input file."""

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"] = "POST"
    url: str = Field(max_length=64)
    body: dict[str, Any]
