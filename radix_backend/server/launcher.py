"""Data parallelism across processes: `radix-backend serve --dp-size N` runs N worker servers (each
its own engine and radix cache) behind SGLang's model gateway, the Shepherd Model Gateway (PyPI
`smg`, extra `[scale]`), in cache-aware mode; `radix-backend gateway --worker-urls ...` runs the
gateway alone in front of workers on other machines.

The gateway keeps an approximate prefix tree per worker and sends a request to the worker that
most likely holds its prefix, falling back to the shortest queue under imbalance; it probes
`/health`, retries a failed request on another worker and drops a worker whose health check
fails. Workers are plain `radix-backend serve` processes on loopback ports; on CPU each gets an
equal share of the cores (`OMP_NUM_THREADS`), on CUDA one device each. Everything is started and
stopped together: when any process exits, or on SIGINT/SIGTERM, all are stopped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import InvalidRequestError, MissingDependencyError
from ..paths import public_model_name
from .guard import API_KEY_ENV

GATEWAY_MODULE = "smg.launch_router"
GATEWAY_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "least_load", "prefix_hash",
                    "consistent_hashing")
# flags of `serve` that configure the fleet, not a worker
# (the API key reaches workers through their environment: a command line is visible to every local user)
LAUNCHER_ONLY = {"help", "dp_size", "dp_mode", "router_policy", "host", "port", "gateway_arg", "api_key"}
STARTUP_TIMEOUT_S = 900.0


def require_gateway() -> None:
    """The gateway is an optional extra; say how to get it."""
    if importlib.util.find_spec("smg") is None:
        raise MissingDependencyError.for_extra("smg (SGLang's model gateway, for --dp-size across processes and "
                                               "`radix-backend gateway`)", "scale")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_url(host: str, port: int) -> str:
    """Where this machine reaches a server bound to `host`."""
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}"


# The gateway takes its API key only as a flag, which `ps` shows every local user. So it starts
# through this bootstrap, which appends the flag inside the process from an environment variable
# (readable by this user only) and removes the variable.
GATEWAY_KEY_ENV = "RADIX_BACKEND_GATEWAY_API_KEY"
_GATEWAY_BOOTSTRAP = (f"import os, sys; from {GATEWAY_MODULE} import launch_router, parse_router_args; "
                      f"key = os.environ.pop({GATEWAY_KEY_ENV!r}, ''); "
                      "launch_router(parse_router_args(sys.argv[1:] + (['--api-key', key] if key else [])))")


@dataclass
class GatewayLaunch:
    """How to start the gateway: its argv (no secret in it) and its environment (the key, if any)."""

    argv: list[str]
    env: dict[str, str]


def gateway_command(worker_urls: Sequence[str], *, host: str, port: int, policy: str = "cache_aware",
                    api_key: str | None = None, metrics_port: int | None = None,
                    health_check_interval_s: int = 5, extra_args: Sequence[str] = ()) -> GatewayLaunch:
    """The gateway process (run with this Python, where the `[scale]` extra lives); with `api_key`
    it asks clients for the key and sends it on to the workers."""
    if not worker_urls:
        raise InvalidRequestError("the gateway needs at least one worker URL")
    if policy not in GATEWAY_POLICIES:
        raise InvalidRequestError(f"policy must be one of {', '.join(GATEWAY_POLICIES)}; got {policy!r}")
    cmd = [sys.executable, "-c", _GATEWAY_BOOTSTRAP, "--worker-urls", *worker_urls, "--policy", policy,
           "--host", host, "--port", str(port), "--health-check-interval-secs", str(health_check_interval_s),
           # the gateway's own /metrics listener: loopback, and a port of its own (default 29000 collides)
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port or free_port()),
           # on SIGTERM it waits for in-flight requests, by default up to 180 s
           "--shutdown-grace-period-secs", "10", *extra_args]
    env = {k: v for k, v in os.environ.items() if k != GATEWAY_KEY_ENV} | ({GATEWAY_KEY_ENV: api_key} if api_key else {})
    return GatewayLaunch(cmd, env)


def worker_argv(args: argparse.Namespace, parser: argparse.ArgumentParser, port: int) -> list[str]:
    """`python -m radix_backend.server` flags of one worker: every serve flag the user set, minus the
    fleet's own (dp size, gateway host/port, policy), on a loopback port."""
    out: list[str] = []
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list of a parser's actions
        if action.dest in LAUNCHER_ONLY or not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = max((o for o in action.option_strings if not o.startswith("--no-")), key=len)
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
            out.append(flag)
        else:
            out += [flag, str(value)]
    return [sys.executable, "-m", "radix_backend.server", *out, "--host", "127.0.0.1", "--port", str(port)]


