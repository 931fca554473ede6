"""OpenAI's Agents SDK, unmodified, against the real stack over both of its Responses
transports: HTTP (SSE when streamed) and WebSocket mode (one socket for the run's turns).
An agent with a function tool, the first turn's call forced (tool_choice required, the
SDK's reset to auto after it), runs to its final output with Runner.run and
Runner.run_streamed. The model's text is noise (a tiny random GPT-2), so sampling is greedy
and the final output is a structured output (guided decoding ends it; free text would run
to max_tokens, which the SDK raises on as `incomplete`)."""

from __future__ import annotations

import json
from typing import Any, Literal

import openai
import pytest

from tests.test_openai_responses import QUESTION, TOOLS_MODEL, Forecast


def _agent(stack, websocket: bool) -> tuple[Any, Any, list[str]]:
    from agents import Agent, ModelSettings, OpenAIProvider, RunConfig, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "London", "Tokyo"]) -> str:
        """The weather in a city now."""
        asked.append(city)
        return json.dumps({"city": city, "temperature_c": 21, "sky": "clear"})

    client = openai.AsyncOpenAI(base_url=f"{stack.gateway_url}/v1", api_key=stack.api_key, max_retries=0, timeout=120)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        output_type=Forecast,
        model=TOOLS_MODEL,
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80),
    )
    provider = OpenAIProvider(openai_client=client, use_responses=True, use_responses_websocket=websocket)
    return agent, RunConfig(model_provider=provider, tracing_disabled=True), asked


@pytest.mark.parametrize("websocket", [False, True], ids=["http", "websocket"])
async def test_a_streamed_run_with_a_required_tool_reaches_its_final_output(stack, websocket) -> None:
    from agents import Runner

    agent, config, asked = _agent(stack, websocket)
    result = Runner.run_streamed(agent, QUESTION, run_config=config)
    kinds = [event.type async for event in result.stream_events()]
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert asked and asked[0] in ("Paris", "London", "Tokyo")
    assert result.is_complete and isinstance(result.final_output, Forecast)
    items = [item.type for item in result.new_items]
    assert items[:2] == ["tool_call_item", "tool_call_output_item"] and items[-1] == "message_output_item"


@pytest.mark.parametrize("websocket", [False, True], ids=["http", "websocket"])
async def test_a_run_with_a_required_tool_reaches_its_final_output(stack, websocket) -> None:
    from agents import Runner

    agent, config, asked = _agent(stack, websocket)
    result = await Runner.run(agent, QUESTION, run_config=config)
    assert asked and isinstance(result.final_output, Forecast)
    assert [item.type for item in result.new_items][-1] == "message_output_item"
