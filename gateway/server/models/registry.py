"""Which models exist, read once from a TOML file (MODELS_FILE) or, without one, the
local profile's models. Everything the gateway knows about a model comes from here:
its Triton name, kind, inputs, embedding space, and how a running request is stopped.

    [[model]]
    name = "text_embed"         # what clients ask for
    kind = "embedding"          # embedding | llm
    triton_model = "text_embed" # default: name
    input = "text"              # embedding: text | image
    output = "embedding"        # embedding: the output tensor
    space = "minilm"            # embedding: vector-index space (optional)
    count_output = "num_tokens" # embedding: each text's token count as the model answers it (optional)
    max_input_tokens = 256      # embedding: the most tokens the model counts a text (its truncation)

    [[model]]
    name = "llm"
    kind = "llm"
    mode = "engine"             # llm: engine | llmapi | ensemble (see below)
    triton_model = "llm_engine"
    tokenizer = "$LLM_MODEL_DIR" # engine, llmapi: the model's Hugging Face tokenizer directory

    [[model]]
    name = "llm"
    kind = "llm"
    mode = "llmapi"
    triton_model = "tensorrt_llm"
    tokenizer = "/models/Llama-3.1-8B-Instruct"

The three LLM contracts (docs/deployment.md says which to choose):
- engine: TensorRT-LLM's `tensorrt_llm` model on a prebuilt TensorRT engine (token ids in and
  out): the gateway tokenizes and detokenizes.
- llmapi: TensorRT-LLM's llmapi model (the PyTorch backend; text in and out): the gateway
  sends text but still tokenizes, for admission, routing and usage.
- ensemble: a text-in, text-out ensemble (tokenizing inside Triton); no usage counts.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from gateway.server.models.base import InvalidInput, ModelAdapter
from gateway.server.models.embedding import EmbeddingAdapter
from gateway.server.models.llm_engine import EngineLlmAdapter
from gateway.server.models.llm_ensemble import EnsembleLlmAdapter
from gateway.server.models.llm_llmapi import LlmapiLlmAdapter
from gateway.server.models.spec import ModelSpec

__all__ = ["LOCAL_PROFILE", "ModelRegistry", "ModelSpec", "build_adapter", "load_specs"]


LOCAL_PROFILE = [
    # The LLM on its engine, with the gateway's own tokens (the launcher sets LLM_MODEL_DIR).
    ModelSpec(
        name="llm", kind="llm", mode="engine", triton_model="llm_engine", tokenizer="$LLM_MODEL_DIR", cache_salt=True
    ),
    # The same engine through the text ensemble (tokenizing inside Triton), as clients of
    # Triton's own API call it; a stop request ends a running one.
    # (Its tokenizer counts the prompt at admission, for tokens per minute.)
    ModelSpec(
        name="llm_ensemble",
        kind="llm",
        mode="ensemble",
        triton_model="llm",
        stop_model="llm_engine",
        tokenizer="$LLM_MODEL_DIR",
    ),
    # The same model behind TensorRT-LLM's llmapi contract (text in and out), on a stand-in.
    ModelSpec(name="llm_llmapi", kind="llm", mode="llmapi", tokenizer="$LLM_MODEL_DIR"),
    # Synthetic engines (no compute): a steady token stream for measuring the relay, and
    # an echo of the prompt for checking detokenization of any text.
    ModelSpec(
        name="llm_synthetic",
        kind="llm",
        mode="engine",
        tokenizer="$LLM_MODEL_DIR",
        context_length=8192,
        cache_salt=True,
    ),
    ModelSpec(
        name="llm_echo", kind="llm", mode="engine", tokenizer="$LLM_MODEL_DIR", context_length=8192, cache_salt=True
    ),
    # An agent CLI's stand-in (model_repo/local/llm_agent): a context that holds their prompts.
    ModelSpec(
        name="llm_agent", kind="llm", mode="engine", tokenizer="$LLM_MODEL_DIR", context_length=131072, cache_salt=True
    ),
    ModelSpec(name="clip_image", kind="embedding", input="image", output="image_embeds", space="clip"),
    # (They count their texts' tokens themselves, num_tokens; the gateway's tokenizers only
    # count where an answer comes without it, and bound admission's reservation by the cap.)
    ModelSpec(
        name="clip_text",
        kind="embedding",
        input="text",
        output="text_embeds",
        space="clip",
        tokenizer="$CLIP_MODEL_DIR",
        count_output="num_tokens",
        max_input_tokens=77,
    ),
    ModelSpec(
        name="text_embed",
        kind="embedding",
        input="text",
        output="embedding",
        space="minilm",
        dimensions=384,
        tokenizer="$TEXT_EMBED_MODEL_DIR",
        count_output="num_tokens",
        max_input_tokens=256,  # the model's max_length (model_repo/local/text_embed)
    ),
]


def load_specs(path: Path | None) -> list[ModelSpec]:
    if path is None:
        return list(LOCAL_PROFILE)
    document = tomllib.loads(path.read_text())
    return [ModelSpec.model_validate(entry) for entry in document.get("model", [])]


def build_adapter(spec: ModelSpec) -> ModelAdapter:
    adapter = _adapter(spec)
    adapter.shared_prefix_cache = spec.kind == "llm" and not spec.cache_salt
    return adapter


def _adapter(spec: ModelSpec) -> ModelAdapter:
    triton_model = spec.triton_model or spec.name
    if spec.kind == "embedding":
        return EmbeddingAdapter(
            spec.name,
            triton_model,
            input_kind=spec.input,
            output_name=spec.output,
            space=spec.space,
            dimensions=spec.dimensions,
            tokenizer_dir=os.path.expandvars(spec.tokenizer) if spec.tokenizer else None,
            count_output=spec.count_output,
            max_input_tokens=spec.max_input_tokens,
        )
    if spec.mode == "engine":
        return EngineLlmAdapter(spec, triton_model, tokenizer_dir=os.path.expandvars(spec.tokenizer or ""))
    if spec.mode == "llmapi":
        return LlmapiLlmAdapter(spec, triton_model, tokenizer_dir=os.path.expandvars(spec.tokenizer or ""))
    tokenizer = os.path.expandvars(spec.tokenizer) if spec.tokenizer else None
    return EnsembleLlmAdapter(
        spec.name, triton_model, stop_model=spec.stop_model, tokenizer_dir=tokenizer, token_counts=spec.token_counts
    )


class ModelRegistry:
    def __init__(self, specs: list[ModelSpec]) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique: {names}")
        self.specs = {s.name: s for s in specs}
        self.adapters: dict[str, ModelAdapter] = {s.name: build_adapter(s) for s in specs}

    @classmethod
    def from_file(cls, path: Path | None) -> ModelRegistry:
        return cls(load_specs(path))

    def get(self, name: str) -> ModelAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise InvalidInput("unknown_model", f"unknown model {name!r}; served: {', '.join(sorted(self.adapters))}")
        return adapter

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    @property
    def names(self) -> list[str]:
        return sorted(self.adapters)

    def embedder(self, space: str, input_kind: str) -> EmbeddingAdapter | None:
        """The model that embeds `input_kind` (text or image) into `space`, for search."""
        for adapter in self.adapters.values():
            if isinstance(adapter, EmbeddingAdapter) and adapter.space == space and adapter.input_kind == input_kind:
                return adapter
        return None

    def spaces(self, input_kind: str) -> list[str]:
        return sorted(
            {
                a.space
                for a in self.adapters.values()
                if isinstance(a, EmbeddingAdapter) and a.space and a.input_kind == input_kind
            }
        )
