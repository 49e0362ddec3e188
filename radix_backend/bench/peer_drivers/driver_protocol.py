"""What every peer driver measures, the same way, given one function that runs a wave of prompts.

The prompt file (written by `radix-backend bench peers`) holds token ids, so every system sees the
same tokens. A system provides `run_wave(prompts, max_new_tokens, ignore_eos) -> [CallResult]`,
which sends the wave's calls as that system serves independent calls best (one batch, concurrent
requests, or one after another), and `reset_cache()`, which empties its prefix cache.
Standard library only: this runs inside each peer's own venv.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class CallResult:
    text: str
    completion_tokens: int
    cached_tokens: int | None  # prompt tokens served from the system's prefix cache (None: not reported)


RunWave = Callable[[list[list[int]], int, bool], list[CallResult]]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def measure(plan: dict, run_wave: RunWave, reset_cache: Callable[[], None], system: str,
            batched_decode: bool = True) -> dict:
    """Run the plan's workloads and micro-measures; returns the results as a JSON-ready dict."""
    out: dict = {"system": system, "cpu": cpu_model(), "workloads": {}, "micro": {}}
    warm = plan["decode"]["prompts"][0]
    run_wave([warm], 4, False)  # warm-up: lazy init, first-call compilation
    for workload in plan["workloads"]:
        walls = []
        for _ in range(plan.get("repeats", 1)):  # best of N: a shared VM's noise only ever adds time
            reset_cache()
            calls: list[CallResult] = []
            start = time.perf_counter()
            for wave in workload["waves"]:
                calls.extend(run_wave(wave, workload["max_new_tokens"], False))
            walls.append(time.perf_counter() - start)
        wall = min(walls)
        cached = [c.cached_tokens for c in calls]
        out["workloads"][workload["name"]] = {
            "wall_s": wall, "wall_s_runs": walls, "calls": len(calls),
            "prompt_tokens": sum(len(p) for wave in workload["waves"] for p in wave),
            "cached_tokens": None if any(c is None for c in cached) else sum(cached),
            "completion_tokens": sum(c.completion_tokens for c in calls),
            "texts": [c.text for c in calls],
        }
        print(f"[measure] {system} {workload['name']}: {wall:.2f} s", file=sys.stderr, flush=True)
    out["micro"]["prefill_tok_s"] = _prefill(plan, run_wave, reset_cache)
    print(f"[measure] {system} prefill: {out['micro']['prefill_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    for batch in plan["decode"]["batch_sizes"]:
        if batch > 1 and not batched_decode:
            out["micro"][f"decode_b{batch}_tok_s"] = None
            continue
        rate = out["micro"][f"decode_b{batch}_tok_s"] = _decode(plan, run_wave, reset_cache, batch)
        print(f"[measure] {system} decode b{batch}: " + ("too fast to tell from noise" if rate is None else f"{rate:.1f} tok/s"),
              file=sys.stderr, flush=True)
    return out


def _prefill(plan: dict, run_wave: RunWave, reset_cache: Callable[[], None]) -> float:
    """Tokens per second of one long prompt with nothing cached (one output token), best of 2."""
    ids = plan["prefill"]["prompt"]
    best = float("inf")
    for _ in range(2):
        reset_cache()
        start = time.perf_counter()
        run_wave([ids], 1, True)
        best = min(best, time.perf_counter() - start)
    return len(ids) / best


def _decode(plan: dict, run_wave: RunWave, reset_cache: Callable[[], None], batch: int) -> float | None:
    """Decode tokens per second at `batch` concurrent requests: (N - 1) extra tokens each, timed as
    the difference between an N-token and a 1-token run of the same prompts (prefill cancels),
    each the best of 2 runs; None when the difference is lost in noise."""
    prompts = plan["decode"]["prompts"][:batch]
    n = plan["decode"]["max_new_tokens"]
    timings = {}
    for tokens in (1, n):
        for _ in range(2):  # best of 2 for each
            reset_cache()
            start = time.perf_counter()
            results = run_wave(prompts, tokens, True)
            timings[tokens] = min(timings.get(tokens, float("inf")), time.perf_counter() - start)
            if any(r.completion_tokens != tokens for r in results):
                raise RuntimeError(f"decode run produced {[r.completion_tokens for r in results]} tokens, "
                                   f"expected {tokens}")
    if timings[n] <= timings[1]:  # the extra tokens cost less than the runs' noise (a tiny model)
        return None
    return batch * (n - 1) / (timings[n] - timings[1])


def main(run: Callable[[dict], dict]) -> None:
    """`driver.py PLAN.json RESULT.json`: run the plan, write the result."""
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} PLAN.json RESULT.json")
    with open(sys.argv[1]) as handle:
        plan = json.load(handle)
    result = run(plan)
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)

