"""A LangGraph agent on radix-backend: a tool-calling step, the tool, then an answer, with the
conversation checkpointed per thread. Every turn re-sends the thread's history, which the radix
cache already holds; the tool call is decoded under the tool's JSON schema, so it always parses.

    python examples/langgraph_agent.py
"""

from __future__ import annotations

from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import MemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from radix_backend import get_engine
from radix_backend.adapters.langchain import RadixChatModel


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def build_graph(engine=None):
    """agent (must call `multiply`) -> tools -> respond (plain text), checkpointed per thread."""
    chat = RadixChatModel(engine=engine or get_engine(), temperature=0, max_tokens=64)
    caller = chat.bind_tools([multiply], tool_choice="multiply")
    graph = StateGraph(MessagesState)
    graph.add_node("agent", lambda state: {"messages": [caller.invoke(state["messages"])]})
    graph.add_node("tools", ToolNode([multiply]))
    graph.add_node("respond", lambda state: {"messages": [chat.invoke(state["messages"])]})
    graph.add_edge(START, "agent")
    graph.add_edge("agent", "tools")
    graph.add_edge("tools", "respond")
    graph.add_edge("respond", END)
    return graph.compile(checkpointer=MemorySaver())


def main() -> None:
    engine = get_engine()
    app = build_graph(engine)
    thread = {"configurable": {"thread_id": "demo"}}
    for question in ("What is 6 times 7?", "And what is 12 times 3?"):
        out = app.invoke({"messages": [HumanMessage(question)]}, thread)
        call, result, answer = out["messages"][-3:]
        print(f"{question} -> multiply({call.tool_calls[0]['args']}) = {result.content}; {answer.content.strip()}")
    stats = engine.cache_stats()
    print(f"radix cache: {stats.cached_tokens}/{stats.prompt_tokens} prompt tokens reused ({stats.hit_rate:.0%})")


if __name__ == "__main__":
    main()
