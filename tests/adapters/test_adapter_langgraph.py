"""LangGraph through the LangChain adapter: examples/langgraph_agent.py's graph (a forced tool call,
the tool, an answer; checkpointed per thread) on the shared SmolLM2 engine."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("langgraph")

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "langgraph_agent.py"


def _example():
    spec = importlib.util.spec_from_file_location("langgraph_agent_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_checkpointed_tool_agent_runs_and_its_history_comes_from_the_cache(engine):
    app = _example().build_graph(engine)
    thread = {"configurable": {"thread_id": "t"}}
    out = app.invoke({"messages": [HumanMessage("What is 6 times 7?")]}, thread)
    call, result, answer = out["messages"][-3:]
    assert isinstance(call, AIMessage) and len(call.tool_calls) == 1
    args = call.tool_calls[0]["args"]
    assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())  # the schema held
    assert isinstance(result, ToolMessage) and result.content == str(args["a"] * args["b"])  # the tool ran
    assert isinstance(answer, AIMessage) and answer.content.strip()
    before = engine.cache_stats()
    second = app.invoke({"messages": [HumanMessage("And what is 12 times 3?")]}, thread)
    after = engine.cache_stats()
    assert len(second["messages"]) == 8  # the thread's history came back from the checkpointer
    assert after.cached_tokens - before.cached_tokens > 0.5 * (after.prompt_tokens - before.prompt_tokens)
    assert args == {"a": 6, "b": 7}  # the model read the numbers (holds for SmolLM2 greedy, fp32 and GGUF)
