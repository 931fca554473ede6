"""The small tensors a run sends (its flags, ids and sampling values: gateway/server/models/base.py
`scalar_tensor`, `requested_outputs`) are built once and shared by the calls that send the same
one: tritonclient copies each into the request it builds and changes none."""

from __future__ import annotations

from typing import Any

import numpy as np
import tritonclient.grpc._utils as grpc_utils

from gateway.server.models.base import requested_outputs, scalar_tensor, tensor


def request_of(inputs: list[Any], outputs: list[Any] | None = None) -> Any:
    return grpc_utils._get_inference_request(
        model_name="m",
        inputs=inputs,
        model_version="",
        request_id="",
        outputs=outputs,
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=0,
        timeout=None,
        parameters=None,
    )


def test_a_scalar_tensor_sent_again_is_the_same_one_and_carries_its_value() -> None:
    first = scalar_tensor("request_output_len", 32, np.int32, "INT32")
    assert scalar_tensor("request_output_len", 32, np.int32, "INT32") is first
    assert scalar_tensor("request_output_len", 33, np.int32, "INT32") is not first
    built = tensor("request_output_len", np.array([[32]], dtype=np.int32), "INT32")
    assert request_of([first]) == request_of([built])


def test_requests_built_from_a_shared_tensor_leave_it_as_it_was() -> None:
    shared = scalar_tensor("streaming", True, np.bool_, "BOOL")
    before = request_of([shared])
    request_of([shared, tensor("input_ids", np.array([[1, 2, 3]], dtype=np.int32), "INT32")])
    assert request_of([shared]) == before


def test_requested_outputs_are_shared_in_a_list_of_each_calls_own() -> None:
    names = ("output_ids", "sequence_length")
    first, second = requested_outputs(names), requested_outputs(names)
    assert first is not second  # (a caller may add to its list)
    assert all(a is b for a, b in zip(first, second, strict=True))
    assert [o._get_tensor().name for o in first] == list(names)
