"""Building Triton requests in tests (direct tritonclient calls, no gateway)."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import InferRequestedOutput

from gateway.server.models.base import tensor


def llm_request(prompt: str, max_tokens: int, *, stream: bool = True, request_id: str = "", **extra: Any) -> dict:
    inputs = [
        tensor("text_input", np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
        tensor("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
        tensor("stream", np.array([[stream]], dtype=np.bool_), "BOOL"),
    ]
    if "stop_words" in extra:
        words = np.array([[w.encode() for w in extra["stop_words"]]], dtype=np.object_)
        inputs.append(tensor("stop_words", words, "BYTES"))
    if "random_seed" in extra:
        inputs.append(tensor("random_seed", np.array([[extra["random_seed"]]], dtype=np.uint64), "UINT64"))
    if "top_k" in extra:
        inputs.append(tensor("top_k", np.array([[extra["top_k"]]], dtype=np.int32), "INT32"))
    return {
        "model_name": "llm",
        "inputs": inputs,
        "outputs": [InferRequestedOutput("text_output")],
        "request_id": request_id,
    }


async def once(request: dict) -> AsyncIterator[dict]:
    yield request


async def stream_texts(client: triton_aio.InferenceServerClient, request: dict) -> list[str]:
    """Every text_output piece of a streamed llm request."""
    pieces = []
    async for result, error in client.stream_infer(once(request)):
        if error is not None:
            raise error
        pieces.append(result.as_numpy("text_output").reshape(-1)[0].decode())
    return pieces


def png_bytes(color: tuple[int, int, int] = (200, 30, 30), size: int = 48) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buffer, format="PNG")
    return buffer.getvalue()


def bytes_tensor(name: str, value: bytes) -> Any:
    return tensor(name, np.array([[value]], dtype=np.object_), "BYTES")
