"""A shared embedding call that fails (replicas/batching.py), against a stand-in replica
client (pure logic: which calls are made): a bad input is found by halves, one half after
the other, never with more calls in flight than the call it replaces; a replica's own
fault fails the call's requests at once; a model configuration that never comes is not
waited for."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor

from gateway.server.models.base import BatchRow
from gateway.server.replicas import batching
from gateway.server.replicas.batching import BatchedInfer


class StandIn:
    """Answers a row per input; a call holding b"bad" fails as Triton does for a bad input."""

    def __init__(self, fault: str = "StatusCode.INVALID_ARGUMENT", config_hangs: bool = False) -> None:
        self.fault, self.config_hangs = fault, config_hangs
        self.calls: list[int] = []  # rows per call, in order
        self.in_flight = self.most_in_flight = 0

    async def get_model_config(self, model: str, as_json: bool = False, client_timeout: float | None = None) -> Any:
        if self.config_hangs:
            await asyncio.sleep(3600)
        return {"config": {"max_batch_size": 64}}

    async def infer(self, model: str, inputs: list[Any], **_: Any) -> Any:
        values = list(deserialize_bytes_tensor(inputs[0]._get_content()))
        self.calls.append(len(values))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.001)
            if b"bad" in values:
                raise InferenceServerException("invalid input", status=self.fault)
            return SimpleNamespace(as_numpy=lambda name: np.ones((len(values), 4), dtype=np.float32))
        finally:
            self.in_flight -= 1


class Replica:
    def __init__(self, client: StandIn) -> None:
        self.client, self.url = client, "stand-in"


def replica(client: StandIn) -> Any:
    return Replica(client)


async def run_together(client: StandIn, texts: list[bytes]) -> list[Any]:
    batcher = BatchedInfer(calls=1)
    target = replica(client)
    return await asyncio.gather(
        *(
            batcher.infer(target, "m", BatchRow("text", text, "embedding"), f"r{i}", timeout_s=30)
            for i, text in enumerate(texts)
        ),
        return_exceptions=True,
    )


async def test_a_bad_input_in_a_shared_call_is_found_by_halves_one_after_the_other() -> None:
    client = StandIn()
    texts = [b"good"] * 30 + [b"bad"] + [b"good"] * 33  # 64 ready together: one call
    answers = await run_together(client, texts)
    assert isinstance(answers[30], InferenceServerException)
    assert all(not isinstance(answer, Exception) for i, answer in enumerate(answers) if i != 30)
    assert client.most_in_flight == 1  # the retries take the failed call's place, no more
    assert client.calls[0] == 64 and len(client.calls) <= 1 + 2 * 6  # not 64 calls of one: about 2 log2(64)


async def test_a_call_that_fails_for_the_replicas_sake_fails_its_requests_without_retries() -> None:
    client = StandIn(fault="StatusCode.UNAVAILABLE")
    answers = await run_together(client, [b"good"] * 10 + [b"bad"])
    assert all(isinstance(answer, InferenceServerException) for answer in answers)
    assert client.calls == [11]


async def test_a_model_configuration_that_never_comes_is_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batching, "CONFIG_TIMEOUT_S", 0.05)
    client = StandIn(config_hangs=True)
    answers = await run_together(client, [b"a", b"b", b"c"])
    assert all(not isinstance(answer, Exception) for answer in answers)
    assert set(client.calls) == {1}  # max_batch_size unknown: one request a call
