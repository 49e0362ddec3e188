"""OpenAI tool calling on /v1/chat/completions with the official openai client: tools and
tool_choice become constrained decoding, replies come back as message.tool_calls (and in streamed
deltas) whose arguments validate against the tool's schema; the history replays them."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from radix_backend.server import ServerThread, create_app

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 10}}, "required": ["tz"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def client(tiny_engine):
    with ServerThread(create_app(tiny_engine)) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _check_calls(calls, allowed: set[str]) -> None:
    assert calls, "expected tool calls"
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice, allowed", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_forced_tool_calls_parse_and_validate(client, choice, allowed) -> None:
    out = client.chat.completions.create(model=_model(client), messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                         temperature=0, max_tokens=200)
    assert out.choices[0].finish_reason == "tool_calls"
    _check_calls(out.choices[0].message.tool_calls, allowed)


def test_auto_gives_a_call_or_text_and_none_gives_text(client) -> None:
    auto = client.chat.completions.create(model=_model(client), messages=ASK, tools=[WEATHER], temperature=0,
                                          max_tokens=200)
    message = auto.choices[0].message
    if message.tool_calls:
        _check_calls(message.tool_calls, {"get_weather"})
    else:
        assert isinstance(message.content, str) and auto.choices[0].finish_reason in ("stop", "length")
    plain = client.chat.completions.create(model=_model(client), messages=ASK, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=5)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content is not None


def test_streamed_tool_calls_arrive_as_deltas(client) -> None:
    stream = client.chat.completions.create(model=_model(client), messages=ASK, tools=[WEATHER],
                                            tool_choice="required", temperature=0, max_tokens=200, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        assert entry["name"] == "get_weather"
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS["get_weather"])


def test_a_call_and_its_result_replay_in_the_next_turn(client) -> None:
    first = client.chat.completions.create(model=_model(client), messages=ASK, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=200)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
    second = client.chat.completions.create(model=_model(client), messages=history, tools=[WEATHER], temperature=0,
                                            max_tokens=50)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("kwargs, needle", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "distinct"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_bad_tool_requests_are_400(client, kwargs, needle) -> None:
    with pytest.raises(openai.BadRequestError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        client.chat.completions.create(model=_model(client), messages=ASK, max_tokens=5, **kwargs)


def test_langchain_chat_openai_bind_tools_against_the_server(tiny_engine) -> None:
    """A LangChain app that talks to OpenAI swaps in our URL: ChatOpenAI.bind_tools gets tool calls."""
    langchain_openai = pytest.importorskip("langchain_openai")

    with ServerThread(create_app(tiny_engine)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        llm = langchain_openai.ChatOpenAI(base_url=srv.url + "/v1", api_key="none", model=_model(client),
                                          temperature=0, max_tokens=200, max_retries=0)
        # the OpenAI tool dict bounds the city's length: the random-weight model would not stop otherwise
        message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Paris?")
        assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
        assert set(message.tool_calls[0]["args"]) == {"city", "unit"}
        streamed = None
        for chunk in llm.bind_tools([WEATHER], tool_choice="required").stream("Weather in Rome?"):
            streamed = chunk if streamed is None else streamed + chunk
        assert streamed.tool_calls and streamed.tool_calls[0]["name"] == "get_weather"
        plain = llm.invoke("Say hi")
        assert isinstance(plain.content, str) and plain.usage_metadata["output_tokens"] >= 1
