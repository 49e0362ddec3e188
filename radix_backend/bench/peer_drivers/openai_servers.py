"""Start, probe and stop the OpenAI-compatible servers the benches drive (standard library only, so
the peer drivers can import it from any venv, and the adapters bench from the package).
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

STARTUP_TIMEOUT_S = 900
VLLM_CPU_ENV = {"VLLM_USE_AOT_COMPILE": "0", "VLLM_CPU_KVCACHE_SPACE": "4",  # all cores, none reserved
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def preloaded(plan: dict) -> str:
    """The libraries the bench preloaded into a vLLM peer (`peers.vllm_preloads`), for its row's label."""
    names = [os.path.basename(path) for path in plan.get("preloaded") or []]
    return f", preloaded {' + '.join(names)}" if names else ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read()
    return json.loads(raw) if raw.strip() else {}


def post_command(url: str, timeout: float = 60) -> None:
    """POST with no body to an endpoint whose reply is not JSON on every server (a cache flush);
    an error unless it answers 200."""
    request = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}")


def start_vllm_server(vllm_python: str, model_dir: str, dtype: str, context_tokens: int, port: int,
                      log_path: str) -> subprocess.Popen:
    """vLLM's OpenAI server on loopback, serving `model_dir` as "model", prefix caching on; its own
    session, so `stop_server` ends whatever it spawns."""
    env = {**os.environ, **VLLM_CPU_ENV, "VLLM_SERVER_DEV_MODE": "1"}  # dev mode exposes /reset_prefix_cache
    cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", "model", "--dtype", dtype, "--enable-prefix-caching",
           "--enable-prompt-tokens-details", "--max-model-len", str(context_tokens),
           "--host", "127.0.0.1", "--port", str(port)]
    log = open(log_path, "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(base: str, proc: subprocess.Popen) -> float:
    """Seconds until `base`/health answers; an error if the server exits or never answers."""
    start = time.perf_counter()
    while time.perf_counter() - start < STARTUP_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see its log")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5):
                return time.perf_counter() - start
        except (urllib.error.URLError, OSError):
            time.sleep(1)
    raise TimeoutError("the server did not become healthy")


def stop_server(proc: subprocess.Popen) -> None:
    """Stop a server started in its own session, and whatever it spawned."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
