"""The DSPy adapter: DSPy 3.4's custom-engine contract (complete, stream, their async twins) on the
shared SmolLM2 engine, driven through DSPy's own modules (Predict, ChainOfThought, JSONAdapter,
streamify, asyncify) and optimizer (BootstrapFewShot)."""

from __future__ import annotations

import asyncio
import json

import pytest

dspy = pytest.importorskip("dspy")

from dspy.lm15 import (Config, FunctionTool, Message, Request, TextPart, ToolCallDelta, ToolCallPart,  # noqa: E402
                       ToolChoice, ToolResultPart)

from radix_backend.adapters.dspy import (RadixDSPyEngine, RadixLM, chat_messages, sampling_params,  # noqa: E402
                                         tool_plan)
from radix_backend.errors import InvalidRequestError  # noqa: E402


def _request(config: Config | None = None, **kwargs) -> Request:
    return Request(model="radix-backend/x", messages=(Message.user("Hi"),), config=config or Config(), **kwargs)


def test_a_request_maps_to_the_engine_or_is_refused_by_name():
    req = _request(Config(max_tokens=9, temperature=0.5, top_p=0.9, top_k=4, stop=("\n",), seed=3,
                          response_format={"type": "json_schema", "name": "Out", "schema": {"type": "object"}}),
                   system="Be brief.")
    assert chat_messages(req) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    params = sampling_params(req)
    assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k) == (9, 0.5, 0.9, 4)
    assert (params.stop, params.seed, params.json_schema) == (["\n"], 3, {"type": "object"})
    assert sampling_params(_request()).temperature == 0.0  # DSPy's unset temperature: greedy
    assert sampling_params(_request(Config(response_format={"type": "json_object"}))).json_schema == {"type": "object"}
    with pytest.raises(InvalidRequestError, match="logprobs"):
        sampling_params(_request(Config(logprobs=2)))


@pytest.fixture(scope="module")
def lm(engine):
    return RadixLM(engine, cache=False, max_tokens=48)


def test_calls_run_on_the_shared_engine_and_report_cached_tokens(engine, lm):
    prompt = "Answer in one short sentence. What is a radix tree?"
    first = lm(prompt)
    second = lm(prompt)
    assert first == second and isinstance(first[0], str) and first[0]  # greedy: one answer
    usage = lm.history[-1]["usage"]
    assert usage["prompt_tokens"] > 0 and usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert RadixDSPyEngine(engine).model_name == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_json_adapter_decodes_under_the_signature_schema(lm):
    with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
        pred = dspy.ChainOfThought("question -> answer: int")(question="What is 2 + 3?")
    assert isinstance(pred.answer, int) and isinstance(pred.reasoning, str)  # always parses: constrained
    assert lm.history[-1]["kwargs"]["response_format"] is not None


def test_async_and_streaming_programs(lm):
    async def run():
        with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):  # constrained: parses whatever the 135M model says
            answer = await dspy.asyncify(dspy.Predict("question -> answer"))(question="Name a color.")
            program = dspy.streamify(dspy.Predict("question -> answer"),
                                     stream_listeners=[dspy.streaming.StreamListener(signature_field_name="answer")])
            events = [event async for event in program(question="What color is the sky?")]
        return answer, events

    answer, events = asyncio.run(run())
    assert isinstance(answer.answer, str)
    assert isinstance(events[-1], dspy.Prediction)
    pieces = [e for e in events if isinstance(e, dspy.streaming.StreamResponse)]
    assert pieces and "".join(p.chunk for p in pieces).strip()  # the answer arrived in pieces


def test_bootstrap_few_shot_compiles_on_the_shared_cache(engine, lm):
    """DSPy's optimizer resends one instruction block and growing demos: the radix cache serves them."""
    trainset = [dspy.Example(question=f"What is {a} + {b}?", answer=str(a + b)).with_inputs("question")
                for a, b in ((1, 1), (2, 2), (3, 1), (2, 5))]
    before = engine.cache_stats()
    with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
        optimizer = dspy.BootstrapFewShot(metric=lambda ex, pred, trace=None: ex.answer in str(pred.answer),
                                          max_bootstrapped_demos=2, max_labeled_demos=2, max_rounds=1)
        compiled = optimizer.compile(dspy.ChainOfThought("question -> answer"), trainset=trainset)
        pred = compiled(question="What is 4 + 4?")
    after = engine.cache_stats()
    assert isinstance(pred.answer, str)
    assert after.prompt_tokens > before.prompt_tokens
    assert after.cached_tokens - before.cached_tokens > 0.5 * (after.prompt_tokens - before.prompt_tokens)


WEATHER = FunctionTool(name="get_weather", description="Weather of a city",
                       parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TIME = FunctionTool(name="get_time", description="Local time of a city",
                    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


def test_tool_choice_and_tool_history_map_to_the_engine():
    specs, allow_text, parallel = tool_plan(_request(tools=(WEATHER, TIME)))
    assert [s.name for s in specs] == ["get_weather", "get_time"] and allow_text and not parallel
    specs, allow_text, _ = tool_plan(_request(Config(tool_choice=ToolChoice(mode="required", allowed=("get_time",))),
                                              tools=(WEATHER, TIME)))
    assert [s.name for s in specs] == ["get_time"] and not allow_text
    assert tool_plan(_request(Config(tool_choice=ToolChoice(mode="none")), tools=(WEATHER,)))[:2] == ([], True)
    turns = (Message.user("Weather in Oslo?"),
             Message.assistant([ToolCallPart(id="c1", name="get_weather", input={"city": "Oslo"})]),
             Message(role="tool", parts=(ToolResultPart(id="c1", content=(TextPart("rain"),)),)))
    history = Request(model="radix-backend/x", messages=turns)
    assert chat_messages(history)[1:] == [
        {"role": "assistant", "content": '{"name": "get_weather", "arguments": {"city": "Oslo"}}'},
        {"role": "tool", "content": "rain"}]


def test_tool_calls_complete_and_stream(engine):
    radix = RadixDSPyEngine(engine)
    request = Request(model="radix-backend/x", messages=(Message.user("What's the weather in Paris?"),),
                      tools=(WEATHER,), config=Config(tool_choice=ToolChoice(mode="required")))
    response = radix.complete(request)
    (call,) = [p for p in response.message.parts if isinstance(p, ToolCallPart)]
    assert call.name == "get_weather" and set(call.input) == {"city"} and response.finish_reason == "tool_call"
    deltas = [e.delta for e in radix.stream(request) if isinstance(getattr(e, "delta", None), ToolCallDelta)]
    assert [d.name for d in deltas] == ["get_weather"] and json.loads(deltas[0].input) == dict(call.input)


def test_dspy_native_function_calling_through_predict(lm):
    def get_weather(city: str) -> str:
        """Weather of a city."""
        return f"sunny in {city}"
    signature = dspy.Signature("question: str, tools: list[dspy.Tool] -> outputs: dspy.ToolCalls")
    with dspy.context(lm=lm, adapter=dspy.ChatAdapter(use_native_function_calling=True)):
        pred = dspy.Predict(signature)(question="What's the weather in Paris?", tools=[dspy.Tool(get_weather)])
    (call,) = pred.outputs.tool_calls
    assert call.name == "get_weather" and set(call.args) == {"city"}
