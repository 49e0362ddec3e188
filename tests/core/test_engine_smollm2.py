"""End to end on the embedded SmolLM2-135M-Instruct: the engine reproduces HF greedy tokens,
cached or not, single or batched, with chunked prefill on or off."""

from __future__ import annotations

import pytest
import torch

from radix_backend import Engine, SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = "You are a concise assistant. Answer in one short sentence."
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?",
             "Who wrote Romeo and Juliet?", "What is the boiling point of water in Celsius?"]
N_NEW = 20


def _messages(q: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]


@pytest.fixture(scope="module")
def references(engine, smollm2_hf_model) -> dict[str, list[int]]:
    refs = {}
    for q in QUESTIONS:
        ids = engine.encode(engine.apply_chat_template(_messages(q)))
        out = smollm2_hf_model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False)
        refs[q] = out[0, len(ids):].tolist()
    return refs


def test_single_requests_match_hf_cold_and_cached(engine, references):
    params = SamplingParams(max_new_tokens=N_NEW, temperature=0)
    for q in QUESTIONS:
        cold = engine.generate(messages=_messages(q), params=params)
        assert cold.token_ids == references[q], q
        warm = engine.generate(messages=_messages(q), params=params)
        assert warm.meta.cached_tokens == warm.meta.prompt_tokens - 1  # all but the last prompt token reused
        assert warm.token_ids == references[q], q


def test_batched_matches_hf(engine, references):
    engine.flush_cache()
    outs = engine.generate(messages=[_messages(q) for q in QUESTIONS], params=SamplingParams(max_new_tokens=N_NEW, temperature=0))
    assert [o.token_ids for o in outs] == [references[q] for q in QUESTIONS]
    # the shared system prompt was computed once: later requests in the batch hit it, or
    # every request was prefilled in the same forward (then nothing is cached yet)
    stats = engine.cache_stats()
    assert stats.running_requests == 0 and stats.slots_used == stats.cached_slots


@pytest.mark.parametrize("chunk", [7, 64])
def test_chunked_prefill_matches_hf(smollm2_checkpoint, references, chunk):
    with Engine(kv_cache_tokens=8192, chunked_prefill_tokens=chunk) as eng:
        outs = eng.generate(messages=[_messages(q) for q in QUESTIONS[:3]],
                            params=SamplingParams(max_new_tokens=N_NEW, temperature=0))
        assert [o.token_ids for o in outs] == [references[q] for q in QUESTIONS[:3]]
        # the chunks of running prompts went into the tree as they were computed
        assert eng.cache_stats().cached_slots > 0


def test_page_size_4_matches_hf(references):
    with Engine(kv_cache_tokens=8192, page_size=4, chunked_prefill_tokens=32) as eng:
        for _ in range(2):  # cold, then on cache hits (page-aligned)
            outs = eng.generate(messages=[_messages(q) for q in QUESTIONS[:3]],
                                params=SamplingParams(max_new_tokens=N_NEW, temperature=0))
            assert [o.token_ids for o in outs] == [references[q] for q in QUESTIONS[:3]]
        assert eng.flush_cache()
        stats = eng.cache_stats()
        assert stats.slots_free == stats.slots_total


def test_score_matches_hf_loglikelihood(engine, smollm2_hf_model):
    prefix = "The capital of France is"
    choices = [" Paris", " London", " a big city"]
    scores = engine.score(prefix, choices)
    for choice, sc in zip(choices, scores):
        ids = engine.encode(prefix + choice)
        with torch.no_grad():
            logits = smollm2_hf_model(torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        start = len(ids) - len(sc.token_ids)
        ref = [lp[i - 1, ids[i]].item() for i in range(start, len(ids))]
        assert sc.token_logprobs == pytest.approx(ref, abs=1e-3)
    assert max(scores, key=lambda s: s.normalized_logprob).text == " Paris"


def test_next_token_logits_matches_hf(engine, smollm2_hf_model):
    ids = engine.encode("Once upon a time, there was")
    ours = engine.next_token_logits(ids)
    with torch.no_grad():
        ref = smollm2_hf_model(torch.tensor([ids])).logits[0, -1].float()
    assert torch.allclose(ours, ref, atol=1e-3, rtol=1e-3)
    before = engine.cache_stats()
    engine.next_token_logits(ids + [int(ours.argmax())])
    after = engine.cache_stats()
    assert after.cached_tokens - before.cached_tokens == len(ids)  # only the new token computed


def test_stream_concatenates_to_generate(engine):
    params = SamplingParams(max_new_tokens=30, temperature=0)
    msgs = _messages("Tell me about the moon.")
    full = engine.generate(messages=msgs, params=params)
    chunks = list(engine.stream(messages=msgs, params=params))
    assert "".join(c.text for c in chunks) == full.text
    assert chunks[-1].finish_reason == full.finish_reason
    assert sum(len(c.token_ids) for c in chunks) == len(full.token_ids)
