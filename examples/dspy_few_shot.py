"""A DSPy program on radix-backend: ChainOfThought compiled with BootstrapFewShot, in process.

DSPy's optimizer sends the same instructions and demos with every question; the shared engine's
radix cache computes them once. `JSONAdapter` asks for the signature's JSON schema, which the
engine decodes under, so every reply parses (even from the 135M default model).

    python examples/dspy_few_shot.py
"""

from __future__ import annotations

import dspy

from radix_backend import get_engine
from radix_backend.adapters.dspy import RadixLM

TRAIN = [("What is 2 + 2?", "4"), ("What is 3 + 5?", "8"), ("What is 10 - 4?", "6"), ("What is 7 + 1?", "8")]


def main() -> None:
    engine = get_engine()
    dspy.configure(lm=RadixLM(engine, cache=False, max_tokens=96), adapter=dspy.JSONAdapter())
    trainset = [dspy.Example(question=q, answer=a).with_inputs("question") for q, a in TRAIN]
    optimizer = dspy.BootstrapFewShot(metric=lambda ex, pred, trace=None: ex.answer == str(pred.answer).strip(),
                                      max_bootstrapped_demos=2, max_labeled_demos=2, max_rounds=1)
    program = optimizer.compile(dspy.ChainOfThought("question -> answer"), trainset=trainset)
    for question in ("What is 6 + 3?", "What is 9 - 2?"):
        pred = program(question=question)
        print(f"{question} -> {pred.answer!r} (reasoning: {pred.reasoning.strip()[:60]!r})")
    stats = engine.cache_stats()
    print(f"radix cache: {stats.cached_tokens}/{stats.prompt_tokens} prompt tokens reused ({stats.hit_rate:.0%})")


if __name__ == "__main__":
    main()
