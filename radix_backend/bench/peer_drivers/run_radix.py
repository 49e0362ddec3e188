"""radix-backend in its own process, as a library user runs it: one Engine, each wave one batch.

Run in the project's venv: `python run_radix.py PLAN.json RESULT.json`.
"""

from __future__ import annotations

import time

from driver_protocol import CallResult, main, measure


def run(plan: dict) -> dict:
    start = time.perf_counter()
    from radix_backend import Engine, SamplingParams

    engine = Engine(plan["model_gguf"], **plan.get("radix_engine_args", {}))
    startup = time.perf_counter() - start

    def run_wave(prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool) -> list[CallResult]:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=ignore_eos)
        outputs = engine.generate(input_ids=prompts, params=params)
        return [CallResult(o.text, len(o.token_ids), o.meta.cached_tokens) for o in outputs]

    def reset_cache() -> None:
        if not engine.flush_cache():
            raise RuntimeError("engine busy: could not flush the cache")

    result = measure(plan, run_wave, reset_cache, "radix-backend")
    report = engine.runner.quantization
    result["startup_s"] = startup
    result["version"] = f"radix-backend ({report.mode}: {report.reason})"
    engine.shutdown()
    return result


if __name__ == "__main__":
    main(run)
