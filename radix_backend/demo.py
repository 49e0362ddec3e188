"""`radix-backend demo`: a few-shot batch, a multi-turn chat and a fork, then the framework
adapters (when installed), all on one engine and one radix cache; prints outputs and hit rates.
The disk KV tier is on (in the user cache dir), so a second run loads the prefixes the first
computed instead of recomputing them."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from .engine import Engine
from .paths import cache_dir
from .sampling_params import SamplingParams
from .bench.workloads import FEW_SHOT_EXAMPLES

SYSTEM = ("You are a helpful assistant who answers briefly.\n\n"
          + "\n\n".join(f"Q: {q}\nA: {a}" for q, a in FEW_SHOT_EXAMPLES))
GREEDY = SamplingParams(max_new_tokens=40, temperature=0)


def _stats_line(engine: Engine, label: str, before) -> None:
    after = engine.cache_stats()
    prompt = after.prompt_tokens - before.prompt_tokens
    cached = after.cached_tokens - before.cached_tokens
    from_disk = after.disk_hit_tokens - before.disk_hit_tokens
    disk = f", {from_disk} of them loaded from disk" if from_disk else ""
    print(f"   [{label}] prompt tokens {prompt}, served from cache {cached} ({cached / max(1, prompt):.0%}){disk}\n")


def _section(engine: Engine, title: str, body: Callable[[], None]) -> None:
    print(f"== {title}")
    before = engine.cache_stats()
    t = time.perf_counter()
    body()
    print(f"   ({time.perf_counter() - t:.1f} s)")
    _stats_line(engine, title, before)


def few_shot(engine: Engine) -> None:
    questions = ["What is the largest planet in the solar system?", "Why is the sky blue?",
                 "Who wrote Pride and Prejudice?", "What is the freezing point of water?"]
    outs = engine.generate(messages=[[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
                                     for q in questions], params=GREEDY)
    for q, o in zip(questions, outs):
        print(f"   Q: {q}\n   A: {o.text.strip()}")


def multi_turn(engine: Engine) -> None:
    history = [{"role": "system", "content": SYSTEM}]
    for turn in ["Name a famous scientist.", "What are they best known for?", "Summarize that in five words."]:
        history.append({"role": "user", "content": turn})
        out = engine.generate(messages=history, params=GREEDY)
        history.append({"role": "assistant", "content": out.text.strip()})
        print(f"   user: {turn}\n   assistant: {out.text.strip()}  (cached {out.meta.cached_tokens}/{out.meta.prompt_tokens})")


def fork(engine: Engine) -> None:
    story = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "Describe a rainy afternoon in a small coastal town in three sentences."}]
    base = engine.generate(messages=story, params=GREEDY)
    transcript = story + [{"role": "assistant", "content": base.text.strip()}]
    print(f"   transcript: {base.text.strip()}")
    branches = ["Give it a title.", "What mood does it set?", "Continue with one more sentence."]
    outs = engine.generate(messages=[transcript + [{"role": "user", "content": b}] for b in branches], params=GREEDY)
    for b, o in zip(branches, outs):
        print(f"   branch '{b}' -> {o.text.strip()}")


def adapters(engine: Engine) -> None:
    try:
        from radix_backend.adapters.demo import run_adapter_demo
    except ImportError as exc:  # the adapters' extras are optional
        print(f"   skipped: {exc}")
        return
    run_adapter_demo(engine, SYSTEM)


def default_disk_cache_dir() -> Path:
    return cache_dir() / "kv"


def run_demo(model: str | None = None, device: str = "auto", kv_cache_tokens: int | None = None,
             disk_cache_dir: str | Path | None = None) -> None:
    """`disk_cache_dir` None: no disk tier (the CLI passes `default_disk_cache_dir()` unless told not to)."""
    t = time.perf_counter()
    with Engine(model, device=device, kv_cache_tokens=kv_cache_tokens or 32768,
                disk_cache_dir=None if disk_cache_dir is None else str(disk_cache_dir)) as engine:
        print(f"loaded {engine.model_id} on {engine.runner.device} in {time.perf_counter() - t:.1f} s "
              f"({engine.cache_stats().slots_total} KV slots)")
        print(f"disk KV tier: {disk_cache_dir} (run the demo again to see prefixes loaded instead of computed)\n"
              if disk_cache_dir is not None else "disk KV tier: off\n")
        _section(engine, "few-shot batch (shared 5-shot prefix)", lambda: few_shot(engine))
        _section(engine, "multi-turn chat", lambda: multi_turn(engine))
        _section(engine, "fork: one transcript, three branches", lambda: fork(engine))
        _section(engine, "framework adapters on the same engine", lambda: adapters(engine))
        s = engine.cache_stats()
        print(f"overall: {s.prompt_tokens} prompt tokens, {s.cached_tokens} served from the radix cache "
              f"(hit rate {s.hit_rate:.1%}; {s.disk_hit_tokens} loaded from the disk tier in {s.disk_load_s:.2f} s), "
              f"{s.nodes} tree nodes, {s.generated_tokens} tokens generated")
