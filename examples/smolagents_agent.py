"""A smolagents tool-calling agent on radix-backend, in process.

Every agent step resends smolagents' long system prompt (tool descriptions and examples) and the
memory so far; the shared engine's radix cache computes them once. Tool calls decode under the
tools' JSON schemas, so every call parses (even from the 135M default model).

    python examples/smolagents_agent.py
"""

from __future__ import annotations

from smolagents import ToolCallingAgent, tool

from radix_backend import get_engine
from radix_backend.adapters.smolagents import RadixSmolModel


@tool
def get_weather(city: str) -> str:
    """Get the current weather of a city.

    Args:
        city: the city name
    """
    return f"sunny, 21 C in {city}"


def main() -> None:
    engine = get_engine()
    agent = ToolCallingAgent(tools=[get_weather], model=RadixSmolModel(engine, max_tokens=128), max_steps=2,
                             verbosity_level=0)
    for city in ("Paris", "Tokyo"):
        answer = agent.run(f"What's the weather in {city}?")
        calls = [(c.name, c.arguments) for step in agent.memory.steps for c in (getattr(step, "tool_calls", None) or [])]
        print(f"{city}: tool calls {calls} -> {str(answer)[:80]!r}")
    stats = engine.cache_stats()
    print(f"radix cache: {stats.cached_tokens}/{stats.prompt_tokens} prompt tokens reused ({stats.hit_rate:.0%})")


if __name__ == "__main__":
    main()
