"""llama.cpp's own server peer: `llama-server` on loopback with parallel slots (`-np 32`, so a
wave's concurrent requests decode together) and its prompt cache on; the GGUF file as is.

Run with any Python (standard library only): `python run_llamaserver.py PLAN.json RESULT.json`; the
plan names the `llama-server` binary. The cache is reset by restarting the server.
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

from driver_protocol import CallResult, main, measure
from openai_servers import free_port, post, wait_ready

SLOTS = 32


def start_server(plan: dict, port: int) -> subprocess.Popen:
    cmd = [plan["llama_server"], "-m", plan["model_gguf"], "--host", "127.0.0.1", "--port", str(port),
           "-t", str(os.cpu_count()), "-np", str(SLOTS), "-c", str(SLOTS * plan["context_tokens"]), "--no-warmup"]
    log = open(plan["server_log"], "a")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def run(plan: dict) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    state = {"proc": start_server(plan, port)}
    try:
        ready_s = wait_ready(base, state["proc"])
        pool = ThreadPoolExecutor(max_workers=SLOTS)

        def one(ids: list[int], max_new_tokens: int, ignore_eos: bool) -> CallResult:
            body = {"prompt": ids, "n_predict": max_new_tokens, "temperature": 0, "cache_prompt": True,
                    "ignore_eos": ignore_eos}
            out = post(f"{base}/completion", body)
            return CallResult(out["content"], out["tokens_predicted"], out.get("timings", {}).get("cache_n"))

        def run_wave(prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool) -> list[CallResult]:
            return list(pool.map(lambda ids: one(ids, max_new_tokens, ignore_eos), prompts))

        def reset_cache() -> None:
            state["proc"].terminate()
            state["proc"].wait(timeout=60)
            state["proc"] = start_server(plan, port)
            wait_ready(base, state["proc"])

        result = measure(plan, run_wave, reset_cache, "llama-server")
        result["startup_s"] = ready_s
        version = subprocess.run([plan["llama_server"], "--version"], capture_output=True, text=True)
        build = (version.stdout + version.stderr).strip().splitlines()
        result["version"] = (f"llama-server {build[0] if build else '?'} ({os.path.basename(plan['model_gguf'])}, "
                             f"-np {SLOTS}, prompt cache)")
        return result
    finally:
        state["proc"].terminate()
        try:
            state["proc"].wait(timeout=30)
        except subprocess.TimeoutExpired:
            state["proc"].kill()


if __name__ == "__main__":
    main(run)
