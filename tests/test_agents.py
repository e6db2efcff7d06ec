"""An agent loop through `/v1/responses`, as applications build one: the OpenAI Agents SDK's
`OpenAIResponsesModel` against the gateway on the built-in engine, with a Python function tool.
The model calls the tool, gets its result back, then answers."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from agents import (
    Agent,
    MessageOutputItem,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    ToolCallItem,
    ToolCallOutputItem,
    function_tool,
    set_tracing_disabled,
)

from backends.builtin import BuiltinBackend, EngineConfig

from .conftest import ADMIN_KEY, gateway_app, serve_app, usage_records, wait_ready

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    backend = BuiltinBackend(EngineConfig(engine_process=False, dtype="float32"))
    with serve_app(gateway_app({backend.model_id: backend}, tmp_path_factory.mktemp("gw"))) as url:
        wait_ready(url)
        yield url


def test_an_agent_calls_its_tool_then_answers(base_url):
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"It is 21 C and sunny in {city}."

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=ADMIN_KEY, max_retries=0)
        # "required" makes the first turn one call; the SDK sets it back to auto once the tool has
        # run, so the second turn answers. Greedy, so the run is the same every time.
        settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=200)
        agent = Agent(name="weather", instructions="You answer questions about the weather in one short sentence.",
                      model=OpenAIResponsesModel(MODEL, client), tools=[get_weather], model_settings=settings)
        question = "What is the weather like in Paris?"
        result = await Runner.run(agent, question, max_turns=3)
        streamed = Runner.run_streamed(agent, question, max_turns=3)  # the same loop over streamed responses
        async for _ in streamed.stream_events():
            pass
        return result, streamed

    set_tracing_disabled(True)
    result, streamed = asyncio.run(run())
    items = result.new_items
    assert [type(item) for item in items] == [ToolCallItem, ToolCallOutputItem, MessageOutputItem], items
    arguments = json.loads(items[0].raw_item.arguments)
    assert cities == [arguments["city"]] * 2 and cities[0]  # the tool ran once a run, with the model's arguments
    assert streamed.final_output == result.final_output
    assert items[1].output == f"It is 21 C and sunny in {cities[0]}."
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert len(result.raw_responses) == 2
    records = usage_records(base_url, "default", 4)
    assert {r["request_id"] for r in records} >= {r.response_id for r in result.raw_responses}
    assert {r["api"] for r in records} == {"responses"}
