"""Load benchmark of the HTTP server: N concurrent chat clients replaying ShareGPT conversations.

Each client takes a conversation and sends its turns in order; turn t resends the whole history
(the dataset's own assistant replies, so prompts do not depend on what the model says), which is
the multi-turn pattern the radix cache is built for. Reported: request throughput, output and
prompt tokens/s, p50/p90/p99 of end-to-end latency and time to first token, and the cache hit
rate from `usage.prompt_tokens_details.cached_tokens`.

    python -m radix_backend.bench.server_bench --compare            # in-process server, cache on vs off
    python -m radix_backend.bench.server_bench --base-url http://127.0.0.1:30000   # a running server
    radix-backend bench server --workers 1,2 --policies cache_aware,round_robin      # through the gateway
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import InvalidRequestError, MissingDependencyError
from .workloads import load_sharegpt_conversations

DEFAULT_SYSTEM = "You are a helpful assistant."


# ============================================================================ measurement


@dataclass
class _Sample:
    latency_s: float
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class _Result:
    samples: list[_Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """Nearest-rank style percentiles (linear interpolation), {"p50": ..., ...}."""
    if not values:
        return {f"p{q}": float("nan") for q in qs}
    s = sorted(values)
    out = {}
    for q in qs:
        k = (len(s) - 1) * q / 100
        lo, hi = int(k), min(int(k) + 1, len(s) - 1)
        out[f"p{q}"] = s[lo] + (s[hi] - s[lo]) * (k - lo)
    return out


async def _one_turn(client: Any, model: str, messages: list[dict[str, str]], max_new_tokens: int,
                    result: _Result) -> None:
    start = time.perf_counter()
    ttft = None
    usage = None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_new_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.perf_counter() - start
            if chunk.usage is not None:
                usage = chunk.usage
    except Exception as exc:  # noqa: BLE001 - counted, the load goes on
        result.errors.append(f"{type(exc).__name__}: {exc}")
        return
    latency = time.perf_counter() - start
    details = getattr(usage, "prompt_tokens_details", None)
    result.samples.append(_Sample(latency, ttft if ttft is not None else latency, usage.prompt_tokens if usage else 0,
                                  (details.cached_tokens or 0) if details else 0,
                                  usage.completion_tokens if usage else 0))


async def _drive(base_url: str, model: str | None, conversations: list[list[dict[str, str]]], num_clients: int,
                 max_new_tokens: int, system_prompt: str | None, timeout: float) -> tuple[_Result, float]:
    try:
        import openai
    except ImportError as exc:
        raise MissingDependencyError.for_extra("openai", "server") from exc
    result = _Result()
    queue: asyncio.Queue = asyncio.Queue()
    for conv in conversations:
        queue.put_nowait(conv)
    async with openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="none", max_retries=0,
                                  timeout=timeout) as client:
        if model is None:
            model = (await client.models.list()).data[0].id

        async def worker() -> None:
            while not queue.empty():
                conv = queue.get_nowait()
                history = [{"role": "system", "content": system_prompt}] if system_prompt else []
                for msg in conv:
                    history.append(msg)
                    if msg["role"] == "user":
                        await _one_turn(client, model, list(history), max_new_tokens, result)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(num_clients)))
        return result, time.perf_counter() - start


def _summarize(result: _Result, wall_s: float) -> dict[str, Any]:
    s = result.samples
    prompt = sum(x.prompt_tokens for x in s)
    cached = sum(x.cached_tokens for x in s)
    completion = sum(x.completion_tokens for x in s)
    return {
        "requests": len(s), "errors": len(result.errors), "first_errors": result.errors[:3],
        "wall_s": wall_s,
        "requests_per_s": len(s) / wall_s if wall_s else 0.0,
        "output_tokens_per_s": completion / wall_s if wall_s else 0.0,
        "prompt_tokens_per_s": prompt / wall_s if wall_s else 0.0,
        "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "latency_s": percentiles([x.latency_s for x in s]),
        "ttft_s": percentiles([x.ttft_s for x in s]),
    }


# ============================================================================ entry points


def run(*, base_url: str | None = None, model: str | None = None, num_clients: int = 8,
        num_conversations: int = 16, max_turns: int = 3, max_new_tokens: int = 32, max_message_chars: int = 600,
        radix_cache: bool = True, engine_kwargs: dict[str, Any] | None = None, system_prompt: str | None = DEFAULT_SYSTEM,
        seed: int = 0, timeout: float = 600.0, conversations: list[list[dict[str, str]]] | None = None) -> dict[str, Any]:
    """Run the load and return its numbers.

    With `base_url` the load goes to that server (its own cache setting applies); without, an
    in-process server over `Engine(model, disable_radix_cache=not radix_cache, **engine_kwargs)`
    is started on a free loopback port and shut down afterwards.
    """
    if num_clients < 1 or num_conversations < 1:
        raise InvalidRequestError("num_clients and num_conversations must be >= 1")
    convs = conversations if conversations is not None else load_sharegpt_conversations(
        num_conversations, max_turns=max_turns, max_message_chars=max_message_chars, seed=seed)
    config = {"num_clients": num_clients, "num_conversations": len(convs), "max_turns": max_turns,
              "max_new_tokens": max_new_tokens, "radix_cache": radix_cache if base_url is None else None,
              "base_url": base_url}
    if base_url is not None:
        result, wall = asyncio.run(_drive(base_url, model, convs, num_clients, max_new_tokens, system_prompt, timeout))
        return {"config": config, **_summarize(result, wall)}

    from ..engine import Engine
    from ..server import ServerThread, create_app

    engine = Engine(model, disable_radix_cache=not radix_cache, **(engine_kwargs or {}))
    try:
        with ServerThread(create_app(engine)) as srv:
            result, wall = asyncio.run(_drive(srv.url, None, convs, num_clients, max_new_tokens, system_prompt, timeout))
        stats = engine.cache_stats()
    finally:
        engine.shutdown()
    return {"config": config, **_summarize(result, wall), "engine_cache_stats": asdict(stats)}


def compare(**kwargs: Any) -> dict[str, Any]:
    """The same load with the radix cache on and off (in-process servers, same conversations)."""
    kwargs.pop("base_url", None)
    kwargs.pop("radix_cache", None)
    if kwargs.get("conversations") is None:
        kwargs["conversations"] = load_sharegpt_conversations(
            kwargs.get("num_conversations", 16), max_turns=kwargs.get("max_turns", 3),
            max_message_chars=kwargs.get("max_message_chars", 600), seed=kwargs.get("seed", 0))
    on = run(radix_cache=True, **kwargs)
    off = run(radix_cache=False, **kwargs)
    return {"radix_cache": on, "no_radix_cache": off,
            "throughput_ratio": on["output_tokens_per_s"] / off["output_tokens_per_s"] if off["output_tokens_per_s"] else None,
            "p50_latency_ratio": off["latency_s"]["p50"] / on["latency_s"]["p50"] if on["latency_s"]["p50"] else None}


def run_through_gateway(workers: int, policy: str, *, model: str | None = None,
                        kv_cache_tokens: int | None = None, **load: Any) -> dict[str, Any]:
    """The load through SGLang's model gateway in front of `workers` radix-backend worker processes
    (each its own engine and cache, an equal share of the cores); adds the hit rate summed over the
    workers' own cache stats (`worker_hit_rate`)."""
    import argparse

    import httpx

    from ..server.app import add_serve_args
    from ..server.launcher import free_port, local_fleet

    parser = add_serve_args(argparse.ArgumentParser())
    argv = ["--dp-size", str(workers), "--router-policy", policy, "--port", str(free_port()), "--log-level", "warning"]
    argv += (["--model", model] if model else []) + (["--kv-cache-tokens", str(kv_cache_tokens)] if kv_cache_tokens else [])
    fleet = local_fleet(parser.parse_args(argv), parser)
    fleet.gateway.argv += ["--log-level", "warn"]
    with fleet:
        out = run(base_url=fleet.gateway_url, **load)
        stats = [httpx.get(u + "/get_server_info", timeout=30).json()["cache_stats"] for u in fleet.worker_urls]
    prompt = sum(st["prompt_tokens"] for st in stats)
    out["config"] |= {"workers": workers, "policy": policy}
    out["worker_hit_rate"] = sum(st["cached_tokens"] for st in stats) / prompt if prompt else 0.0
    out["worker_prompt_tokens"] = [st["prompt_tokens"] for st in stats]
    return out


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """A small Markdown table of named results (what BENCHMARKS.md shows)."""
    head = "| run | req/s | out tok/s | hit rate | p50 lat s | p90 lat s | p99 lat s | p50 TTFT s | errors |"
    lines = [head, "|" + " --- |" * 9]
    for name, r in results.items():
        lat, ttft = r["latency_s"], r["ttft_s"]
        lines.append(f"| {name} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | {r['cache_hit_rate']:.2f} "
                     f"| {lat['p50']:.2f} | {lat['p90']:.2f} | {lat['p99']:.2f} | {ttft['p50']:.2f} | {r['errors']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="Concurrent ShareGPT chat load against the server.")
    p.add_argument("--base-url", default=None, help="a running server; default: start one in-process")
    p.add_argument("--model", default=None)
    p.add_argument("--num-clients", type=int, default=8)
    p.add_argument("--num-conversations", type=int, default=16)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-message-chars", type=int, default=600)
    p.add_argument("--no-radix-cache", action="store_true")
    p.add_argument("--compare", action="store_true", help="run with and without the radix cache")
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--workers", default=None,
                   help="comma list of worker counts (e.g. 1,2): run through SGLang's model gateway (extra [scale]) "
                        "in front of that many worker processes")
    p.add_argument("--policies", default="cache_aware",
                   help="with --workers: comma list of gateway policies (cache_aware, round_robin, ...)")
    p.add_argument("--json", action="store_true", help="print the raw JSON instead of a table")
    args = p.parse_args(argv)
    kwargs: dict[str, Any] = dict(model=args.model, num_clients=args.num_clients,
                                  num_conversations=args.num_conversations, max_turns=args.max_turns,
                                  max_new_tokens=args.max_new_tokens, max_message_chars=args.max_message_chars)
    if args.kv_cache_tokens is not None:
        kwargs["engine_kwargs"] = {"kv_cache_tokens": args.kv_cache_tokens}
    if args.workers:
        kwargs["conversations"] = load_sharegpt_conversations(args.num_conversations, max_turns=args.max_turns,
                                                              max_message_chars=args.max_message_chars)
        model = kwargs.pop("model")
        out = {f"{n} worker{'s' if int(n) > 1 else ''}, {policy}": run_through_gateway(
                   int(n), policy, model=model, kv_cache_tokens=args.kv_cache_tokens, **kwargs)
               for n in args.workers.split(",") for policy in args.policies.split(",")}
        table = format_table(out) + "\n\nhit rate summed over the workers' caches: " + ", ".join(
            f"{name}: {r['worker_hit_rate']:.3f}" for name, r in out.items())
    elif args.compare:
        out = compare(**kwargs)
        table = format_table({"radix cache": out["radix_cache"], "no radix cache": out["no_radix_cache"]})
    else:
        out = run(base_url=args.base_url, radix_cache=not args.no_radix_cache, **kwargs)
        table = format_table({"radix cache" if not args.no_radix_cache else "no radix cache": out})
    print(json.dumps(out, indent=2, default=str) if args.json else table)
    return out


if __name__ == "__main__":
    main()
