"""`radix-backend`: generate, demo, bench, serve."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

EXTERNAL_BENCHES = {  # bench name -> module with main(argv)
    "json": "radix_backend.bench.json_bench",
    "dsl": "radix_backend.bench.dsl_bench",
    "adapters": "radix_backend.bench.adapters_bench",
    "server": "radix_backend.bench.server_bench",
    "gpu-check": "radix_backend.bench.gpu_check",
    "peers": "radix_backend.bench.peers",
    "restart": "radix_backend.bench.restart_bench",
    "gguf-agreement": "radix_backend.bench.gguf_agreement",
    "spec": "radix_backend.bench.spec_bench",
    "llama-bench": "radix_backend.bench.llama_bench",
}
CORE_BENCHES = ("few-shot", "multi-turn", "branching", "floor")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from .config import add_cli_args

    p.add_argument("--model", default=None, help="HF checkpoint dir or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    add_cli_args(p.add_argument_group("engine"), only=("device", "kv_cache_tokens"))


def cmd_generate(args: argparse.Namespace) -> int:
    from . import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            stop=args.stop, seed=args.seed)
    with Engine(args.model, device=args.device, kv_cache_tokens=args.kv_cache_tokens) as engine:
        kwargs = {"prompt": args.prompt} if args.raw else {"messages": [{"role": "user", "content": args.prompt}]}
        for chunk in engine.stream(params=params, **kwargs):
            print(chunk.text, end="", flush=True)
        print()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import default_disk_cache_dir, run_demo

    disk = None if args.no_disk_cache else (args.disk_cache_dir or default_disk_cache_dir())
    run_demo(model=args.model, device=args.device, kv_cache_tokens=args.kv_cache_tokens, disk_cache_dir=disk)
    return 0


def run_external_bench(name: str, argv: list[str]) -> int:
    result = importlib.import_module(EXTERNAL_BENCHES[name]).main(argv)
    return result if isinstance(result, int) else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import core_bench

    names = list(CORE_BENCHES) if args.name == "core" else [args.name]
    start = time.time()
    results = core_bench.run(names, model=args.model, quick=args.quick,
                             kv_cache_tokens=args.kv_cache_tokens or 65536)
    print(f"\n(total bench time {time.time() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radix-backend", description="RadixAttention inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt (streamed)")
    g.add_argument("prompt")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    _add_engine_args(g)

    d = sub.add_parser("demo", help="few-shot + multi-turn + fork workload and framework adapters on one shared cache")
    _add_engine_args(d)
    d.add_argument("--disk-cache-dir", default=None, help="the disk KV tier's directory (default: <user cache>/kv)")
    d.add_argument("--no-disk-cache", action="store_true", help="run without the disk KV tier")

    b = sub.add_parser("bench", help=f"benchmarks: {', '.join(CORE_BENCHES)}, core (all of those), "
                                     f"{', '.join(EXTERNAL_BENCHES)} (extra args go to that bench)")
    b.add_argument("name", choices=[*CORE_BENCHES, "core", *EXTERNAL_BENCHES])
    b.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    b.add_argument("--json", default=None, help="also write results to this JSON file")
    _add_engine_args(b)

    s = sub.add_parser("serve", help="OpenAI-compatible + SGLang-native HTTP server")
    from .server import add_serve_args
    add_serve_args(s)

    gw = sub.add_parser("gateway", help="SGLang's model gateway (smg, extra [scale]) in front of radix-backend workers")
    from .server.launcher import add_gateway_args
    add_gateway_args(gw)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in EXTERNAL_BENCHES:
        return run_external_bench(argv[1], argv[2:])  # every flag (--help too) belongs to that bench
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "demo":
        return cmd_demo(args)
    if args.command == "bench":
        return cmd_bench(args)
    if args.command == "gateway":
        from .server.launcher import run_gateway

        return run_gateway(args)
    from .server import run_serve
    run_serve(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
