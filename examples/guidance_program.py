"""Guidance programs on radix-backend: select, regex-constrained gen, JSON and chat roles. Two
programs sharing a long prefix: the second computes only its own new tokens.

    python examples/guidance_program.py
"""

from __future__ import annotations

from guidance import assistant, gen, select, system, user
from guidance import json as gen_json
from pydantic import BaseModel, ConfigDict

from radix_backend import get_engine
from radix_backend.adapters.guidance import RadixGuidance

GUIDE = "A field guide to coastal birds. Each entry gives the bird's name, colors and nesting place.\n" * 6


class Bird(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no extra keys: the JSON closes after these two fields

    name: str
    colorful: bool


def main() -> None:
    engine = get_engine()
    lm = RadixGuidance(engine=engine)

    out = lm + "Is the sky green? Answer: " + select(["yes", "no"], name="answer") + \
        "\nA year between 1900 and 1999: " + gen("year", regex=r"19[0-9]{2}")
    print("select:", out["answer"], "| regex:", out["year"])

    bird = lm + "Describe a puffin as JSON: " + gen_json("bird", schema=Bird, max_tokens=40)
    print("json:", bird["bird"])

    with system():
        chat = lm + "You answer in one short sentence."
    with user():
        chat += "What do puffins eat?"
    with assistant():
        chat += gen("reply", max_tokens=20, stop="\n")
    print("chat:", chat["reply"])

    for question in ["Which bird is black and white?", "Where do gulls nest?"]:
        before = engine.cache_stats()
        done = lm + GUIDE + f"Q: {question}\nA: " + gen("a", max_tokens=12, stop="\n")
        after = engine.cache_stats()
        computed = (after.prompt_tokens - before.prompt_tokens) - (after.cached_tokens - before.cached_tokens)
        print(f"{question} -> {done['a']!r}: computed {computed} tokens, "
              f"{after.cached_tokens - before.cached_tokens} served from cache")


if __name__ == "__main__":
    main()
