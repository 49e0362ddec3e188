"""Sampler, stop handling, streaming and logprobs."""

from __future__ import annotations

import pytest
import torch

from radix_backend import Engine, SamplingParams
from radix_backend.scheduler.sampling import SamplerRow, sample


def _rows(params: SamplingParams, n: int, seed: int = 0) -> list[SamplerRow]:
    return [SamplerRow(params, [], [], torch.Generator().manual_seed(seed + i)) for i in range(n)]


def test_top_k_and_top_p_and_min_p_restrict_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, -1.0]]).repeat(200, 1)
    picks = sample(logits.clone(), _rows(SamplingParams(temperature=1.0, top_k=2), 200))
    assert set(picks) <= {0, 1} and set(picks) == {0, 1}
    picks = sample(logits.clone(), _rows(SamplingParams(temperature=1.0, top_p=0.5), 200))
    assert set(picks) == {0}
    picks = sample(logits.clone(), _rows(SamplingParams(temperature=1.0, min_p=0.3), 200))
    assert set(picks) <= {0, 1}


def test_greedy_is_argmax_and_penalties_change_it():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert sample(logits.clone(), _rows(SamplingParams(temperature=0), 1)) == [1]
    row = SamplerRow(SamplingParams(temperature=0, frequency_penalty=2.0), [1, 1], [], None)
    assert sample(logits.clone(), [row]) == [2]
    row = SamplerRow(SamplingParams(temperature=0, repetition_penalty=10.0), [], [1], None)
    assert sample(logits.clone(), [row]) == [2]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    with Engine(str(tiny_llama_dir), kv_cache_tokens=4096) as eng:
        yield eng


def test_seeded_sampling_is_reproducible(engine):
    p = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    a = engine.generate("Tell me a story", p)
    b = engine.generate("Tell me a story", p)
    c = engine.generate("Tell me a story", p.copy(seed=99))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_string_cuts_text_and_stream_never_leaks_it(engine):
    base = engine.generate("Alpha", SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True))
    assert len(base.text) > 6
    stop = base.text[3:6]
    out = engine.generate("Alpha", SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, stop=stop))
    assert out.finish_reason == "stop" and out.meta.matched_stop == stop
    assert out.text == base.text[:base.text.find(stop)]
    streamed = "".join(c.text for c in engine.stream("Alpha", SamplingParams(max_new_tokens=24, temperature=0,
                                                                             ignore_eos=True, stop=stop)))
    assert streamed == out.text


def test_stop_token_ids_and_length(engine):
    base = engine.generate("Beta", SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
    assert base.finish_reason == "length" and len(base.token_ids) == 10
    tok = base.token_ids[4]
    out = engine.generate("Beta", SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[tok]))
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:base.token_ids.index(tok) + 1]


def test_logprobs_are_log_softmax_of_chosen_tokens(engine):
    out = engine.generate("Gamma", SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True, logprobs=True,
                                                  top_logprobs=3))
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    for lp in out.logprobs:
        assert lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id  # greedy picks the top token
        assert lp.top[0][1] == pytest.approx(lp.logprob)


def test_multibyte_characters_are_never_split_in_stream(engine):
    # random weights emit arbitrary byte tokens; every streamed piece must be valid text
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=7, ignore_eos=True)
    chunks = [c.text for c in engine.stream("日本語のテキスト", params)]
    full = engine.generate("日本語のテキスト", params).text
    assert "".join(chunks) == full
    assert all("\ufffd" not in c for c in chunks[:-1])


def test_max_new_tokens_zero_only_prefills(engine):
    out = engine.generate("Delta epsilon", SamplingParams(max_new_tokens=0))
    assert out.token_ids == [] and out.finish_reason == "length"
    again = engine.generate("Delta epsilon zeta", SamplingParams(max_new_tokens=1, temperature=0))
    assert again.meta.cached_tokens > 0


def test_penalties_through_the_engine(engine):
    plain = engine.generate("Echo echo echo", SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    penalized = engine.generate("Echo echo echo", SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True,
                                                                 repetition_penalty=5.0, frequency_penalty=2.0))
    assert len(set(penalized.token_ids)) >= len(set(plain.token_ids))
    assert penalized.token_ids != plain.token_ids or len(set(plain.token_ids)) == 12


def test_stream_chunks_carry_logprobs(engine):
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2)
    full = engine.generate("Kappa", params)
    chunks = list(engine.stream("Kappa", params))
    streamed = [lp for c in chunks for lp in (c.logprobs or [])]
    assert [lp.token_id for lp in streamed] == full.token_ids
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in full.logprobs])
