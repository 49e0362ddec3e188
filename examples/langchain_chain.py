"""LangChain on radix-backend: a few-shot chain batched in one engine call, streaming, structured
output and tool calls, all sharing one radix cache.

    python examples/langchain_chain.py
"""

from __future__ import annotations

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from pydantic import BaseModel

from radix_backend import get_engine
from radix_backend.adapters.langchain import RadixChatModel

FEW_SHOT = ("Classify the sentiment of each review as positive or negative.\n"
            "Review: I loved it. Sentiment: positive\n"
            "Review: Dull and far too long. Sentiment: negative\n")


class Movie(BaseModel):
    title: str
    year: int


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny in {city}."


def main() -> None:
    engine = get_engine()  # the process-shared engine: every adapter below uses its cache
    chat = RadixChatModel(engine=engine, temperature=0, max_tokens=4)
    chain = ChatPromptTemplate.from_messages([("system", FEW_SHOT), ("user", "Review: {review} Sentiment:")]) \
        | chat | StrOutputParser()
    reviews = ["A masterpiece.", "I fell asleep.", "Great cast, great story.", "Terrible acting."]
    print("batch:", chain.batch([{"review": r} for r in reviews]))  # one engine.generate call: the prefix is computed once

    print("stream:", end=" ")
    for chunk in RadixChatModel(engine=engine, temperature=0, max_tokens=20).stream("Name two planets."):
        print(chunk.content, end="", flush=True)
    print()

    movie = RadixChatModel(engine=engine, temperature=0, max_tokens=40).with_structured_output(Movie) \
        .invoke("Give one famous science-fiction movie and its year.")
    print("structured:", movie)

    call = RadixChatModel(engine=engine, temperature=0, max_tokens=40).bind_tools([get_weather], tool_choice="any") \
        .invoke("What's the weather in Oslo?")
    print("tool calls:", call.tool_calls)

    stats = engine.cache_stats()
    print(f"cache: {stats.cached_tokens}/{stats.prompt_tokens} prompt tokens served from the radix cache "
          f"({stats.hit_rate:.0%})")


if __name__ == "__main__":
    main()