def worker_envs(dp_size: int, device: str, api_key: str | None = None) -> list[dict[str, str]]:
    """Per-worker environment: a share of the CPU cores each, or one CUDA device each (and the API key)."""
    base = dict(os.environ) | ({API_KEY_ENV: api_key} if api_key else {})
    if device.startswith("cuda") or device == "auto":
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() >= dp_size:
            return [base | {"CUDA_VISIBLE_DEVICES": str(i)} for i in range(dp_size)]
        if device.startswith("cuda"):
            raise InvalidRequestError(f"--dp-size {dp_size} needs {dp_size} CUDA devices, "
                                      f"found {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    threads = max(1, (os.cpu_count() or 1) // dp_size)
    return [base | {"OMP_NUM_THREADS": str(threads)} for _ in range(dp_size)]


def worker_model_id(url: str, api_key: str | None = None) -> str | None:
    """The model id a worker reports in /v1/models (the gateway routes by it); None if it cannot
    be asked now (a remote worker still starting: then clients name the model by its id)."""
    request = urllib.request.Request(url.rstrip("/") + "/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return str(json.loads(resp.read())["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError) as exc:
        print(f"radix-backend: could not ask {url} for its model id ({exc}); the gateway routes by that id only",
              file=sys.stderr)
        return None


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float = STARTUP_TIMEOUT_S,
                 api_key: str | None = None) -> None:
    """Until `url`/health answers 200; fails if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(url.rstrip("/") + "/health",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url} exited with code {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(request, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} did not become healthy within {timeout_s:.0f} s")


@dataclass
class Fleet:
    """Worker processes plus the gateway, started and stopped together."""

    worker_cmds: list[list[str]]
    worker_envs: list[dict[str, str]]
    worker_urls: list[str]
    gateway: GatewayLaunch | None
    gateway_url: str | None
    api_key: str | None = None
    # names clients may use for the model, as against one `serve` (which accepts "default" and the
    # name it was started with); the gateway maps them to the id the workers report
    model_aliases: list[str] = field(default_factory=lambda: ["default"])
    workers: list[subprocess.Popen] = field(default_factory=list)
    gateway_proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> Fleet:
        try:
            for cmd, env in zip(self.worker_cmds, self.worker_envs):
                self.workers.append(subprocess.Popen(cmd, env=env))
            for url, proc in zip(self.worker_urls, self.workers):
                wait_healthy(url, proc, timeout_s)
            if self.gateway is not None:
                canonical = worker_model_id(self.worker_urls[0], self.api_key)
                self.gateway.argv += [arg for alias in dict.fromkeys(self.model_aliases)
                                      if canonical is not None and alias != canonical
                                      for arg in ("--model-alias", f"{alias}={canonical}")]
                # its banner and logs go to stderr, so stdout keeps only what radix-backend reports
                self.gateway_proc = subprocess.Popen(self.gateway.argv, env=self.gateway.env, stdout=sys.stderr)
                wait_healthy(self.gateway_url, self.gateway_proc, 120, self.api_key)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def processes(self) -> list[subprocess.Popen]:
        return self.workers + ([self.gateway_proc] if self.gateway_proc is not None else [])

    def wait(self) -> int:
        """Block until a process exits (then stop the rest) and return its exit code."""
        while True:
            for proc in self.processes:
                if proc.poll() is not None:
                    self.stop()
                    return int(proc.returncode)
            time.sleep(0.5)

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop the gateway first (no new requests reach the workers), then the workers: SIGTERM,
        and SIGKILL for whatever has not exited within `grace_s`."""
        for group in ([self.gateway_proc] if self.gateway_proc else [], self.workers):
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for proc in group:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def local_fleet(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Fleet:
    """`serve --dp-size N`: N workers on free loopback ports and the gateway on --host/--port
    (`bench server --workers 1` uses it with one worker, to measure the gateway itself)."""
    require_gateway()
    if args.dp_size < 1:
        raise InvalidRequestError(f"--dp-size must be >= 1, got {args.dp_size}")
    ports = [free_port() for _ in range(args.dp_size)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    gateway = gateway_command(urls, host=args.host, port=args.port, policy=args.router_policy, api_key=api_key,
                              extra_args=args.gateway_arg or ())
    aliases = ["default"] + ([args.model, public_model_name(args.model)] if args.model else [])
    return Fleet([worker_argv(args, parser, p) for p in ports], worker_envs(args.dp_size, args.device, api_key), urls,
                 gateway, local_url(args.host, args.port), api_key, aliases)


def run_fleet(fleet: Fleet) -> int:
    """Start the fleet, print where it serves, and supervise it until a signal or an exit."""
    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        fleet.start()
        print(f"radix-backend: gateway {fleet.gateway_url} in front of {len(fleet.workers)} workers "
              f"({', '.join(fleet.worker_urls)})", flush=True)
        return fleet.wait()
    except KeyboardInterrupt:
        fleet.stop()
        return 0
    except (RuntimeError, TimeoutError) as exc:  # a process died or hung while starting: all were stopped
        print(f"radix-backend: the fleet did not start: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def add_gateway_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--worker-urls", nargs="+", required=True, help="radix-backend serve URLs (any machines)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--policy", choices=GATEWAY_POLICIES, default="cache_aware")
    parser.add_argument("--api-key", default=None,
                        help="required from clients and sent on to the workers (start them with the same key)")
    parser.add_argument("--health-check-interval-secs", type=int, default=5)
    parser.add_argument("--gateway-arg", action="append", default=[],
                        help="one more argument passed to the gateway as is (repeatable)")
    return parser


def run_gateway(args: argparse.Namespace) -> int:
    """`radix-backend gateway`: the gateway alone, in the foreground."""
    require_gateway()
    launch = gateway_command(args.worker_urls, host=args.host, port=args.port, policy=args.policy,
                             api_key=args.api_key or os.environ.get(API_KEY_ENV),
                             health_check_interval_s=args.health_check_interval_secs, extra_args=args.gateway_arg)
    fleet = Fleet([], [], list(args.worker_urls), launch, local_url(args.host, args.port),
                  args.api_key or os.environ.get(API_KEY_ENV))
    return run_fleet(fleet)
