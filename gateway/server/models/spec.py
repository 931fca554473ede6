"""A model as the registry file (MODELS_FILE) names it: the adapters read their settings
from it (gateway.server.models.registry says what each field means)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    kind: Literal["embedding", "llm"]
    triton_model: str | None = None
    # embedding
    input: Literal["text", "image"] = "text"
    output: str = "embedding"
    space: str | None = None
    dimensions: int | None = None
    # A text model's output that carries each input's tokens as its own tokenizer counted
    # them (the local text_embed and clip_text: num_tokens): the usage comes from it, the
    # gateway only bounds it at admission (from the text's length, capped by max_input_tokens:
    # for an embedding model the most tokens it counts for one text, its truncation).
    count_output: str | None = None
    # llm
    mode: Literal["engine", "llmapi", "ensemble"] = "ensemble"
    stop_model: str | None = None
    # A Hugging Face tokenizer directory ($VARS expanded): engine and llmapi tokenize with it;
    # embedding models use it only to count usage.
    tokenizer: str | None = None
    max_input_tokens: int | None = None
    context_length: int | None = None  # default: the model's own (config.json)
    max_output_tokens: int = 4096
    # engine: it takes cache_salt_id (its prefix cache salted per tenant; otherwise the
    # engine's reuse counts are not reported, since they cross tenants).
    cache_salt: bool = False
    # ensemble: it takes return_num_input_tokens / return_num_output_tokens (tensorrtllm_backend's
    # engine has them; an older ensemble that does not pass them on says false here).
    token_counts: bool = True
    tokens_per_block: int = 32

    @model_validator(mode="after")
    def _engine_needs_tokenizer(self) -> ModelSpec:
        if self.kind == "llm" and self.mode in ("engine", "llmapi") and not self.tokenizer:
            raise ValueError(f"model {self.name}: {self.mode} mode needs a tokenizer directory")
        return self
