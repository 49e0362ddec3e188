"""`radix-backend bench few-shot|multi-turn|branching|floor|all`: the engine against the baseline a
user has today (Hugging Face transformers `generate`, one call per prompt, no reuse), side by side
in one process, plus this machine's compute floor for the model.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..engine import Engine
from ..model_executor.loader import hf_directory
from ..sampling_params import SamplingParams
from . import workloads as wl

WORKLOADS = ("few-shot", "multi-turn", "branching")


@dataclass
class RunResult:
    system: str
    wall_s: float
    prompt_tokens: int
    computed_prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s


def build_workload(name: str, engine: wl.Encoder, quick: bool = False) -> wl.Workload:
    count = lambda text: len(engine.encode(text))  # noqa: E731
    if name == "few-shot":
        return wl.few_shot(count, num_questions=8 if quick else 32, prefix_tokens=300 if quick else 1000)
    if name == "multi-turn":
        return wl.multi_turn(num_conversations=4 if quick else 16, turns=2 if quick else 4)
    if name == "branching":
        return wl.branching(num_transcripts=4 if quick else 16)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def run_engine(engine: Engine, workload: wl.Workload) -> tuple[RunResult, list[list[int]]]:
    """Each wave goes to the engine as one batch, as a client sending independent calls would."""
    assert engine.flush_cache(), "engine busy"
    before = engine.cache_stats()
    params = SamplingParams(max_new_tokens=workload.max_new_tokens, temperature=0)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for wave in workload.waves:
        outputs.extend(o.token_ids for o in engine.generate(messages=wave, params=params))
    wall = time.perf_counter() - start
    after = engine.cache_stats()
    prompt = after.prompt_tokens - before.prompt_tokens
    cached = after.cached_tokens - before.cached_tokens
    return RunResult("radix-backend", wall, prompt, prompt - cached, cached, sum(map(len, outputs))), outputs


def run_hf_baseline(model, engine: Engine, workload: wl.Workload) -> tuple[RunResult, list[list[int]]]:
    prompts = [engine.encode(engine.apply_chat_template(call)) for call in workload.calls]
    eos = sorted(engine.eos_token_ids)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=workload.max_new_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0])
            outputs.append(out[0, len(ids):].tolist())
    wall = time.perf_counter() - start
    total = sum(map(len, prompts))
    return RunResult("hf-transformers", wall, total, total, 0, sum(map(len, outputs))), outputs


def compare(engine: Engine, hf_model, name: str, quick: bool = False) -> dict[str, Any]:
    workload = build_workload(name, engine, quick)
    prompts = [engine.encode(engine.apply_chat_template(c)) for c in workload.calls]
    total = sum(map(len, prompts))
    ideal_hit = 1 - wl.unique_prefix_tokens(prompts) / total
    ours, our_out = run_engine(engine, workload)
    base, base_out = run_hf_baseline(hf_model, engine, workload)
    same = sum(_same_until_eos(a, b, engine.eos_token_ids) for a, b in zip(our_out, base_out))
    return {
        "workload": name, "calls": len(prompts), "prompt_tokens": total,
        "engine": asdict(ours) | {"tokens_per_s": ours.tokens_per_s},
        "baseline": asdict(base) | {"tokens_per_s": base.tokens_per_s},
        "speedup": base.wall_s / ours.wall_s,
        "hit_rate": ours.cached_prompt_tokens / max(1, ours.prompt_tokens),
        "ideal_hit_rate": ideal_hit,
        "greedy_outputs_equal": f"{same}/{len(prompts)}",
    }


def _same_until_eos(a: list[int], b: list[int], eos: frozenset[int]) -> bool:
    def cut(x: list[int]) -> list[int]:
        for i, t in enumerate(x):
            if t in eos:
                return x[:i + 1]
        return x
    return cut(a) == cut(b)


# ---- compute floor ----------------------------------------------------------------------------
def measure_floor(engine: Engine, prefill_tokens: int = 1024, context: int = 256,
                  batch_sizes: tuple[int, ...] = (1, 8, 32), steps: int = 8) -> dict[str, Any]:
    """Raw model forwards on the scheduler thread (no scheduling, sampling or detokenizing):
    prefill tokens/s of one long sequence, decode steps/s at several batch sizes."""
    from ..model_executor.model_runner import ForwardInput

    def floor() -> dict[str, Any]:
        runner, alloc = engine.runner, engine.scheduler.kv.allocator
        assert alloc.num_free >= max(prefill_tokens, max(batch_sizes) * (context + steps)), "KV pool too small"
        result: dict[str, Any] = {}
        slots = alloc.alloc(prefill_tokens)
        ids = list(range(100, 100 + prefill_tokens))
        fi = ForwardInput(ids, list(range(prefill_tokens)), [0], [prefill_tokens], slots, slots, [prefill_tokens - 1])
        runner.forward(fi)  # warm-up
        times = []
        for _ in range(3):
            t = time.perf_counter()
            runner.forward(fi)
            times.append(time.perf_counter() - t)
        result["prefill_tokens_per_s"] = prefill_tokens / statistics.median(times)
        alloc.free(slots)
        for b in batch_sizes:
            ctx = [alloc.alloc(context + steps) for _ in range(b)]
            t_steps = []
            for s in range(steps):
                pos = context + s
                kv = torch.cat([c[:pos + 1] for c in ctx])
                out = torch.stack([c[pos] for c in ctx])
                fi = ForwardInput([100] * b, [pos] * b, [pos] * b, [1] * b, kv, out, list(range(b)))
                t = time.perf_counter()
                runner.forward(fi)
                t_steps.append(time.perf_counter() - t)
            step = statistics.median(t_steps[1:])
            result[f"decode_b{b}_steps_per_s"] = 1 / step
            result[f"decode_b{b}_tokens_per_s"] = b / step
            for c in ctx:
                alloc.free(c)
        return result

    return engine.scheduler.call(floor, timeout=600)  # type: ignore[return-value]


def measure_engine_decode(engine: Engine, batch_sizes: tuple[int, ...] = (1, 8, 32), new_tokens: int = 32,
                          context: int = 256) -> dict[str, float]:
    """End-to-end decode tokens/s through the engine (scheduling, sampling, detokenizing included)."""
    out: dict[str, float] = {}
    for b in batch_sizes:
        filler = " ".join(f"word{j}" for j in range(context // 3))  # about `context` tokens, as in the floor
        prompts = [f"{i}: {filler}" for i in range(b)]
        engine.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0))  # prefill + warm cache
        t = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True))
        out[f"engine_b{b}_tokens_per_s"] = b * new_tokens / (time.perf_counter() - t)
    return out


def format_comparison(r: dict[str, Any]) -> str:
    e, b = r["engine"], r["baseline"]
    return "\n".join([
        f"== {r['workload']}: {r['calls']} calls, {r['prompt_tokens']} prompt tokens",
        f"  {'system':<16}{'wall s':>9}{'gen tok/s':>11}{'prompt computed':>17}{'from cache':>12}",
        f"  {'radix-backend':<16}{e['wall_s']:>9.2f}{e['tokens_per_s']:>11.1f}{e['computed_prompt_tokens']:>17}{e['cached_prompt_tokens']:>12}",
        f"  {'hf-transformers':<16}{b['wall_s']:>9.2f}{b['tokens_per_s']:>11.1f}{b['computed_prompt_tokens']:>17}{b['cached_prompt_tokens']:>12}",
        f"  speedup {r['speedup']:.2f}x | hit rate {r['hit_rate']:.1%} (ideal {r['ideal_hit_rate']:.1%}) | "
        f"greedy outputs equal {r['greedy_outputs_equal']}",
    ])


def format_floor(floor: dict[str, Any], engine_decode: dict[str, float]) -> str:
    lines = ["== compute floor (raw forwards) vs engine",
             f"  prefill: {floor['prefill_tokens_per_s']:.0f} tokens/s (one 1024-token forward)"]
    for key in sorted(k for k in floor if k.endswith("_tokens_per_s") and k.startswith("decode")):
        b = key.split("_")[1][1:]
        eng = engine_decode.get(f"engine_b{b}_tokens_per_s")
        extra = f" | engine {eng:.1f} tok/s ({eng / floor[key]:.0%} of floor)" if eng else ""
        lines.append(f"  decode batch {b:>2}: {floor[f'decode_b{b}_steps_per_s']:.1f} steps/s = {floor[key]:.1f} tok/s{extra}")
    if "engine_b1_tokens_per_s" in engine_decode and "engine_b32_tokens_per_s" in engine_decode:
        lines.append(f"  engine batch-32 / batch-1 decode throughput: "
                     f"{engine_decode['engine_b32_tokens_per_s'] / engine_decode['engine_b1_tokens_per_s']:.1f}x")
    return "\n".join(lines)


def run(names: list[str], model: str | None = None, quick: bool = False, kv_cache_tokens: int = 65536,
        printer=print) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    results: dict[str, Any] = {}
    with Engine(model, kv_cache_tokens=kv_cache_tokens) as engine:
        hf = None
        for name in names:
            if name == "floor":
                floor = measure_floor(engine, steps=4 if quick else 8)
                dec = measure_engine_decode(engine, new_tokens=8 if quick else 32)
                results["floor"] = floor | dec
                printer(format_floor(floor, dec))
                continue
            if hf is None:
                hf = AutoModelForCausalLM.from_pretrained(str(hf_directory(engine.checkpoint)), dtype=torch.float32).eval()
            results[name] = compare(engine, hf, name, quick)
            printer(format_comparison(results[name]))
    return results
