"""The model registry: which models the gateway serves, under which Triton names, with
which inputs, embedding spaces and cancel behaviour. One adapter per model kind turns a
request into Triton tensors and Triton's responses into outputs and events."""

from gateway.server.models.base import InvalidInput, ModelAdapter, Piece, Run
from gateway.server.models.registry import ModelRegistry, ModelSpec

__all__ = ["InvalidInput", "ModelAdapter", "ModelRegistry", "ModelSpec", "Piece", "Run"]
