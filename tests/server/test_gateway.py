"""Scale-out behind SGLang's model gateway (smg): the launcher's argument handling and the worker
endpoints (always), and real fleets of radix-backend workers behind the gateway on loopback (when
the `[scale]` extra is installed): answers equal to a direct worker, streaming, a killed worker
routed around, cache-aware routing beating round-robin on multi-turn chats, `serve --dp-size 2`."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from radix_backend.errors import MissingDependencyError
from radix_backend.server import app as server_app
from radix_backend.server import launcher

needs_gateway = pytest.mark.skipif(importlib.util.find_spec("smg") is None,
                                   reason="the gateway (smg, extra [scale]) is not installed")


def serve_args(*argv: str) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = server_app.add_serve_args(argparse.ArgumentParser())
    return parser.parse_args(list(argv)), parser


# ------------------------------------------------------------------ launcher pieces (no gateway needed)
def test_worker_argv_keeps_user_flags_and_drops_fleet_flags() -> None:
    args, parser = serve_args("--model", "/m", "--dp-size", "3", "--port", "8000", "--host", "0.0.0.0",
                              "--router-policy", "round_robin", "--api-key", "k", "--kv-cache-tokens", "4096",
                              "--no-enable-jump-forward", "--incremental-streaming-output", "--page-size", "4")
    argv = launcher.worker_argv(args, parser, 41234)
    assert argv[:3] == [sys.executable, "-m", "radix_backend.server"]
    flags = argv[3:]
    assert flags[-4:] == ["--host", "127.0.0.1", "--port", "41234"]
    assert "--api-key" not in flags and "k" not in flags  # the key travels in the environment (ps shows argv)
    for expected in (["--model", "/m"], ["--kv-cache-tokens", "4096"], ["--page-size", "4"]):
        i = flags.index(expected[0])
        assert flags[i:i + 2] == expected
    assert "--no-enable-jump-forward" in flags and "--incremental-streaming-output" in flags
    assert "--dp-size" not in flags and "--router-policy" not in flags and flags.count("--port") == 1
    reparsed, _ = serve_args(*flags)  # a worker's flags parse back to the same engine settings
    assert reparsed.kv_cache_tokens == 4096 and reparsed.enable_jump_forward is False and reparsed.dp_size == 1


def test_gateway_command_and_worker_envs() -> None:
    launch = launcher.gateway_command(["http://a:1", "http://b:2"], host="0.0.0.0", port=30000, policy="round_robin",
                                      api_key="sk-secret", metrics_port=29999, extra_args=["--log-level", "warn"])
    cmd = launch.argv
    assert cmd[:2] == [sys.executable, "-c"] and "smg.launch_router" in cmd[2]
    text = " ".join(cmd)
    assert "--worker-urls http://a:1 http://b:2" in text and "--policy round_robin" in text
    assert "--prometheus-host 127.0.0.1 --prometheus-port 29999" in text
    assert cmd[-2:] == ["--log-level", "warn"]
    # the key never reaches the command line, which `ps` shows every local user
    assert "sk-secret" not in text and launch.env[launcher.GATEWAY_KEY_ENV] == "sk-secret"
    assert launcher.GATEWAY_KEY_ENV not in launcher.gateway_command(["http://a:1"], host="h", port=1).env
    with pytest.raises(ValueError, match="policy"):
        launcher.gateway_command(["http://a:1"], host="h", port=1, policy="fastest")
    with pytest.raises(ValueError, match="worker"):
        launcher.gateway_command([], host="h", port=1)
    envs = launcher.worker_envs(2, "cpu", api_key="k")
    assert [e["OMP_NUM_THREADS"] for e in envs] == [str(max(1, (os.cpu_count() or 1) // 2))] * 2
    assert all(e["RADIX_BACKEND_API_KEY"] == "k" for e in envs)


def test_missing_gateway_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "smg" else real(name, *a))
    with pytest.raises(MissingDependencyError, match=r"radix-backend\[scale\]"):
        launcher.require_gateway()
    args, parser = serve_args("--dp-size", "2")
    with pytest.raises(MissingDependencyError, match="scale"):
        launcher.local_fleet(args, parser)


def test_a_worker_that_dies_while_starting_stops_the_fleet(capsys: pytest.CaptureFixture[str]) -> None:
    port = launcher.free_port()
    fleet = launcher.Fleet([[sys.executable, "-c", "import sys; sys.exit(3)"],
                            [sys.executable, "-c", "import time; time.sleep(60)"]], [dict(os.environ)] * 2,
                           [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{launcher.free_port()}"], None, None)
    start = time.monotonic()
    assert launcher.run_fleet(fleet) == 1
    err = capsys.readouterr().err
    assert "did not start" in err and "exited with code 3" in err  # names what died
    assert all(p.poll() is not None for p in fleet.workers) and time.monotonic() - start < 30


def test_inprocess_mode_refuses_gateway_only_policies() -> None:
    args, _ = serve_args("--dp-size", "2", "--dp-mode", "inprocess", "--router-policy", "power_of_two")
    with pytest.raises(SystemExit, match="needs --dp-mode process"):
        server_app.run_serve(args)


def test_worker_endpoints_the_gateway_reads(tiny_engine) -> None:
    from radix_backend.server import ServerThread, create_app

    with ServerThread(create_app(tiny_engine)) as srv:
        info = httpx.get(srv.url + "/get_server_info").json()
        assert info["model_path"] == info["served_model_name"] and "/" not in info["model_path"]
        assert info["max_total_tokens"] == tiny_engine.cache_stats().slots_total and info["dp_size"] == 1
        assert httpx.get(srv.url + "/server_info").json()["model_path"] == info["model_path"]
        assert httpx.get(srv.url + "/model_info").json()["model_path"] == info["model_path"]
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == info["served_model_name"]
        assert httpx.get(srv.url + "/health").status_code == 200


# ------------------------------------------------------------------ real fleets (gateway installed)
def tiny_fleet(model_dir: Path, n: int, policy: str = "cache_aware", api_key: str | None = None) -> launcher.Fleet:
    extra = ["--api-key", api_key] if api_key else []
    args, parser = serve_args("--model", str(model_dir), "--kv-cache-tokens", "8192", "--device", "cpu",
                              "--log-level", "warning", "--dp-size", str(n), "--router-policy", policy,
                              "--port", str(launcher.free_port()), *extra)
    fleet = launcher.local_fleet(args, parser)
    fleet.gateway.argv += ["--log-level", "warn", "--health-check-interval-secs", "1"]
    return fleet


def served_model(base: str, **headers: str) -> str:
    return httpx.get(base + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


def greedy(base: str, prompt: str, max_tokens: int = 8, **headers: str) -> dict:
    """A greedy chat call; the gateway routes by model name, so the served one is asked for."""
    body = {"model": served_model(base, **headers), "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    r = httpx.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@needs_gateway
def test_gateway_answers_like_a_worker_streams_and_routes_around_a_dead_worker(tiny_llama_dir: Path) -> None:
    import openai

    with tiny_fleet(tiny_llama_dir, 2) as fleet:
        gw = fleet.gateway_url
        prompts = [f"Tell me about topic number {i}." for i in range(6)]
        via_gateway = [greedy(gw, p)["choices"][0]["message"]["content"] for p in prompts]
        direct = [greedy(fleet.worker_urls[0], p)["choices"][0]["message"]["content"] for p in prompts]
        assert via_gateway == direct
        client = openai.OpenAI(base_url=gw + "/v1", api_key="none", max_retries=0, timeout=60)
        stream = client.chat.completions.create(model=served_model(gw), messages=[{"role": "user", "content": prompts[0]}],
                                                max_tokens=8, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == direct[0]

        fleet.workers[1].kill()  # mid-run: the gateway must stop sending there
        fleet.workers[1].wait()
        start = time.monotonic()
        after = [greedy(gw, p)["choices"][0]["message"]["content"] for p in prompts]
        assert after == direct and time.monotonic() - start < 60  # every request answered, none hung


@needs_gateway
def test_gateway_passes_the_api_key_through(tiny_llama_dir: Path) -> None:
    with tiny_fleet(tiny_llama_dir, 2, api_key="sekret") as fleet:
        assert httpx.post(fleet.gateway_url + "/v1/chat/completions", timeout=30,
                          json={"model": Path(tiny_llama_dir).name,
                                "messages": [{"role": "user", "content": "hi"}]}).status_code == 401
        out = greedy(fleet.gateway_url, "hi", Authorization="Bearer sekret")
        assert out["choices"][0]["message"]["content"]
        assert httpx.get(fleet.worker_urls[0] + "/v1/models").status_code == 401  # workers want the key too
        for proc in fleet.processes:  # what `ps` shows any local user
            assert b"sekret" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        for name in ("default", str(tiny_llama_dir)):  # the names one `serve` accepts work through the gateway
            r = httpx.post(fleet.gateway_url + "/v1/chat/completions", timeout=60, headers={"Authorization": "Bearer sekret"},
                           json={"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 200, (name, r.text)


@needs_gateway
def test_cache_aware_routing_beats_round_robin_on_multi_turn_chats(tiny_llama_dir: Path) -> None:
    """The ShareGPT multi-turn load through the gateway (`bench server --workers 2`'s code): the hit
    rate summed over the two workers' own caches."""
    from radix_backend.bench import server_bench
    from radix_backend.bench.workloads import load_sharegpt_conversations

    convs = load_sharegpt_conversations(8, max_turns=3, max_message_chars=400, seed=0)
    rates = {}
    for policy in ("cache_aware", "round_robin"):
        out = server_bench.run_through_gateway(2, policy, model=str(tiny_llama_dir), kv_cache_tokens=8192,
                                               conversations=convs, num_clients=4, max_new_tokens=8, timeout=120)
        assert out["errors"] == 0 and out["requests"] == sum(sum(m["role"] == "user" for m in c) for c in convs)
        assert out["config"]["workers"] == 2 and all(p > 0 for p in out["worker_prompt_tokens"])  # both served
        rates[policy] = out["worker_hit_rate"]
    print(f"summed worker hit rate: cache_aware {rates['cache_aware']:.3f}, round_robin {rates['round_robin']:.3f}")
    assert rates["cache_aware"] > rates["round_robin"]


@needs_gateway
def test_serve_dp_size_starts_and_stops_the_fleet(tiny_llama_dir: Path, tmp_path: Path) -> None:
    port = launcher.free_port()
    # Ctrl-C's SIGINT as a terminal delivers it: a test run started in the background by a
    # non-interactive shell (`sh -c '... &'`) hands its children SIGINT *ignored*, which Python
    # keeps, so the launched process gets Python's default handler back first
    start_with_sigint = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                         "sys.argv[0] = 'radix-backend'; runpy.run_module('radix_backend.cli', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", start_with_sigint, "serve", "--model", str(tiny_llama_dir),
                             "--dp-size", "2", "--port", str(port), "--kv-cache-tokens", "4096",
                             "--log-level", "warning"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = ""
        while not line.startswith("radix-backend: gateway"):  # printed once everything is healthy
            line = proc.stdout.readline()
            assert line, "serve exited before the fleet was up"
        assert "2 workers" in line, line
        worker_urls = line.rsplit("(", 1)[1].rstrip(")\n").split(", ")
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
        assert models["data"][0]["id"] == Path(tiny_llama_dir).name
        assert greedy(f"http://127.0.0.1:{port}", "hello")["choices"][0]["message"]["content"]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    for url in [f"http://127.0.0.1:{port}", *worker_urls]:  # all of it is gone
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=2)


@pytest.mark.slow
@needs_gateway
def test_gateway_on_smollm2(smollm2_checkpoint) -> None:
    """For the record: two SmolLM2 workers behind the gateway answer like one worker."""
    args, parser = serve_args("--dp-size", "2", "--port", str(launcher.free_port()), "--log-level", "warning",
                              "--kv-cache-tokens", "8192", "--quantization", "none")
    with launcher.local_fleet(args, parser) as fleet:
        prompts = ["What is the capital of France?", "Name a primary color."]
        via = [greedy(fleet.gateway_url, p, 12)["choices"][0]["message"]["content"] for p in prompts]
        direct = [greedy(fleet.worker_urls[1], p, 12)["choices"][0]["message"]["content"] for p in prompts]
        assert via == direct and all(via)
        print(json.dumps(via))
