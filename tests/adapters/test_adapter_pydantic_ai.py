"""The pydantic-ai adapter: pydantic-ai's `Model` interface (request, request_stream, count_tokens)
on the shared SmolLM2 engine, driven through pydantic-ai's own `Agent` (text, tool-mode and native
structured output, function tools, streaming) and through direct model requests."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("pydantic_ai")

from pydantic import BaseModel  # noqa: E402
from pydantic_ai import Agent, ImageUrl, NativeOutput  # noqa: E402
from pydantic_ai.exceptions import UsageLimitExceeded  # noqa: E402
from pydantic_ai.messages import (ModelRequest, ModelResponse, TextPart, ToolCallPart, ToolReturnPart,  # noqa: E402
                                  UserPromptPart)
from pydantic_ai.models import ModelRequestParameters  # noqa: E402
from pydantic_ai.tools import ToolDefinition  # noqa: E402
from pydantic_ai.usage import UsageLimits  # noqa: E402

from radix_backend.adapters.pydantic_ai import RadixModel, chat_messages, sampling_params, tool_plan  # noqa: E402
from radix_backend.errors import InvalidRequestError  # noqa: E402


class City(BaseModel):
    name: str
    country: str


WEATHER_TOOL = ToolDefinition(name="get_weather", description="Weather of a city.",
                              parameters_json_schema={"type": "object", "properties": {"city": {"type": "string"}},
                                                      "required": ["city"]})


@pytest.fixture(scope="module")
def model(engine):
    return RadixModel(engine)


def _ask(text: str) -> list:
    return [ModelRequest(parts=[UserPromptPart(text)])]


def test_history_settings_and_tool_choice_map_to_the_engine(model):
    history = [ModelRequest(parts=[UserPromptPart("Weather in Oslo?")], instructions="Be brief."),
               ModelResponse(parts=[ToolCallPart("get_weather", {"city": "Oslo"}, tool_call_id="c1")]),
               ModelRequest(parts=[ToolReturnPart("get_weather", "rain", tool_call_id="c1")])]
    params = ModelRequestParameters(function_tools=[WEATHER_TOOL], allow_text_output=True)
    assert chat_messages(model, history, params) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": '{"name": "get_weather", "arguments": {"city": "Oslo"}}'},
        {"role": "tool", "content": "rain"}]
    specs, allow_text = tool_plan({}, params)
    assert [s.name for s in specs] == ["get_weather"] and allow_text
    assert tool_plan({"tool_choice": "none"}, params) == ([], True)
    assert tool_plan({"tool_choice": "required"}, params)[1] is False
    p = sampling_params({"max_tokens": 7, "temperature": 0.3, "top_p": 0.8, "seed": 2, "stop_sequences": ["\n"]}, 99)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.seed, p.stop) == (7, 0.3, 0.8, 2, ["\n"])
    assert sampling_params({}, 99).temperature == 0.0 and sampling_params({}, 99).max_new_tokens == 99
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        sampling_params({"logit_bias": {"5": 1}}, 99)


def test_direct_requests_report_usage_with_cached_tokens(model, engine):
    params = ModelRequestParameters()
    prompt = _ask("Answer in one short sentence. What is a radix tree?")
    first = asyncio.run(model.request(prompt, {"max_tokens": 24}, params))
    second = asyncio.run(model.request(prompt, {"max_tokens": 24}, params))
    assert isinstance(first.parts[0], TextPart) and first.parts[0].content
    assert first.parts[0].content == second.parts[0].content  # greedy: one answer
    assert second.usage.input_tokens > 0 and second.usage.cache_read_tokens > 0
    assert first.model_name == model.model_name and first.finish_reason in ("stop", "length")
    counted = asyncio.run(model.count_tokens(prompt, {}, params))
    assert counted.input_tokens == second.usage.input_tokens
    with pytest.raises(InvalidRequestError, match="ImageUrl"):
        asyncio.run(model.request([ModelRequest(parts=[UserPromptPart(["Describe", ImageUrl("https://x/y.png")])])],
                                  {}, params))


def test_agent_text_answer(model):
    result = Agent(model, instructions="You are a concise assistant.").run_sync(
        "What is the capital of France?", model_settings={"max_tokens": 20})
    assert "Paris" in result.output
    assert result.usage.requests == 1 and result.usage.output_tokens > 0


def test_agent_structured_output_in_tool_and_native_modes(model):
    tool_mode = Agent(model, output_type=City, instructions="Extract the city.").run_sync(
        "Paris is the capital of France.")
    assert tool_mode.output == City(name="Paris", country="France")
    native = Agent(model, output_type=NativeOutput(City), instructions="Extract the city as JSON.").run_sync(
        "Rome is the capital of Italy.")
    assert isinstance(native.output, City) and native.output.name  # decoded under City's schema: always parses


def test_agent_tool_loop_calls_the_tool_and_feeds_its_result_back(model):
    agent = Agent(model, instructions="Use the tool to get the weather, then answer.")
    calls = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Weather of a city."""
        calls.append(city)
        return f"sunny in {city}"

    try:
        result = agent.run_sync("What's the weather in Paris?", model_settings={"max_tokens": 60},
                                usage_limits=UsageLimits(request_limit=3))
        answered = "sunny" in result.output.lower()
    except UsageLimitExceeded:  # the 135M model may keep calling the tool instead of answering
        answered = False
    assert calls and calls[0] == "Paris"  # the constrained call parsed into the tool's arguments
    seen = []
    original = model.engine.agenerate

    async def spy(**kwargs):
        seen.append(kwargs["messages"])
        return await original(**kwargs)
    model.engine.agenerate = spy
    try:
        agent.run_sync("What's the weather in Paris?", model_settings={"max_tokens": 60},
                       usage_limits=UsageLimits(request_limit=2))
    except UsageLimitExceeded:
        pass
    finally:
        del model.engine.agenerate
    assert {"role": "tool", "content": "sunny in Paris"} in seen[1]  # the tool's result reached the model
    if not answered:
        pytest.xfail("SmolLM2-135M calls the tool again instead of answering from its result")


def test_streamed_text_and_streamed_structured_output(model):
    agent = Agent(model, instructions="You are a concise assistant.")

    async def stream_text():
        async with agent.run_stream("Say hello to the user.", model_settings={"max_tokens": 12}) as run:
            deltas = [d async for d in run.stream_text(delta=True)]
        return deltas, run
    deltas, run = asyncio.run(stream_text())
    assert len(deltas) > 1 and "".join(deltas).strip()
    assert run.usage.output_tokens > 0

    async def stream_city():
        async with Agent(model, output_type=City, instructions="Extract the city.").run_stream(
                "Paris is the capital of France.") as run:
            return await run.get_output()
    assert asyncio.run(stream_city()) == City(name="Paris", country="France")


def test_default_model_is_the_process_shared_engine():
    from radix_backend.engine import get_engine
    assert RadixModel().engine is get_engine()
