"""llama.cpp peer (llama-cpp-python): the GGUF file as is, greedy, its RAM prompt cache on.

It serves one sequence at a time, so a wave's calls run one after another; batched decode is n/a.
Run in the llama.cpp venv: `python run_llamacpp.py PLAN.json RESULT.json`.
"""

from __future__ import annotations

import os
from pathlib import Path

from driver_protocol import CallResult, main, measure

CACHE_BYTES = 4 << 30


def run(plan: dict) -> dict:
    from llama_cpp import Llama, LlamaRAMCache

    llm = Llama(model_path=plan["model_gguf"], n_ctx=plan["context_tokens"], n_batch=512,
                n_threads=os.cpu_count(), verbose=False)
    eos = plan["eos_token_ids"]
    state = {"cache": None}

    def reset_cache() -> None:
        state["cache"] = LlamaRAMCache(capacity_bytes=CACHE_BYTES)
        llm.set_cache(state["cache"])
        llm.reset()  # also forget the live context, which llama.cpp reuses as an implicit 1-slot cache

    def run_wave(prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool) -> list[CallResult]:
        results = []
        for ids in prompts:
            out = llm.create_completion(prompt=ids, max_tokens=max_new_tokens, temperature=0.0,
                                        logit_bias={e: -1e9 for e in eos} if ignore_eos else None)
            results.append(CallResult(out["choices"][0]["text"], out["usage"]["completion_tokens"], None))
        return results

    reset_cache()
    result = measure(plan, run_wave, reset_cache, "llama.cpp", batched_decode=False)
    import llama_cpp
    result["version"] = f"llama-cpp-python {llama_cpp.__version__} ({Path(plan['model_gguf']).name}, RAM prompt cache)"
    return result


if __name__ == "__main__":
    main(run)
