"""The embedded GGUF's greedy rows take the screened LM head (kernels/head_screen.py); the tokens,
and everything a request reads from the logits, are the full head's."""

from __future__ import annotations

import dataclasses

from radix_backend import Engine, SamplingParams

PROMPTS = [
    "List the planets of the solar system, one per line.",
    "Repeat exactly: alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta",
    "Write a haiku about autumn leaves.",
    "Explain what a radix tree is in two sentences.",
    "Count from one to twenty in words.",
]
PARAMS = [
    SamplingParams(max_new_tokens=40, temperature=0),
    SamplingParams(max_new_tokens=40, temperature=0),  # a copy-heavy greedy row: speculative drafts
    SamplingParams(max_new_tokens=24, temperature=0, logprobs=True, top_logprobs=3),  # reads the logits
    SamplingParams(max_new_tokens=24, temperature=0.8, seed=7),  # sampled
    SamplingParams(max_new_tokens=24, temperature=0, min_new_tokens=20, ignore_eos=False),  # masks stop tokens
]


def test_screened_greedy_rows_give_the_full_heads_outputs():
    with Engine(quantization="auto", kv_cache_tokens=4096) as eng:
        runner = eng.runner
        head = runner.model.lm_head_quant
        assert head.screens  # the embedded file's Q8_0 head on the native kernels
        screened_rows: list[int] = []
        screen = head.screen
        head.screen = lambda x, threads: (screened_rows.append(x.shape[0]), screen(x, threads))[1]
        outs = {}
        for on in (True, False):
            runner.kernel_settings = dataclasses.replace(runner.kernel_settings, screened_head=on)
            eng.flush_cache()
            outs[on] = eng.generate(PROMPTS, PARAMS)
        assert screened_rows, "no step screened its greedy rows"
        for on, off in zip(outs[True], outs[False]):
            assert on.token_ids == off.token_ids
            assert on.text == off.text
            assert on.logprobs == off.logprobs
        assert eng.cache_stats().spec_accepted_tokens > 0  # draft rows were screened too
