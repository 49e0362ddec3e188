"""`bench gguf-agreement`'s own parts: random prompts for random-weight models, and the reference's
top-2 gap where two continuations part (llama-server itself is not built in CI; BENCHMARKS.md has
real runs)."""

from __future__ import annotations

import pytest

from radix_backend import SamplingParams
from radix_backend.bench import gguf_agreement


def test_random_prompts_are_fixed_by_the_seed_and_within_the_vocabulary() -> None:
    prompts = gguf_agreement.random_prompts(1024, 20)
    assert prompts == gguf_agreement.random_prompts(1024, 20)
    assert prompts != gguf_agreement.random_prompts(1024, 20, seed=1)
    assert len(prompts) == 20 and all(12 <= len(p) <= 37 and all(4 <= t < 1024 for t in p) for p in prompts)


def test_the_gap_is_read_where_two_continuations_part(engine) -> None:
    prompts = gguf_agreement.random_prompts(engine.runner.config.vocab_size, 3)
    mine = gguf_agreement.greedy(engine, prompts, 6)
    theirs = [list(x) for x in mine]
    theirs[1][3] = (theirs[1][3] + 1) % engine.runner.config.vocab_size  # parts after 3 shared tokens
    assert gguf_agreement.near_tie_gaps(engine, prompts, mine, mine) == []
    gaps = gguf_agreement.near_tie_gaps(engine, prompts, mine, theirs)
    top = engine.generate(input_ids=prompts[1] + mine[1][:3], params=SamplingParams(
        max_new_tokens=1, temperature=0, logprobs=True, top_logprobs=2)).logprobs[0].top
    assert top[0][0] == mine[1][3]  # greedy took the best token there
    assert gaps == [pytest.approx(top[0][1] - top[1][1])] and gaps[0] >= 0
