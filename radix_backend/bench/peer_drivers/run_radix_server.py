"""radix-backend through its HTTP server: `python -m radix_backend.server` on loopback, the GGUF as
is, a wave's requests sent concurrently to `/v1/completions` (its scheduler batches them); the cache
is emptied with `/flush_cache`.

Run in the project's venv: `python run_radix_server.py PLAN.json RESULT.json`.
"""

from __future__ import annotations

import subprocess
import sys

from driver_protocol import main, measure
from openai_servers import free_port, post_command, stop_server, wait_ready
from run_vllm import completions_wave


def start_server(plan: dict, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "radix_backend.server", "--model", plan["model_gguf"], "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "model", "--log-level", "warning"]
    for key, value in plan.get("radix_engine_args", {}).items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    log = open(plan["server_log"], "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run(plan: dict) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(plan, port)
    try:
        ready_s = wait_ready(base, proc)

        result = measure(plan, completions_wave(base), lambda: post_command(f"{base}/flush_cache"),
                         "radix-backend serve")
        result["startup_s"] = ready_s
        args = ", ".join(f"{k}={v}" for k, v in plan.get("radix_engine_args", {}).items()) or "defaults"
        result["version"] = f"radix-backend serve ({args}, OpenAI server)"
        return result
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main(run)
