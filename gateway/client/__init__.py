"""Client SDK for the gateway's HTTP API: `GatewayClient` (sync) and `AsyncGatewayClient`.

    with GatewayClient() as client:                      # GATEWAY_URL, else 127.0.0.1:8080
        print(client.generate("The best thing about Triton is", 32))
        accepted = client.submit("llm", {"text_input": "Hi", "max_tokens": 16}, stream=True)
        for piece in client.stream_text(accepted.request_id):
            print(piece, end="", flush=True)

    async with AsyncGatewayClient() as client:
        record = await client.wait((await client.submit("text_embed", {"text": "a cat"})).request_id)

The client needs only httpx, httpx-sse and pydantic: `pip install triton-gateway`.
"""

from gateway.client.aio import AsyncGatewayClient
from gateway.client.base import DEFAULT_URL, Event, GatewayError, Outcome, Submitted, default_url
from gateway.client.sync import GatewayClient

__all__ = [
    "DEFAULT_URL",
    "AsyncGatewayClient",
    "Event",
    "GatewayClient",
    "GatewayError",
    "Outcome",
    "Submitted",
    "default_url",
]
