"""Soak: 500 mixed requests against one engine with a KV pool small enough to force retraction; a
third are aborted mid-flight, some are poisoned (bad input, or a fault injected into their sampler
row). Asserts: no innocent request failed, every innocent output equals its run-alone output, and
no KV slot leaked. The figures are printed for BENCHMARKS.md."""

from __future__ import annotations

import random
import time

import pytest

from radix_backend import Engine, SamplingParams
from radix_backend.errors import InvalidRequestError, RequestAbortedError

from test_fault_isolation import Poisoned, poison_sampler

REQUESTS = 500
POISON = 424_242
WORDS = "the a radix tree keeps every prefix cached so later calls reuse it and run fast".split()


def _prompt(rng: random.Random) -> str:
    shared = " ".join(WORDS[:rng.choice([0, 4, 8, 12])])  # shared prefixes of several lengths
    return (shared + " " + " ".join(rng.choices(WORDS, k=rng.randint(3, 30)))).strip()


def _params(rng: random.Random) -> SamplingParams:
    return SamplingParams(max_new_tokens=rng.randint(1, 48), temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def small_engine(tiny_llama_dir):
    # a few concurrent requests fit: more are admitted as others finish, and decode growth retracts
    with Engine(str(tiny_llama_dir), kv_cache_tokens=320, device="cpu", dtype="float32", debug_slots=True) as eng:
        yield eng


def test_soak_mixed_aborted_and_poisoned(small_engine, monkeypatch, capsys) -> None:
    rng = random.Random(0)
    plan = []  # (kind, prompt, params)
    for i in range(REQUESTS):
        roll = rng.random()
        kind = "abort" if roll < 1 / 3 else "poison_input" if roll < 0.38 else "poison_fault" if roll < 0.43 else "ok"
        plan.append((kind, _prompt(rng), _params(rng)))

    alone = {}
    for kind, prompt, params in plan:
        if kind == "ok" and (prompt, params.max_new_tokens) not in alone:
            alone[(prompt, params.max_new_tokens)] = small_engine.generate(prompt, params).token_ids
    assert small_engine.flush_cache()
    retractions_before = small_engine.cache_stats().retractions

    poison_sampler(monkeypatch, POISON)
    start = time.perf_counter()
    handles = []
    for kind, prompt, params in plan:
        if kind == "poison_input":
            bad = rng.choice([dict(temperature=float("nan")), dict(top_p=float("inf")), dict(repetition_penalty=1e-39),
                              dict(seed=2 ** 64), dict(max_new_tokens=10 ** 9)])
            with pytest.raises((InvalidRequestError, ValueError)):
                small_engine.submit(prompt, params.copy(**bad))
            handles.append(None)
            continue
        if kind == "poison_fault":
            params = params.copy(seed=POISON, temperature=0.8, max_new_tokens=max(params.max_new_tokens, 2))
        handles.append(small_engine.submit(prompt, params))
    for (kind, _, _), handle in zip(plan, handles):
        if kind == "abort" and rng.random() < 0.9:
            small_engine.abort(handle.rid)

    innocent_failures, mismatches, aborted, poisoned_failed = 0, 0, 0, 0
    for (kind, prompt, params), handle in zip(plan, handles):
        if handle is None:
            continue
        try:
            out = handle.wait(timeout=300)
        except RequestAbortedError:
            aborted += 1
            assert kind == "abort"
            continue
        except Poisoned:
            poisoned_failed += 1
            assert kind == "poison_fault"
            continue
        except Exception:  # noqa: BLE001 - counted, then asserted zero
            innocent_failures += 1
            continue
        if kind == "ok" and out.token_ids != alone[(prompt, params.max_new_tokens)]:
            mismatches += 1
    elapsed = time.perf_counter() - start

    stats = small_engine.cache_stats()
    assert stats.running_requests == 0 and stats.waiting_requests == 0
    assert small_engine.flush_cache()
    after = small_engine.cache_stats()
    leaked = after.slots_used
    retractions = after.retractions - retractions_before
    counts = {k: sum(1 for p in plan if p[0] == k) for k in ("ok", "abort", "poison_input", "poison_fault")}
    with capsys.disabled():
        print(f"\nsoak: {REQUESTS} requests {counts}, aborted {aborted}, poisoned rejected {counts['poison_input']}, "
              f"poisoned failed {poisoned_failed}, innocent failures {innocent_failures}, output mismatches "
              f"{mismatches}, leaked slots {leaked}, retractions {retractions}, {elapsed:.1f} s")
    assert innocent_failures == 0 and mismatches == 0 and leaked == 0
    assert poisoned_failed == counts["poison_fault"]
    assert retractions > 0, "the pool was meant to be small enough to force retraction"
