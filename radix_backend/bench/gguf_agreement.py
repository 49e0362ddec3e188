"""`radix-backend bench gguf-agreement`: greedy agreement on GGUF files, three ways.

For each file: our engine in the file's own types, our fp32 reference (the file dequantized, which
reproduces HF transformers), and llama.cpp's `llama-server` on the same file (token ids in, greedy
token ids out, prompt cache off), on one fixed set of chat prompts. Reported per pair: on how many
prompts the first N generated tokens are equal, and how many tokens are. llama.cpp quantizes
activations to 8 bits in its dot products, so its distance from the fp32 reference is the
yardstick for ours. For random-weight models (whose chat text means nothing) `--random-prompts N`
sends N prompts of random token ids instead. Where ours and llama.cpp part, the fp32 reference's
gap between its two best next tokens after the shared part is reported too: on random models with
flat distributions a divergence at a near-tie says the two rounded differently, not that a weight
was mapped wrong.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a radix tree is.",
           "List three prime numbers.", "How do I boil an egg?", "Translate 'good morning' to Spanish.",
           "What is 12 times 7?", "Name a famous painter.", "Why is the sky blue?", "Give me a synonym for happy.",
           "What does CPU stand for?", "Tell me a fun fact about cats.", "Who wrote Hamlet?",
           "Describe the color green.", "What is photosynthesis?", "Suggest a name for a dog.",
           "How many legs does a spider have?", "What is the boiling point of water?",
           "Write one sentence about rain.", "What is machine learning?"]


def chat_prompts(engine) -> list[list[int]]:
    """PROMPTS as the model's chat template renders them."""
    return [engine.encode(engine.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]


def random_prompts(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of 12-37 random token ids from 4 up (past the usual special tokens)."""
    rnd = random.Random(seed)
    return [[rnd.randrange(4, vocab) for _ in range(rnd.randint(12, 37))] for _ in range(count)]


def greedy(engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from radix_backend import SamplingParams

    params = SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True)
    return [engine.generate(input_ids=i, params=params).token_ids for i in prompts]


def ours(path: Path, quantization: str, tokens: int, random_count: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy continuations) from our engine."""
    from radix_backend import Engine

    with Engine(str(path), kv_cache_tokens=8192, quantization=quantization) as engine:
        ids = random_prompts(engine.runner.config.vocab_size, random_count) if random_count else chat_prompts(engine)
        return ids, greedy(engine, ids, tokens)


def near_tie_gaps(engine, prompts: list[list[int]], a: list[list[int]], b: list[list[int]]) -> list[float]:
    """For each prompt whose continuations `a` and `b` part, `engine`'s gap (nats) between its two
    best next tokens after the part they share."""
    from radix_backend import SamplingParams

    params = SamplingParams(max_new_tokens=1, temperature=0, logprobs=True, top_logprobs=2)
    gaps = []
    for prompt, x, y in zip(prompts, a, b):
        shared = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), None)
        if shared is None:
            continue
        top = engine.generate(input_ids=prompt + x[:shared], params=params).logprobs[0].top
        gaps.append(top[0][1] - top[1][1])
    return gaps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server(binary: str, path: Path, prompts: list[list[int]], tokens: int, threads: int) -> list[list[int]]:
    port = _free_port()
    proc = subprocess.Popen([binary, "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
                             "-c", "4096", "-np", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"llama-server did not start on {path}")
                time.sleep(0.3)
        out = []
        for ids in prompts:
            body = {"prompt": ids, "n_predict": tokens, "temperature": 0, "samplers": ["top_k"], "top_k": 1,
                    "cache_prompt": False, "ignore_eos": True, "return_tokens": True}
            request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            out.append(json.loads(urllib.request.urlopen(request, timeout=300).read())["tokens"])
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def agreement(a: list[list[int]], b: list[list[int]], tokens: int) -> str:
    same = sum(x[:tokens] == y[:tokens] for x, y in zip(a, b))
    equal_tokens = sum(p == q for x, y in zip(a, b) for p, q in zip(x[:tokens], y[:tokens]))
    return f"{same}/{len(a)} prompts, {equal_tokens}/{tokens * len(a)} tokens"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radix-backend bench gguf-agreement", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help=".gguf files")
    parser.add_argument("--llama-server", required=True, help="path of llama.cpp's llama-server binary")
    parser.add_argument("--tokens", type=int, default=8, help="greedy tokens compared per prompt")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--random-prompts", type=int, default=0, metavar="N",
                        help="N prompts of random token ids instead of the chat prompts (random-weight models)")
    args = parser.parse_args(argv)
    from radix_backend import Engine

    print("| file | ours vs llama.cpp | ours vs our fp32 reference | fp32 reference vs llama.cpp "
          "| fp32 reference's top-2 gap where ours and llama.cpp part (nats) |")
    print("| --- | --- | --- | --- | --- |")
    for name in args.files:
        path = Path(name).expanduser().resolve()
        ids, native = ours(path, "auto", args.tokens, args.random_prompts)
        llama = llama_server(args.llama_server, path, ids, args.tokens, args.threads)
        with Engine(str(path), kv_cache_tokens=8192, quantization="none") as engine:
            reference = greedy(engine, ids, args.tokens)
            gaps = near_tie_gaps(engine, ids, [x[:args.tokens] for x in native], [y[:args.tokens] for y in llama])
        parted = f"{min(gaps):.4f}-{max(gaps):.4f} ({len(gaps)} prompts)" if gaps else "-"
        print(f"| {path.name} | {agreement(native, llama, args.tokens)} | {agreement(native, reference, args.tokens)} "
              f"| {agreement(reference, llama, args.tokens)} | {parted} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
