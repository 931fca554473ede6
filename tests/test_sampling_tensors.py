"""The sampling values each LLM contract sends, from one table (gateway/server/models/sampling.py):
each contract's names, its shape, one wire type a parameter; the engine's tensors shared
between calls but for the seed."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.server.models.inputs import EngineParameters, LlmParameters
from gateway.server.models.llm_engine import ENGINE_SAMPLING
from gateway.server.models.llm_ensemble import ENSEMBLE_SAMPLING
from gateway.server.models.llm_llmapi import LLMAPI_SAMPLING
from gateway.server.models.sampling import TYPES, sampling_tensors

EVERY = EngineParameters(
    temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5, seed=7
)


def sent(items: list) -> dict[str, tuple[str, list[int], list]]:
    return {
        i.name(): (i.datatype(), i.shape(), np.frombuffer(i._get_content(), dtype=_dtype(i)).tolist()) for i in items
    }


def _dtype(item) -> type[np.generic]:
    return next(dtype for dtype, datatype in TYPES.values() if datatype == item.datatype())


def test_the_engine_gets_every_parameter_by_its_own_names_with_a_batch_dimension() -> None:
    assert sent(sampling_tensors(EVERY, ENGINE_SAMPLING, shared=True)) == {
        "temperature": ("FP32", [1, 1], [pytest.approx(0.7)]),
        "runtime_top_k": ("INT32", [1, 1], [40]),
        "runtime_top_p": ("FP32", [1, 1], [pytest.approx(0.9)]),
        "repetition_penalty": ("FP32", [1, 1], [pytest.approx(1.1)]),
        "presence_penalty": ("FP32", [1, 1], [0.5]),
        "frequency_penalty": ("FP32", [1, 1], [-0.5]),
        "seed": ("UINT64", [1, 1], [7]),
    }


def test_the_llmapi_model_gets_vectors_named_sampling_param() -> None:
    assert sent(sampling_tensors(EVERY, LLMAPI_SAMPLING, batched=False)) == {
        "sampling_param_temperature": ("FP32", [1], [pytest.approx(0.7)]),
        "sampling_param_top_k": ("INT32", [1], [40]),
        "sampling_param_top_p": ("FP32", [1], [pytest.approx(0.9)]),
        "sampling_param_seed": ("UINT64", [1], [7]),
        "sampling_param_presence_penalty": ("FP32", [1], [0.5]),
        "sampling_param_frequency_penalty": ("FP32", [1], [-0.5]),
    }


def test_the_ensemble_gets_its_five_with_the_seed_as_random_seed() -> None:
    parameters = LlmParameters(temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1, seed=7)
    assert list(sent(sampling_tensors(parameters, ENSEMBLE_SAMPLING))) == [
        "temperature",
        "top_k",
        "top_p",
        "repetition_penalty",
        "random_seed",
    ]


def test_a_parameter_the_call_leaves_unset_is_not_sent() -> None:
    assert list(sent(sampling_tensors(EngineParameters(top_k=0), ENGINE_SAMPLING, shared=True))) == ["runtime_top_k"]
    assert sampling_tensors(EngineParameters(), LLMAPI_SAMPLING, batched=False) == []


def test_the_engines_tensors_are_shared_between_calls_but_the_seed() -> None:
    first = sampling_tensors(EVERY, ENGINE_SAMPLING, shared=True)
    second = sampling_tensors(EVERY, ENGINE_SAMPLING, shared=True)
    same = {a.name(): a is b for a, b in zip(first, second, strict=True)}
    assert same == {name: name != "seed" for name in ENGINE_SAMPLING.values()}


def test_unshared_tensors_are_built_for_each_call() -> None:
    first = sampling_tensors(EVERY, ENSEMBLE_SAMPLING)
    second = sampling_tensors(EVERY, ENSEMBLE_SAMPLING)
    assert not any(a is b for a, b in zip(first, second, strict=True))
