"""What a Triton or gRPC error means for the request and the replica (pure logic, on the
exact messages Triton sends): a model that is not ready on one replica is tried elsewhere
and leaves the replica in rotation; a replica that cannot be reached is ejected."""

from __future__ import annotations

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata
from tritonclient.utils import InferenceServerException

from gateway.server.dispatch.failures import classify


def _grpc(code: grpc.StatusCode, details: str) -> AioRpcError:
    return AioRpcError(code, Metadata(), Metadata(), details=details)


def _triton(message: str, status: str | None = None) -> InferenceServerException:
    """As tritonclient raises it: from a gRPC error (with its status), or from an error
    inside a stream (a message only)."""
    return InferenceServerException(msg=message, status=status)


# Triton core (model_repository_manager, model_lifecycle), its ensemble scheduler and the
# python backend's BLS, word for word; and the "model ... unavailable" wording of the report.
MODEL_NOT_READY = {
    "a version not at ready state (gRPC UNAVAILABLE)": _triton(
        "Request for unknown model: 'llm' version 1 is not at ready state", "StatusCode.UNAVAILABLE"
    ),
    "a version not at ready state, as the gRPC error itself": _grpc(
        grpc.StatusCode.UNAVAILABLE, "Request for unknown model: 'llm' version 1 is not at ready state"
    ),
    "no version loaded (older Triton: UNAVAILABLE)": _triton(
        "Request for unknown model: 'llm' has no available versions", "StatusCode.UNAVAILABLE"
    ),
    "no version loaded": _triton("Request for unknown model: 'llm' has no available versions", "StatusCode.NOT_FOUND"),
    "not in this repository": _triton("Request for unknown model: 'llm' is not found", "StatusCode.NOT_FOUND"),
    "not in this repository (namespaced: INVALID_ARGUMENT)": _triton(
        "Request for unknown model: 'llm' is not found", "StatusCode.INVALID_ARGUMENT"
    ),
    "a composing model not ready, inside an ensemble's stream": _triton(
        "in ensemble 'llm', Request for unknown model: 'llm_engine' version 1 is not at ready state"
    ),
    "a BLS call to a model not ready": _triton(
        "Failed for execute the inference request. Model 'llm_engine' is not ready."
    ),
    "a model unavailable (gRPC UNAVAILABLE)": _triton("model 'llm' version 1 is unavailable", "StatusCode.UNAVAILABLE"),
}


@pytest.mark.parametrize("error", MODEL_NOT_READY.values(), ids=MODEL_NOT_READY.keys())
def test_a_model_not_ready_on_one_replica_is_retried_elsewhere_without_ejecting_the_replica(error) -> None:
    failure = classify(error)
    assert (failure.code, failure.retryable, failure.eject) == ("model_not_ready", True, False)


REPLICA_DOWN = {
    "connection refused": _grpc(
        grpc.StatusCode.UNAVAILABLE,
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:8001: "
        "Failed to connect to remote host: Connection refused",
    ),
    "socket closed": _triton("Socket closed", "StatusCode.UNAVAILABLE"),
    "a stream cut": _triton("Stream removed"),
}


@pytest.mark.parametrize("error", REPLICA_DOWN.values(), ids=REPLICA_DOWN.keys())
def test_a_replica_that_cannot_be_reached_is_ejected_and_the_request_retried(error) -> None:
    failure = classify(error)
    assert (failure.code, failure.retryable, failure.eject) == ("replica_unavailable", True, True)


def test_an_invalid_input_still_fails_at_once() -> None:
    failure = classify(_triton("in ensemble 'llm', [request id: <id_unknown>] unexpected shape for input 'text_input'"))
    assert (failure.code, failure.retryable, failure.eject) == ("invalid_input", False, False)


def test_a_replicas_address_in_triton_or_grpc_text_never_reaches_the_tenant() -> None:
    raw = "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.5:8001: Failed to connect"
    failure = classify(_triton(raw, "StatusCode.UNAVAILABLE"))
    assert failure.code == "replica_unavailable"
    assert "10.0.0.5" not in failure.message and "8001" not in failure.message
    assert failure.detail == raw  # for the logs and the ejection


def test_an_invalid_inputs_own_words_reach_the_tenant_without_addresses() -> None:
    failure = classify(_triton("in ensemble 'llm' at triton-0.internal:8001, invalid input: expected 2 inputs"))
    assert failure.code == "invalid_input"
    assert "expected 2 inputs" in failure.message and "triton-0.internal" not in failure.message
