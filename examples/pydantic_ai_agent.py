"""A pydantic-ai agent on radix-backend: structured output and a tool, in process.

Every agent step resends the instructions, the tool definitions and the whole history; the shared
engine's radix cache computes them once. Tool calls and the structured output decode under their
JSON schemas, so they always parse (even from the 135M default model).

    python examples/pydantic_ai_agent.py
"""

from __future__ import annotations

from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.exceptions import UsageLimitExceeded
from pydantic_ai.usage import UsageLimits

from radix_backend import get_engine
from radix_backend.adapters.pydantic_ai import RadixModel


class City(BaseModel):
    name: str
    country: str


def main() -> None:
    engine = get_engine()
    model = RadixModel(engine)
    extractor = Agent(model, output_type=City, instructions="Extract the city the text is about.")
    for text in ("Paris is the capital of France.", "Tokyo is the largest city of Japan."):
        result = extractor.run_sync(text)
        print(f"{text} -> {result.output!r} (cached prompt tokens: {result.usage.cache_read_tokens})")

    agent = Agent(model, instructions="Use the tool to get the weather, then answer in one sentence.")

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        return f"sunny, 21 C in {city}"

    try:
        answer = agent.run_sync("What's the weather in Paris?", model_settings={"max_tokens": 64},
                                usage_limits=UsageLimits(request_limit=3)).output
    except UsageLimitExceeded:  # a small model may keep calling the tool instead of answering
        answer = "(no answer within 3 requests)"
    print(f"weather agent -> {answer}")
    stats = engine.cache_stats()
    print(f"radix cache: {stats.cached_tokens}/{stats.prompt_tokens} prompt tokens reused ({stats.hit_rate:.0%})")


if __name__ == "__main__":
    main()
