"""JSON extraction with a schema: the engine constrains decoding (llguidance), so the output
always parses and validates.

    python examples/dsl_json_extraction.py
"""

import json

from pydantic import BaseModel, ConfigDict

import radix_backend.lang as sgl


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a closed schema: exactly these keys, nothing invented

    name: str
    age: int
    city: str


@sgl.function
def extract(s, text):
    s += sgl.system("Extract the person described by the user as JSON.")
    s += sgl.user(text)
    s += sgl.assistant(sgl.gen("person", max_tokens=64, json_schema=Person.model_json_schema()))


def main() -> None:
    texts = ["Maria is a 34 year old engineer living in Lisbon.",
             "Kenji, 27, moved to Osaka last year.",
             "The oldest member, Ruth (81), still lives in Denver."]
    for text, state in zip(texts, extract.run_batch([{"text": t} for t in texts], temperature=0)):
        person = Person.model_validate(json.loads(state["person"]))
        print(f"{text}\n  -> {person}")


if __name__ == "__main__":
    main()
