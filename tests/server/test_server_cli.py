"""`serve()` as the CLI runs it: a real server process with 2 data-parallel replicas of a tiny model,
reached over loopback by the openai client, then stopped with Ctrl-C (SIGINT)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai

from radix_backend.server import add_serve_args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_add_serve_args_defaults() -> None:
    args = add_serve_args(argparse.ArgumentParser()).parse_args(["--dp-size", "2", "--disable-radix-cache"])
    assert (args.host, args.port, args.dp_size, args.disable_radix_cache, args.model) == ("127.0.0.1", 30000, 2, True, None)


def test_serve_process_dp2_inprocess_router(tiny_llama_dir) -> None:
    """`--dp-mode inprocess`: two replicas in one server process behind radix-backend's own router
    (the gateway fleet, the default for --dp-size, is tested in test_gateway.py)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "radix_backend.server", "--model", str(tiny_llama_dir), "--port", str(port),
           "--dp-size", "2", "--dp-mode", "inprocess", "--kv-cache-tokens", "4096", "--served-model-name", "tiny", "--log-level", "warning"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
        assert httpx.get(url + "/get_server_info").json()["dp_size"] == 2
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stdout.read() if proc.stdout else ""
