"""Batch invariance: a request's logits at every step, and so its tokens, are the same bits whether it
runs alone on a cold cache or inside any batch: with other requests of mixed lengths, with shared
prefixes served from the radix tree or reloaded from the disk tier, with its prefill chunked at
other places, after a retraction, greedy or with a seed. Checked on SmolLM2 on the default path
(the GGUF's own low-bit weights on the native kernels) and on the fp32 reference path."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from radix_backend import Engine, SamplingParams
from radix_backend.bench.invariance import (
    Case,
    random_cases,
    recording_step_logits,
    retraction_cases,
    run_alone,
    run_together,
)
from radix_backend.kernels import native
from engine_switches import speculation

pytestmark = pytest.mark.skipif(not native.available(), reason="batch invariance is a property of the native CPU kernels")


@pytest.fixture
def step_logits() -> Iterator[dict[str, list[torch.Tensor]]]:
    """Every sampled row's logits, per request id, in step order."""
    with recording_step_logits() as seen:
        yield seen


QUANTIZATIONS, PATH_IDS = ["auto", "none"], ["gguf-native", "fp32"]  # the default path, the fp32 reference
# the default path with each attention product (auto picks bf16 where the CPU has it), the fp32 reference
ENGINE_PATHS = {"gguf-native": ("auto", "fp32"), "gguf-native-bf16-attention": ("auto", "bf16"), "fp32": ("none", "auto")}


@pytest.fixture(scope="module", params=list(ENGINE_PATHS.values()), ids=list(ENGINE_PATHS))
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    """A small KV pool (retractions, evictions) and short prefill chunks."""
    quantization, attention = request.param
    with Engine(quantization=quantization, attention_dtype=attention, kv_cache_tokens=1000,
                chunked_prefill_tokens=48) as eng:
        assert eng.kernel_path.batch_invariant and eng.kernel_path.attention_bf16 == (attention == "bf16")
        yield eng


def assert_same(alone, together) -> None:
    for i, ((tokens_a, logits_a), (tokens_b, logits_b)) in enumerate(zip(alone, together)):
        assert len(logits_a) == len(logits_b), f"request {i}: {len(logits_a)} vs {len(logits_b)} steps"
        for step, (a, b) in enumerate(zip(logits_a, logits_b)):
            assert torch.equal(a, b), f"request {i} step {step}: logits differ by {float((a - b).abs().max())}"
        assert tokens_a == tokens_b, f"request {i}"


@pytest.mark.parametrize("seed,count", [(0, None), (1, 48)])
def test_random_batches_give_each_request_its_solo_bits(engine: Engine, step_logits, seed: int,
                                                        count: int | None) -> None:
    cases = random_cases(seed, count)
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
    with speculation(engine, False):  # drafted requests would finish before the pool runs short
        together = run_together(engine, cases, step_logits, seed=3)
    assert engine.cache_stats().retractions > before
    assert_same(alone, together)


def test_batch_mates_behind_one_cached_prefix_read_it_once_with_their_solo_bits(
        engine: Engine, step_logits, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows whose requests continue one cached radix node read its keys once per chunk of
    requests (`native.KeySharing`), and each still gets the logits it gets alone."""
    rng = random.Random(11)
    prefix = [rng.randrange(100, 40000) for _ in range(140)]
    cases = [Case(prefix + [rng.randrange(100, 40000) for _ in range(rng.randrange(2, 30))],
                  SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)) for _ in range(5)]
    found: list[native.KeySharing | None] = []
    find = native.KeySharing.find.__func__
    monkeypatch.setattr(native.KeySharing, "find",
                        classmethod(lambda cls, *args, **kwargs: found.append(find(cls, *args, **kwargs)) or found[-1]))
    with speculation(engine, False):  # drafted rows are extends; decode rows are what this is about
        alone = run_alone(engine, cases, step_logits)
        assert not any(found)
        engine.generate(input_ids=prefix, params=SamplingParams(max_new_tokens=1))  # the node the batch continues
        together = run_together(engine, cases, step_logits, seed=5)
    assert_same(alone, together)
    assert any(sharing is not None and int(sharing.shared.max()) == 128 for sharing in found)


@pytest.mark.parametrize("quantization", QUANTIZATIONS, ids=PATH_IDS)
def test_the_disk_tier_reloads_give_the_same_bits(quantization: str, step_logits, tmp_path: Path) -> None:
    """A long prompt is written through to disk, dropped from memory, and loaded back."""
    with Engine(quantization=quantization, chunked_prefill_tokens=48, disk_cache_dir=str(tmp_path),
                disk_cache_write_through_tokens=64) as engine:
        reload_and_compare(engine, step_logits)


@pytest.mark.parametrize("quantization", QUANTIZATIONS, ids=PATH_IDS)
def test_a_batch_served_from_the_disk_tier_gives_the_same_bits(quantization: str, step_logits,
                                                                  tmp_path: Path) -> None:
    """Random requests run alone (their KV written through), the memory tree emptied, then all at
    once into an 800-slot pool: their prefixes come back from disk in the batch."""
    with Engine(quantization=quantization, kv_cache_tokens=800, chunked_prefill_tokens=48,
                disk_cache_dir=str(tmp_path), disk_cache_write_through_tokens=64) as engine:
        cases = random_cases(1)
        alone = run_alone(engine, cases, step_logits)
        assert engine.flush_cache()
        before = engine.cache_stats().disk_hit_tokens
        together = run_together(engine, cases, step_logits, seed=1)
        assert engine.cache_stats().disk_hit_tokens > before
    assert_same(alone, together)


def reload_and_compare(engine: Engine, step_logits) -> None:
    rng = random.Random(11)
    prompt = [rng.randrange(100, 40000) for _ in range(300)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    (cold_tokens, cold_logits), = run_alone(engine, [Case(prompt, params)], step_logits)
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
