"""The DSPy adapter: DSPy 3.4's custom-engine contract (complete, stream, their async twins) on the
shared SmolLM2 engine, driven through DSPy's own modules (Predict, ChainOfThought, JSONAdapter,
streamify, asyncify) and optimizer (BootstrapFewShot)."""

from __future__ import annotations

import asyncio

import pytest

dspy = pytest.importorskip("dspy")

from dspy.lm15 import Config, FunctionTool, Message, Request  # noqa: E402

from radix_backend.adapters.dspy import RadixDSPyEngine, RadixLM, chat_messages, sampling_params  # noqa: E402
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
    with pytest.raises(InvalidRequestError, match="tools"):
        sampling_params(_request(tools=(FunctionTool(name="lookup"),)))
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
