"""`radix-backend bench llama-bench`: llama.cpp's own `pp`/`tg` tests, run on our engine and, side by
side, by llama.cpp's `llama-bench` on the same GGUF file with the same threads.

llama-bench's tests, as it runs them: `pp N` processes N random tokens in one batch from an empty
cache (prompt throughput); `tg N` generates N tokens one at a time from an empty cache (batch-1
decode throughput); each test is repeated and reported as mean and standard deviation of tokens per
second. Ours does the same forward passes through `Engine.generate`: a prompt of N random ids with
one output token, and a one-token prompt with N output tokens (N forwards of one token each), greedy,
from a flushed cache, speculative decoding off (llama-bench does not speculate; `--speculative`
measures our default instead). A CPU user's like-with-like check of raw speed on their own file.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass
class Rate:
    """One test's tokens per second over its repetitions."""

    test: str  # "pp512", "tg128"
    mean: float
    stddev: float

    @classmethod
    def of(cls, test: str, samples: list[float]) -> "Rate":
        return cls(test, statistics.fmean(samples), statistics.stdev(samples) if len(samples) > 1 else 0.0)


def measure(engine, prompt: int, generate: int, repeats: int) -> list[Rate]:
    """Our pp/tg rates on `engine`'s model, measured as llama-bench measures them."""
    from radix_backend import SamplingParams

    vocab = engine.runner.config.vocab_size
    rnd = random.Random(0)
    greedy = lambda n: SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    engine.generate(input_ids=[rnd.randrange(vocab) for _ in range(8)], params=greedy(4))  # warm-up
    rates = []
    for test, ids, new, tokens in (("pp", prompt, 1, prompt), ("tg", 1, generate, generate)):
        if not tokens:
            continue
        samples = []
        for _ in range(repeats):
            engine.flush_cache()
            input_ids = [rnd.randrange(vocab) for _ in range(ids)]
            start = time.perf_counter()
            engine.generate(input_ids=input_ids, params=greedy(new))
            samples.append(tokens / (time.perf_counter() - start))
        rates.append(Rate.of(f"{test}{tokens}", samples))
    return rates


def llama_cpp(binary: str, model: str, prompt: int, generate: int, repeats: int, threads: int) -> list[Rate]:
    """llama-bench's own figures (its JSON output) for the same tests."""
    cmd = [binary, "-m", model, "-t", str(threads), "-p", str(prompt), "-n", str(generate), "-r", str(repeats),
           "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"llama-bench failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return [Rate(f"pp{t['n_prompt']}" if t["n_prompt"] else f"tg{t['n_gen']}", t["avg_ts"], t["stddev_ts"])
            for t in json.loads(done.stdout)]


def format_table(rows: dict[str, Rate], peer: dict[str, Rate]) -> str:
    lines = ["| test | radix-backend tok/s | llama.cpp tok/s | radix-backend / llama.cpp |", "| --- | --- | --- | --- |"]
    for test, rate in rows.items():
        other = peer.get(test)
        theirs = f"{other.mean:.1f} ± {other.stddev:.1f}" if other else "-"
        ratio = f"{rate.mean / other.mean:.2f}x" if other and other.mean > 0 else "-"
        lines.append(f"| {test} | {rate.mean:.1f} ± {rate.stddev:.1f} | {theirs} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .peer_drivers.driver_protocol import cpu_model

    parser = argparse.ArgumentParser(prog="radix-backend bench llama-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help=".gguf file (default: the embedded SmolLM2)")
    parser.add_argument("-p", "--n-prompt", type=int, default=512, help="pp test: prompt tokens (0: skip)")
    parser.add_argument("-n", "--n-gen", type=int, default=128, help="tg test: generated tokens (0: skip)")
    parser.add_argument("-r", "--repetitions", type=int, default=5)
    parser.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary, run side by side")
    parser.add_argument("--speculative", action="store_true", help="ours with speculative decoding (our default)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.repetitions < 1 or args.n_prompt < 0 or args.n_gen < 0:
        parser.error("repetitions must be >= 1 and token counts >= 0")
    threads = torch.get_num_threads()
    from radix_backend import Engine

    with Engine(args.model, speculative=args.speculative) as engine:
        if engine.checkpoint.gguf is None:
            parser.error("llama-bench compares GGUF files: give --model a .gguf")
        model = str(engine.checkpoint.path)
        rates = measure(engine, args.n_prompt, args.n_gen, args.repetitions)
    peer = llama_cpp(args.llama_bench, model, args.n_prompt, args.n_gen, args.repetitions, threads) \
        if args.llama_bench else []
    print(f"{Path(model).name} on {cpu_model()}, {threads} threads")
    print(format_table({r.test: r for r in rates}, {r.test: r for r in peer}))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "cpu": cpu_model(), "threads": threads,
                                               "radix-backend": [asdict(r) for r in rates],
                                               "llama.cpp": [asdict(r) for r in peer]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
