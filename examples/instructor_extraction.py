"""instructor on radix-backend, in process: pydantic objects from text through the OpenAI SDK.

`openai_client()` is an `openai.OpenAI` whose requests go straight to the engine (no server, no
socket); instructor patches it as it would any OpenAI client. Its tool call decodes under the
response model's schema, so every reply validates (even from the 135M default model), and the
shared instructions come from the radix cache after the first call.

    python examples/instructor_extraction.py
"""

from __future__ import annotations

import instructor
from pydantic import BaseModel

from radix_backend import get_engine
from radix_backend.server.openai_client import openai_client


class Place(BaseModel):
    city: str
    country: str


TEXTS = ["Paris is the capital of France.", "Rome is the capital of Italy.", "Tokyo is the capital of Japan."]


def main() -> None:
    engine = get_engine()
    client = instructor.from_openai(openai_client(engine))
    model = client.client.models.list().data[0].id
    for text in TEXTS:
        place = client.chat.completions.create(model=model, response_model=Place, max_tokens=256, messages=[
            {"role": "system", "content": "Extract the place the text is about."}, {"role": "user", "content": text}])
        print(f"{text} -> {place!r}")
    stats = engine.cache_stats()
    print(f"radix cache: {stats.cached_tokens}/{stats.prompt_tokens} prompt tokens reused ({stats.hit_rate:.0%})")


if __name__ == "__main__":
    main()
