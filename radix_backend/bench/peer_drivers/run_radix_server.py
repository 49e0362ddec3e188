"""radix-backend through its HTTP server: `python -m radix_backend.server` on loopback, the GGUF as
is, a wave's requests sent concurrently to `/v1/completions` (its scheduler batches them); the cache
is emptied with `/flush_cache`.

Run in the project's venv: `python run_radix_server.py PLAN.json RESULT.json`.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from driver_protocol import CallResult, main, measure
from run_vllm import _free_port, _post, stop_server, wait_ready


def start_server(plan: dict, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "radix_backend.server", "--model", plan["model_gguf"], "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "model", "--log-level", "warning"]
    for key, value in plan.get("radix_engine_args", {}).items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    log = open(plan["server_log"], "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run(plan: dict) -> dict:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(plan, port)
    try:
        ready_s = wait_ready(base, proc)
        pool = ThreadPoolExecutor(max_workers=64)

        def one(ids: list[int], max_new_tokens: int, ignore_eos: bool) -> CallResult:
            body = {"model": "model", "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0,
                    "ignore_eos": ignore_eos}
            out = _post(f"{base}/v1/completions", body)
            details = out["usage"].get("prompt_tokens_details") or {}
            return CallResult(out["choices"][0]["text"], out["usage"]["completion_tokens"],
                              details.get("cached_tokens", 0))

        def run_wave(prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool) -> list[CallResult]:
            return list(pool.map(lambda ids: one(ids, max_new_tokens, ignore_eos), prompts))

        def reset_cache() -> None:
            request = urllib.request.Request(f"{base}/flush_cache", data=b"", method="POST")
            with urllib.request.urlopen(request, timeout=60) as response:
                if response.status != 200:
                    raise RuntimeError(f"/flush_cache answered {response.status}")

        result = measure(plan, run_wave, reset_cache, "radix-backend serve")
        result["startup_s"] = ready_s
        args = ", ".join(f"{k}={v}" for k, v in plan.get("radix_engine_args", {}).items()) or "defaults"
        result["version"] = f"radix-backend serve ({args}, OpenAI server)"
        return result
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main(run)
