"""Batch-invariance probe: each request's logits at every step when it runs alone on a cold cache,
against the same request inside a mixed batch (shared prefixes from the tree, chunked prefill,
decode rows beside prefill chunks, staggered arrivals).

The property tests (tests/core/test_batch_invariance.py) assert bit equality on the CPU paths with
it; `gpu_check --invariance` reports with it how far a GPU backend is from that."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from radix_backend import SamplingParams
from radix_backend.scheduler import output_processor


@dataclass
class Case:
    """One request: prompt token ids and how to sample it."""

    ids: list[int]
    params: SamplingParams


# Per request: its tokens and its logits rows, one per sampled step.
Run = list[tuple[list[int], list[torch.Tensor]]]


@contextmanager
def recording_step_logits() -> Iterator[dict[str, list[torch.Tensor]]]:
    """While open, every sampled row's logits are kept, per request id, in step order."""
    seen: dict[str, list[torch.Tensor]] = {}
    sample = output_processor.OutputProcessor._sample_rows

    def recording(self: Any, reqs: list, rows: list[int], logits: torch.Tensor, *args: Any) -> Any:
        for req, row in zip(reqs, rows):
            seen.setdefault(req.rid, []).append(logits[row].clone())
        return sample(self, reqs, rows, logits, *args)

    output_processor.OutputProcessor._sample_rows = recording
    try:
        yield seen
    finally:
        output_processor.OutputProcessor._sample_rows = sample


def random_cases(seed: int, count: int | None = None) -> list[Case]:
    """`count` requests (default 20-40): half continue one of a shared prompt's prefixes, lengths
    2-240 tokens, greedy or seeded sampling, 3-13 new tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, 40000) for _ in range(90)]
    cases = []
    for i in range(rng.randrange(20, 41) if count is None else count):
        own = [rng.randrange(100, 40000) for _ in range(rng.randrange(2, 150))]
        ids = shared[:rng.randrange(40, 91)] + own if rng.random() < 0.5 else own
        sampled = rng.random() < 0.3
        cases.append(Case(ids, SamplingParams(max_new_tokens=rng.randrange(3, 14), ignore_eos=True,
                                              temperature=0.9 if sampled else 0.0,
                                              seed=1000 + i if sampled else None)))
    return cases


def retraction_cases() -> list[Case]:
    """Eight long generations that outgrow a 1000-token pool together (alone each fits)."""
    rng = random.Random(7)
    return [Case([rng.randrange(100, 40000) for _ in range(60)],
                 SamplingParams(max_new_tokens=80, temperature=0.0, ignore_eos=True)) for _ in range(8)]


def run_alone(engine: Any, cases: list[Case], logits: dict[str, list[torch.Tensor]]) -> Run:
    """Each request on its own, the cache flushed before it."""
    results = []
    for case in cases:
        if not engine.flush_cache():
            raise RuntimeError("the cache could not be flushed (requests still running)")
        logits.clear()
        out = engine.generate(input_ids=case.ids, params=case.params)
        results.append((list(out.token_ids), logits[out.request_id]))
    return results


def run_together(engine: Any, cases: list[Case], logits: dict[str, list[torch.Tensor]], seed: int,
                 timeout_s: float = 300) -> Run:
    """Submitted one after another with random pauses, so batches mix prefill chunks and decode rows."""
    rng = random.Random(seed)
    logits.clear()
    handles = []
    for case in cases:
        handles.append(engine.submit(input_ids=case.ids, params=case.params))
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.05)
    outs = [h.wait(timeout_s) for h in handles]
    return [(list(o.token_ids), logits[o.request_id]) for o in outs]


@dataclass
class Comparison:
    """How far the batched run is from the solo runs."""

    requests: int
    steps: int  # compared: those whose earlier tokens agree
    identical_steps: int  # logits rows equal bit for bit
    identical_requests: int  # every step identical
    same_tokens: int  # requests whose token ids agree
    max_abs_diff: float

    @property
    def invariant(self) -> bool:
        """Every compared step bit-identical and every request's tokens the same."""
        return self.identical_steps == self.steps and self.same_tokens == self.requests


def compare(alone: Run, together: Run) -> Comparison:
    steps = identical = identical_requests = same_tokens = 0
    worst = 0.0
    for (tokens_a, logits_a), (tokens_b, logits_b) in zip(alone, together):
        all_equal = len(logits_a) == len(logits_b)
        for step, (a, b) in enumerate(zip(logits_a, logits_b)):
            if tokens_a[:step] != tokens_b[:step]:  # a different token came before: other inputs
                break
            steps += 1
            if torch.equal(a, b):
                identical += 1
            else:
                all_equal = False
                worst = max(worst, float((a.float() - b.float()).abs().max()))
        identical_requests += all_equal
        same_tokens += tokens_a == tokens_b
    return Comparison(len(alone), steps, identical, identical_requests, same_tokens, worst)
