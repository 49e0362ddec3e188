"""The Haystack adapter: `RadixChatGenerator` as a Haystack chat generator on the shared SmolLM2 engine,
run directly, inside a pipeline (serialized and loaded back), and inside Haystack's own `Agent`."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("haystack")

from haystack import Pipeline  # noqa: E402
from haystack.components.agents import Agent  # noqa: E402
from haystack.components.builders import ChatPromptBuilder  # noqa: E402
from haystack.dataclasses import ChatMessage, ImageContent  # noqa: E402
from haystack.tools import tool  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from radix_backend.adapters.haystack import RadixChatGenerator  # noqa: E402
from radix_backend.errors import InvalidRequestError  # noqa: E402

CALLS: list[str] = []


@tool
def get_weather(city: str) -> str:
    """Get the current weather of a city."""
    CALLS.append(city)
    return f"sunny, 21 C in {city}"


@tool
def get_time(city: str) -> str:
    """Get the local time of a city."""
    return f"noon in {city}"


class Place(BaseModel):
    city: str
    country: str


@pytest.fixture(scope="module")
def generator(engine):
    return RadixChatGenerator(engine, generation_kwargs={"max_tokens": 32})


def test_run_reports_usage_with_cached_tokens(generator):
    question = [ChatMessage.from_system("Answer briefly."), ChatMessage.from_user("What is the capital of France?")]
    first = generator.run(question)["replies"][0]
    second = generator.run(question)["replies"][0]
    assert first.text and first.text == second.text  # greedy: one answer
    usage = second.meta["usage"]
    assert usage["prompt_tokens"] > 0 and usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert second.meta["finish_reason"] in ("stop", "length") and second.meta["model"]
    assert generator.run("What is the capital of France?")["replies"][0].text  # a bare string is one user turn


def test_pipeline_runs_and_round_trips_through_yaml(generator):
    template = [ChatMessage.from_system("Answer briefly using the context."),
                ChatMessage.from_user("Context: {{ ctx }}\nQuestion: {{ q }}")]
    pipe = Pipeline()
    pipe.add_component("prompt", ChatPromptBuilder(template=template, required_variables=["ctx", "q"]))
    pipe.add_component("llm", generator)
    pipe.connect("prompt.prompt", "llm.messages")
    inputs = {"prompt": {"ctx": "The Radix Lighthouse was built in 1874 by Mara Quill.", "q": "Who built it?"}}
    reply = pipe.run(inputs)["llm"]["replies"][0]
    assert "Quill" in reply.text
    loaded = Pipeline.loads(pipe.dumps(), allowed_modules=["radix_backend.adapters.haystack"])
    assert loaded.get_component("llm").generation_kwargs == {"max_tokens": 32}
    again = loaded.run(inputs)["llm"]["replies"][0]
    assert again.text == reply.text and again.meta["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_tool_calls_and_tool_choice(generator):
    ask = [ChatMessage.from_user("What's the weather in Paris?")]
    (call,) = generator.run(ask, tools=[get_weather, get_time])["replies"][0].tool_calls
    assert call.tool_name in ("get_weather", "get_time") and set(call.arguments) == {"city"}
    named = generator.run(ask, tools=[get_weather, get_time],
                          generation_kwargs={"tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert named["replies"][0].tool_calls[0].tool_name == "get_time"
    assert named["replies"][0].meta["finish_reason"] == "tool_calls"
    free = generator.run(ask, tools=[get_weather], generation_kwargs={"tool_choice": "none"})["replies"][0]
    assert not free.tool_calls and free.text


def test_response_format_decodes_under_the_schema(generator):
    reply = generator.run([ChatMessage.from_user("Paris is the capital of France. Give the city and country.")],
                          generation_kwargs={"response_format": Place, "max_tokens": 64})["replies"][0]
    assert Place.model_validate_json(reply.text)


def test_streaming_sync_async_and_tool_calls(generator):
    chunks = []
    reply = generator.run("Name a fruit.", streaming_callback=chunks.append)["replies"][0]
    assert len(chunks) > 1 and "".join(c.content for c in chunks) == reply.text
    assert chunks[0].start and chunks[-1].finish_reason in ("stop", "length")
    assert reply.text == generator.run("Name a fruit.")["replies"][0].text

    async def run_async():
        seen = []

        async def callback(chunk):
            seen.append(chunk)
        out = await generator.run_async("Name a fruit.", streaming_callback=callback)
        return seen, out["replies"][0]
    seen, async_reply = asyncio.run(run_async())
    assert async_reply.text == reply.text and "".join(c.content for c in seen) == reply.text
    tool_chunks = []
    generator.run("What's the weather in Rome?", streaming_callback=tool_chunks.append, tools=[get_weather],
                  generation_kwargs={"tool_choice": "required"})
    (delta,) = [d for c in tool_chunks for d in (c.tool_calls or [])]
    assert delta.tool_name == "get_weather" and json.loads(delta.arguments).keys() == {"city"}


def test_unsupported_input_is_refused(generator, engine):
    with pytest.raises(InvalidRequestError, match="reasoning_effort"):
        RadixChatGenerator(engine, generation_kwargs={"reasoning_effort": "high"})
    with pytest.raises(InvalidRequestError, match="reasoning_effort"):
        generator.run("Hi", generation_kwargs={"reasoning_effort": "high"})
    image = ChatMessage.from_user(content_parts=["Describe", ImageContent(base64_image="aGk=", mime_type="image/png")])
    with pytest.raises(InvalidRequestError, match="text messages only"):
        generator.run([image])


def test_agent_calls_the_tool(engine):
    CALLS.clear()
    agent = Agent(chat_generator=RadixChatGenerator(engine, generation_kwargs={"max_tokens": 64}), tools=[get_weather],
                  max_agent_steps=3)
    messages = agent.run([ChatMessage.from_user("What's the weather in Paris?")])["messages"]
    assert CALLS and CALLS[0] == "Paris"  # the constrained call parsed into the tool's arguments
    assert any(m.tool_call_result and "sunny" in m.tool_call_result.result for m in messages)
    if not (messages[-1].text and "sunny" in messages[-1].text.lower()):
        pytest.xfail("SmolLM2-135M calls the tool again instead of answering from its result")
