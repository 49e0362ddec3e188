"""Batch invariance: a request's logits at every step, and so its tokens, are the same bits whether it
runs alone on a cold cache or inside any batch: with other requests of mixed lengths, with shared
prefixes served from the radix tree or reloaded from the disk tier, with its prefill chunked at
other places, after a retraction, greedy or with a seed. Checked on SmolLM2 on the default path
(the GGUF's own low-bit weights on the native kernels) and on the fp32 reference path."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from radix_backend import Engine, SamplingParams
from radix_backend.kernels import native
from radix_backend.scheduler import output_processor

pytestmark = pytest.mark.skipif(not native.available(), reason="batch invariance is a property of the native CPU kernels")

Case = tuple[list[int], SamplingParams]


@pytest.fixture
def step_logits(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[torch.Tensor]]:
    """Every sampled row's logits, per request id, in step order."""
    seen: dict[str, list[torch.Tensor]] = {}
    sample = output_processor.OutputProcessor._sample

    def recording(self, items, logits):
        for req, row in items:
            seen.setdefault(req.rid, []).append(logits[row].clone())
        return sample(self, items, logits)

    monkeypatch.setattr(output_processor.OutputProcessor, "_sample", recording)
    return seen


QUANTIZATIONS, PATH_IDS = ["auto", "none"], ["gguf-native", "fp32"]  # the default path, the fp32 reference


@pytest.fixture(scope="module", params=QUANTIZATIONS, ids=PATH_IDS)
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    """A small KV pool (retractions, evictions) and short prefill chunks."""
    with Engine(quantization=request.param, kv_cache_tokens=1000, chunked_prefill_tokens=48) as eng:
        assert eng.kernel_path.batch_invariant
        yield eng


def random_cases(seed: int) -> list[Case]:
    """20-40 requests: half continue one of a shared prompt's prefixes, lengths 2-240 tokens, greedy
    or seeded sampling, 3-13 new tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, 40000) for _ in range(90)]
    cases = []
    for i in range(rng.randrange(20, 41)):
        own = [rng.randrange(100, 40000) for _ in range(rng.randrange(2, 150))]
        ids = shared[:rng.randrange(40, 91)] + own if rng.random() < 0.5 else own
        sampled = rng.random() < 0.3
        cases.append((ids, SamplingParams(max_new_tokens=rng.randrange(3, 14), ignore_eos=True,
                                          temperature=0.9 if sampled else 0.0, seed=1000 + i if sampled else None)))
    return cases


def retraction_cases() -> list[Case]:
    """Eight long generations that outgrow the 1000-token pool together (alone each fits)."""
    rng = random.Random(7)
    return [([rng.randrange(100, 40000) for _ in range(60)], SamplingParams(max_new_tokens=80, temperature=0.0,
                                                                             ignore_eos=True)) for _ in range(8)]


def run_alone(engine: Engine, cases: list[Case], logits: dict) -> list[tuple[list[int], list[torch.Tensor]]]:
    results = []
    for ids, params in cases:
        assert engine.flush_cache()
        logits.clear()
        out = engine.generate(input_ids=ids, params=params)
        results.append((list(out.token_ids), logits[out.request_id]))
    return results


def run_together(engine: Engine, cases: list[Case], logits: dict, seed: int):
    """Submitted one after another with random pauses, so batches mix prefill chunks and decode rows."""
    rng = random.Random(seed)
    logits.clear()
    handles = []
    for ids, params in cases:
        handles.append(engine.submit(input_ids=ids, params=params))
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.05)
    outs = [h.wait(300) for h in handles]
    return [(list(o.token_ids), logits[o.request_id]) for o in outs]


def assert_same(alone, together) -> None:
    for i, ((tokens_a, logits_a), (tokens_b, logits_b)) in enumerate(zip(alone, together)):
        assert len(logits_a) == len(logits_b), f"request {i}: {len(logits_a)} vs {len(logits_b)} steps"
        for step, (a, b) in enumerate(zip(logits_a, logits_b)):
            assert torch.equal(a, b), f"request {i} step {step}: logits differ by {float((a - b).abs().max())}"
        assert tokens_a == tokens_b, f"request {i}"


@pytest.mark.parametrize("seed", [0, 1])
def test_random_batches_give_each_request_its_solo_bits(engine: Engine, step_logits, seed: int) -> None:
    cases = random_cases(seed)
    alone = run_alone(engine, cases, step_logits)
    before = engine.cache_stats()
    together = run_together(engine, cases, step_logits, seed)
    assert_same(alone, together)
    after = engine.cache_stats()
    assert after.cached_tokens > before.cached_tokens  # shared prefixes came from the tree or the disk


def test_a_retracted_request_resumes_with_the_same_bits(engine: Engine, step_logits) -> None:
    cases = retraction_cases()
    alone = run_alone(engine, cases, step_logits)
    before = engine.cache_stats().retractions
    together = run_together(engine, cases, step_logits, seed=3)
    assert engine.cache_stats().retractions > before
    assert_same(alone, together)


@pytest.mark.parametrize("quantization", QUANTIZATIONS, ids=PATH_IDS)
def test_the_disk_tier_reloads_give_the_same_bits(quantization: str, step_logits, tmp_path: Path) -> None:
    """A long prompt is written through to disk, dropped from memory, and loaded back."""
    with Engine(quantization=quantization, chunked_prefill_tokens=48, disk_cache_dir=str(tmp_path),
                disk_cache_write_through_tokens=64) as engine:
        reload_and_compare(engine, step_logits)


def reload_and_compare(engine: Engine, step_logits) -> None:
    rng = random.Random(11)
    prompt = [rng.randrange(100, 40000) for _ in range(300)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    (cold_tokens, cold_logits), = run_alone(engine, [(prompt, params)], step_logits)
    assert engine.flush_cache()
    step_logits.clear()
    disk_before = engine.cache_stats().disk_hit_tokens
    out = engine.generate(input_ids=prompt, params=params)
    assert engine.cache_stats().disk_hit_tokens > disk_before
    assert list(out.token_ids) == cold_tokens
    assert all(torch.equal(a, b) for a, b in zip(cold_logits, step_logits[out.request_id]))


@pytest.mark.parametrize("overrides,holds", [({}, True), ({"batch_invariant": False}, False),
                                             ({"native_kernels": False}, False)])
def test_the_kernel_path_says_whether_the_guarantee_holds(tiny_llama_dir: Path, overrides: dict, holds: bool) -> None:
    """Asked for but not deliverable (torch ops instead of the native kernels) reads as False."""
    with Engine(str(tiny_llama_dir), device="cpu", dtype="float32", kv_cache_tokens=256, **overrides) as eng:
        assert eng.kernel_path.batch_invariant is holds
