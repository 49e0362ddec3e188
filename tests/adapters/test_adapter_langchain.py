"""LangChain adapter: fast tests on a scripted engine double, slow end-to-end tests on SmolLM2."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from typing import Any

import pytest

pytest.importorskip("langchain_core")

from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_core.output_parsers import StrOutputParser  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from typing_extensions import TypedDict  # noqa: E402

from fakes import ScriptedEngine  # noqa: E402
from radix_backend.adapters.langchain import RadixChatModel, RadixLLM  # noqa: E402
from radix_backend.errors import InvalidRequestError, MissingDependencyError  # noqa: E402


class Person(BaseModel):
    name: str
    age: int


class PersonDict(TypedDict):
    name: str
    age: int


def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    return "sunny"


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class TokenRecorder(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.ends = 0
        self.starts = 0

    def on_chat_model_start(self, *args: Any, **kwargs: Any) -> None:
        self.starts += 1

    def on_llm_start(self, *args: Any, **kwargs: Any) -> None:
        self.starts += 1

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)

    def on_llm_end(self, *args: Any, **kwargs: Any) -> None:
        self.ends += 1


# ---------------------------------------------------------------- fast: scripted engine
def test_invoke_maps_usage_and_sampling_kwargs() -> None:
    eng = ScriptedEngine(replies=["Paris is the capital."])
    chat = RadixChatModel(engine=eng, temperature=0.0, max_tokens=20)
    msg = chat.invoke([SystemMessage("Be brief."), HumanMessage("Capital of France?")], top_p=0.9, max_tokens=7)
    assert msg.content == "Paris is the capital."
    assert msg.usage_metadata["input_tokens"] > 0 and msg.usage_metadata["output_tokens"] == 4
    assert msg.usage_metadata["total_tokens"] == msg.usage_metadata["input_tokens"] + 4
    assert msg.usage_metadata["input_token_details"]["cache_read"] == 0
    assert msg.response_metadata["finish_reason"] == "stop"
    params = eng.calls[-1].params[0]
    assert (params.temperature, params.top_p, params.max_new_tokens) == (0.0, 0.9, 7)
    assert eng.calls[-1].prompts[0].startswith("<|system|>\nBe brief.")
    # the same prefix again is served from the (double's) cache and reported as cache_read
    again = chat.invoke([SystemMessage("Be brief."), HumanMessage("Capital of Spain?")])
    assert again.usage_metadata["input_token_details"]["cache_read"] > 0


def test_stop_sequences_reach_the_engine_and_cut_output() -> None:
    eng = ScriptedEngine(replies=["one two STOP three"])
    chat = RadixChatModel(engine=eng, stop=["END"])
    msg = chat.invoke("count", stop=["STOP"])
    assert msg.content == "one two "
    assert set(eng.calls[-1].params[0].stop) == {"END", "STOP"}


def test_unknown_sampling_kwarg_is_a_typed_error() -> None:
    chat = RadixChatModel(engine=ScriptedEngine())
    with pytest.raises(InvalidRequestError, match="tempurature"):
        chat.invoke("hi", tempurature=0.1)
    with pytest.raises(InvalidRequestError, match="top_p"):
        chat.invoke("hi", top_p=2.0)


def test_stream_yields_token_chunks_and_callbacks_see_each() -> None:
    eng = ScriptedEngine(replies=["a b c d"])
    chat = RadixChatModel(engine=eng)
    rec = TokenRecorder()
    chunks = list(chat.stream("hi", config={"callbacks": [rec]}))
    assert [c.content for c in chunks] == ["a ", "b ", "c ", "d"]
    assert rec.tokens == ["a ", "b ", "c ", "d"]
    assert chunks[-1].usage_metadata["output_tokens"] == 4
    assert eng.calls[-1].kind == "stream"


def test_streaming_flag_makes_invoke_report_tokens() -> None:
    chat = RadixChatModel(engine=ScriptedEngine(replies=["x y"]), streaming=True)
    rec = TokenRecorder()
    msg = chat.invoke("hi", config={"callbacks": [rec]})
    assert msg.content == "x y" and rec.tokens == ["x ", "y"]


def test_async_invoke_and_stream() -> None:
    eng = ScriptedEngine(replies=["p q"])
    chat = RadixChatModel(engine=eng)

    async def run() -> tuple[AIMessage, list[str]]:
        msg = await chat.ainvoke("hi")
        chunks = [c.content async for c in chat.astream("hi")]
        return msg, chunks

    msg, chunks = asyncio.run(run())
    assert msg.content == "p q" and chunks == ["p ", "q"]
    assert [c.kind for c in eng.calls] == ["agenerate", "astream"]


def test_batch_of_32_is_one_engine_call_with_callbacks() -> None:
    eng = ScriptedEngine(replies=lambda prompt, params: prompt.split()[-3])
    chat = RadixChatModel(engine=eng, temperature=0)
    prompt = ChatPromptTemplate.from_messages([("system", "Few-shot: 1->one 2->two 3->three."), ("user", "{x} ?")])
    chain = prompt | chat | StrOutputParser()
    rec = TokenRecorder()
    outs = chain.batch([{"x": f"n{i}"} for i in range(32)], config={"callbacks": [rec]})
    assert outs == [f"n{i}" for i in range(32)]
    assert len(eng.calls) == 1 and eng.calls[0].kind == "generate" and len(eng.calls[0].prompts) == 32
    assert rec.starts == 32 and rec.ends == 32


def test_abatch_is_one_engine_call() -> None:
    eng = ScriptedEngine(replies=lambda prompt, params: "ok")
    chat = RadixChatModel(engine=eng)
    outs = asyncio.run(chat.abatch([f"q{i}" for i in range(8)]))
    assert [o.content for o in outs] == ["ok"] * 8
    assert [(c.kind, len(c.prompts)) for c in eng.calls] == [("agenerate", 8)]


def test_batch_with_streaming_falls_back_to_per_call_path() -> None:
    eng = ScriptedEngine(replies=lambda prompt, params: "s t")
    chat = RadixChatModel(engine=eng, streaming=True)
    outs = chat.batch(["a", "b"])
    assert [o.content for o in outs] == ["s t", "s t"]
    assert sorted(c.kind for c in eng.calls) == ["stream", "stream"]


def test_batch_error_is_returned_per_input_when_asked() -> None:
    chat = RadixChatModel(engine=ScriptedEngine())
    outs = chat.batch(["a", "b"], return_exceptions=True, max_tokens=-1)
    assert all(isinstance(o, InvalidRequestError) for o in outs)


def test_one_bad_input_fails_alone_with_return_exceptions() -> None:
    class Refusing(ScriptedEngine):
        def generate(self, prompt=None, params=None, *, input_ids=None, messages=None):
            many = messages and isinstance(messages[0], list)
            if any("BAD" in m["content"] for ms in (messages if many else [messages]) for m in ms):
                raise InvalidRequestError("BAD input refused")
            return super().generate(prompt, params, input_ids=input_ids, messages=messages)

        async def agenerate(self, prompt=None, params=None, *, input_ids=None, messages=None):
            return self.generate(prompt, params, input_ids=input_ids, messages=messages)

    eng = Refusing(replies=["fine"])
    outs = RadixChatModel(engine=eng).batch(["a", "BAD", "c"], return_exceptions=True)
    assert [o.content for o in (outs[0], outs[2])] == ["fine", "fine"]
    assert isinstance(outs[1], InvalidRequestError)
    outs = asyncio.run(RadixChatModel(engine=eng).abatch(["a", "BAD"], return_exceptions=True))
    assert outs[0].content == "fine" and isinstance(outs[1], InvalidRequestError)
    with pytest.raises(InvalidRequestError, match="BAD input"):
        RadixChatModel(engine=eng).batch(["a", "BAD"])


def test_token_counts_use_the_served_models_tokenizer() -> None:
    eng = ScriptedEngine()
    chat = RadixChatModel(engine=eng)
    assert chat.get_token_ids("three little words") == eng.encode("three little words")
    assert chat.get_num_tokens("three little words") == 3


def test_tracing_params_name_provider_and_model() -> None:
    chat = RadixChatModel(engine=ScriptedEngine(), temperature=0.2, max_tokens=7, stop=["x"])
    ls = chat._get_ls_params()
    assert ls["ls_provider"] == "radix-backend" and ls["ls_model_type"] == "chat"
    assert ls["ls_model_name"] and ls["ls_temperature"] == 0.2 and ls["ls_max_tokens"] == 7 and ls["ls_stop"] == ["x"]
    assert chat._get_ls_params(model="other")["ls_model_name"] == "other"


def test_per_call_model_must_name_the_loaded_model() -> None:
    chat = RadixChatModel(engine=ScriptedEngine(), model="my-model")
    assert chat.invoke("hi", model="my-model").content == "ok"
    with pytest.raises(InvalidRequestError, match="not loaded here"):
        chat.invoke("hi", model="gpt-4o")


def test_cut_off_tool_call_is_reported_with_the_reason() -> None:
    eng = ScriptedEngine(replies=['{"name": "add", "arguments": {"a": 1, ' + "x " * 300])
    with pytest.warns(UserWarning, match="cut off"):
        msg = RadixChatModel(engine=eng, max_tokens=100).bind_tools([add]).invoke("x")
    assert msg.tool_calls == [] and "cut off" in msg.invalid_tool_calls[0]["error"]
    assert eng.calls[-1].params[0].max_new_tokens == 256  # a tool call gets room for its arguments


class PersonV1(__import__("pydantic").v1.BaseModel):
    """A person."""

    name: str = __import__("pydantic").v1.Field(description="the full name")
    age: int


class AnnotatedPerson(TypedDict):
    """A person."""

    name: __import__("typing").Annotated[str, ..., "the full name"]
    age: int


@pytest.mark.parametrize("schema", [Person, PersonV1, AnnotatedPerson, Person.model_json_schema()])
def test_every_schema_kind_is_closed_described_and_traced(schema: Any) -> None:
    from langchain_core.utils.function_calling import convert_to_json_schema

    recorder = []

    class Options(BaseCallbackHandler):
        def on_chat_model_start(self, *args: Any, **kwargs: Any) -> None:
            recorder.append(kwargs.get("options", {}))

    eng = ScriptedEngine(replies=lambda prompt, params: json.dumps({"name": "Ada", "age": 36}))
    out = RadixChatModel(engine=eng).with_structured_output(schema).invoke("x", config={"callbacks": [Options()]})
    sent = eng.calls[-1].params[0].json_schema
    assert sent["additionalProperties"] is False  # every kind as closed as a class schema
    if schema in (PersonV1, AnnotatedPerson):
        assert "the full name" in eng.calls[-1].prompts[0]  # descriptions reach the model
    assert (out.name, out.age) == ("Ada", 36) if isinstance(schema, type) and schema is not AnnotatedPerson \
        else out == {"name": "Ada", "age": 36}
    assert recorder[-1]["ls_structured_output_format"]["schema"] == convert_to_json_schema(schema)


@pytest.mark.parametrize("schema", [Person, PersonDict, Person.model_json_schema()])
def test_structured_output_decodes_under_the_schema(schema: Any) -> None:
    eng = ScriptedEngine(replies=lambda prompt, params: json.dumps({"name": "Ada", "age": 36}))
    out = RadixChatModel(engine=eng).with_structured_output(schema).invoke("Make a person.")
    sent = eng.calls[-1].params[0].json_schema
    assert sent["properties"]["age"]["type"] == "integer" and set(sent["required"]) == {"name", "age"}
    if schema is Person:
        assert out == Person(name="Ada", age=36)
    else:
        assert out == {"name": "Ada", "age": 36}


def test_structured_output_include_raw_reports_parse_errors() -> None:
    eng = ScriptedEngine(replies=["not json"])
    out = RadixChatModel(engine=eng).with_structured_output(Person, include_raw=True).invoke("x")
    assert out["parsed"] is None and out["parsing_error"] is not None and out["raw"].content == "not json"


def test_structured_output_via_function_calling() -> None:
    eng = ScriptedEngine(replies=lambda p, sp: json.dumps({"name": "Person", "arguments": {"name": "Bo", "age": 2}}))
    out = RadixChatModel(engine=eng).with_structured_output(Person, method="function_calling").invoke("x")
    assert out == Person(name="Bo", age=2)
    schema = eng.calls[-1].params[0].json_schema
    assert schema["properties"]["name"] == {"const": "Person"}  # forced tool, no plain-text option


def test_bind_tools_parses_tool_calls_and_replays_history() -> None:
    replies = iter([json.dumps({"name": "add", "arguments": {"a": 2, "b": 3}}), json.dumps({"response": "It is 5."})])
    eng = ScriptedEngine(replies=lambda p, sp: next(replies))
    model = RadixChatModel(engine=eng).bind_tools([get_weather, add])
    first = model.invoke("What is 2+3?")
    assert first.content == "" and len(first.tool_calls) == 1
    call = first.tool_calls[0]
    assert call["name"] == "add" and call["args"] == {"a": 2, "b": 3} and call["id"].startswith("call_")
    schema = eng.calls[-1].params[0].json_schema
    names = [o["properties"].get("name", {}).get("const") for o in schema["anyOf"]]
    assert names == ["get_weather", "add", None]  # last option: a plain answer
    assert "get_weather" in eng.calls[-1].prompts[0] and "Add two integers." in eng.calls[-1].prompts[0]
    second = model.invoke([HumanMessage("What is 2+3?"), first, ToolMessage("5", tool_call_id=call["id"])])
    assert second.content == "It is 5." and second.tool_calls == []
    replayed = eng.calls[-1].prompts[0]
    assert '"name": "add"' in replayed and "<|tool|>\n5" in replayed


def test_tool_choice_named_and_invalid_reply() -> None:
    eng = ScriptedEngine(replies=['{"name": "get_weather", "arguments": {"ci'])
    msg = RadixChatModel(engine=eng).bind_tools([get_weather, add], tool_choice="get_weather").invoke("x")
    schema = eng.calls[-1].params[0].json_schema
    assert "anyOf" not in schema and schema["properties"]["name"] == {"const": "get_weather"}
    assert msg.tool_calls == [] and len(msg.invalid_tool_calls) == 1
    with pytest.raises(InvalidRequestError, match="names no offered tool"):
        RadixChatModel(engine=eng).bind_tools([add], tool_choice="nope").invoke("x")


def test_text_llm_batch_is_one_call_and_streams_with_callbacks() -> None:
    eng = ScriptedEngine(replies=lambda prompt, params: prompt.upper())
    llm = RadixLLM(engine=eng, max_tokens=5)
    assert llm.batch(["ab", "cd", "ef"]) == ["AB", "CD", "EF"]
    assert [(c.kind, len(c.prompts)) for c in eng.calls] == [("generate", 3)]
    rec = TokenRecorder()
    assert "".join(llm.stream("x y z", config={"callbacks": [rec]})) == "X Y Z"
    assert rec.tokens == ["X ", "Y ", "Z"]
    result = llm.generate(["a b"])
    assert result.llm_output["token_usage"]["prompt_tokens"] == 2
    assert asyncio.run(llm.ainvoke("q")) == "Q"


def test_text_llm_streaming_flag_and_tool_stream() -> None:
    eng = ScriptedEngine(replies=lambda prompt, params: "u v")
    rec = TokenRecorder()
    assert RadixLLM(engine=eng, streaming=True).invoke("q", config={"callbacks": [rec]}) == "u v"
    assert rec.tokens == ["u ", "v"] and eng.calls[-1].kind == "stream"
    eng.replies = lambda prompt, params: json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}})
    chunks = list(RadixChatModel(engine=eng).bind_tools([add], tool_choice="add").stream("1+2?"))
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert merged.tool_calls[0]["name"] == "add" and merged.tool_calls[0]["args"] == {"a": 1, "b": 2}


def test_missing_langchain_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "langchain_core", None)
    monkeypatch.delitem(sys.modules, "radix_backend.adapters.langchain")
    with pytest.raises(MissingDependencyError, match=r"pip install 'radix-backend\[langchain\]'"):
        importlib.import_module("radix_backend.adapters.langchain")


# ---------------------------------------------------------------- slow: real engine
FEW_SHOT = ("You classify the sentiment of movie reviews as positive or negative.\n"
            "Review: I loved every minute of it. Sentiment: positive\n"
            "Review: A boring, overlong mess. Sentiment: negative\n"
            "Review: The acting was superb and the story moving. Sentiment: positive\n"
            "Review: I walked out halfway through. Sentiment: negative\n")


@pytest.mark.slow
def test_real_batch_shares_the_few_shot_prefix(engine: Any) -> None:
    chat = RadixChatModel(engine=engine, temperature=0, max_tokens=3)
    prompt = ChatPromptTemplate.from_messages([("system", FEW_SHOT), ("user", "Review: {review} Sentiment:")])
    reviews = [f"Movie number {i} was {'great' if i % 2 else 'awful'}." for i in range(32)]
    engine.flush_cache()
    before = engine.cache_stats()
    outs = (prompt | chat).batch([{"review": r} for r in reviews])  # one engine call, cold cache
    after = engine.cache_stats()
    assert len(outs) == 32 and all(isinstance(o.content, str) for o in outs)
    prefix_tokens = len(engine.encode(FEW_SHOT))
    # the few-shot prefix is computed once: every other request of the batch is served it from the cache
    assert after.cached_tokens - before.cached_tokens >= 31 * prefix_tokens
    assert sum(o.usage_metadata["input_token_details"]["cache_read"] >= prefix_tokens for o in outs) >= 31
    # and a later call with the same prefix hits it too
    later = (prompt | chat).invoke({"review": "An average film."})
    assert later.usage_metadata["input_token_details"]["cache_read"] >= prefix_tokens
    assert all(o.usage_metadata["output_tokens"] <= 3 for o in outs)


@pytest.mark.slow
def test_real_stream_matches_invoke_greedy(engine: Any) -> None:
    chat = RadixChatModel(engine=engine, temperature=0, max_tokens=12)
    full = chat.invoke("Name three colors.")
    rec = TokenRecorder()
    chunks = list(chat.stream("Name three colors.", config={"callbacks": [rec]}))
    assert "".join(c.content for c in chunks) == full.content
    assert len([t for t in rec.tokens if t]) >= 2
    assert asyncio.run(chat.ainvoke("Name three colors.")).content == full.content


@pytest.mark.slow
def test_real_stop_sequence(engine: Any) -> None:
    llm = RadixLLM(engine=engine, temperature=0, max_tokens=30)
    out = llm.invoke("1, 2, 3, 4, 5, 6,", stop=[" 9"])
    assert " 9" not in out


@pytest.mark.slow
def test_real_structured_output_and_tools_always_parse(engine: Any) -> None:
    chat = RadixChatModel(engine=engine, temperature=0, max_tokens=64)
    person = chat.with_structured_output(Person).invoke("Invent a person with a name and an age.")
    assert isinstance(person, Person)
    as_dict = chat.with_structured_output(PersonDict).invoke("Invent a person with a name and an age.")
    assert set(as_dict) == {"name", "age"} and isinstance(as_dict["age"], int)
    msg = chat.bind_tools([get_weather, add], tool_choice="any").invoke("What is the weather in Paris?")
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] in {"get_weather", "add"}
    args = msg.tool_calls[0]["args"]
    assert set(args) == ({"city"} if msg.tool_calls[0]["name"] == "get_weather" else {"a", "b"})
