"""The sampling values an LLM call sends, for every LLM contract from one table.

The three contracts take the same parameters under names of their own (the engine's
`runtime_top_k`, the llmapi model's `sampling_param_top_k`, the ensemble's `top_k`) and in a
shape of their own (`[[value]]` with a batch dimension; `[value]` for the llmapi model, whose
max_batch_size is 0), but each parameter has one wire type whatever the contract: TYPES."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from tritonclient.grpc import InferInput

from gateway.server.models.base import scalar_tensor, tensor
from gateway.server.models.inputs import LlmParameters

# A parameter's numpy dtype and Triton datatype, in every contract that takes it.
TYPES: dict[str, tuple[Any, str]] = {
    "temperature": (np.float32, "FP32"),
    "top_k": (np.int32, "INT32"),
    "top_p": (np.float32, "FP32"),
    "repetition_penalty": (np.float32, "FP32"),
    "presence_penalty": (np.float32, "FP32"),
    "frequency_penalty": (np.float32, "FP32"),
    "seed": (np.uint64, "UINT64"),
}


def sampling_tensors(
    parameters: LlmParameters, names: Mapping[str, str], *, batched: bool = True, shared: bool = False
) -> list[InferInput]:
    """A tensor for each parameter in `names` (parameter -> the contract's input name, in the
    order sent) that the call sets; batched: `[[value]]`, else `[value]`. shared (batched
    ones): built once and shared between calls (base.scalar_tensor), the seed excepted: it is
    random unless the caller chose one, so it would only take a place in the cache."""
    items: list[InferInput] = []
    for parameter, name in names.items():
        value = getattr(parameters, parameter)
        if value is None:
            continue
        dtype, datatype = TYPES[parameter]
        if shared and batched and parameter != "seed":
            items.append(scalar_tensor(name, value, dtype, datatype))
        else:
            items.append(tensor(name, np.array([[value]] if batched else [value], dtype=dtype), datatype))
    return items
