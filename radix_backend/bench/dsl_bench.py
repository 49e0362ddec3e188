"""DSL benchmark: the same DSL programs on the engine vs run naively with HF transformers.

Workloads (CPU-sized by default):
- few_shot: a batch of questions after a shared few-shot header (`run_batch`); run with and
  without `cache_prefix` (the traced constant prefix submitted first),
- branching: fork/join — each item forks into several angles on one shared context, then
  `select`s the best (fork prefix computed once, branches as one batch),
- json: extraction with a JSON schema (constrained decoding; jump-forward in the engine).

"naive" runs the very same programs through `NaiveHFBackend`: every gen is a fresh
`transformers` `generate` call (no KV reuse across calls, no batching, the same llguidance
constraint as a logits processor) and every select a full forward per choice. Everything is
greedy, so both sides should produce the same text; `agreement` reports the fraction that did.

`run(...) -> dict` is what `radix-backend bench dsl` calls; `python -m radix_backend.bench.dsl_bench`.
(A leaf module: it sits in radix_backend.bench but drives radix_backend.lang; nothing in the
core imports it.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import radix_backend.lang as sgl
from radix_backend.lang import BaseBackend

from ..model_executor.loader import hf_directory
from ..outputs import ChoiceScore, GenerateOutput, RequestMeta
from ..sampling_params import SamplingParams

FEW_SHOT = [("What is the capital of Italy?", "Rome"), ("How many legs does a spider have?", "Eight"),
            ("What color is the sky on a clear day?", "Blue"), ("What is the largest planet?", "Jupiter"),
            ("What do bees make?", "Honey"), ("What is frozen water called?", "Ice")]
QUESTIONS = ["What is the capital of France?", "How many days are in a week?", "Which animal barks?",
             "What is the opposite of hot?", "What gas do plants breathe in?", "What is 3 plus 4?",
             "Which ocean is the largest?", "What color are bananas?", "What is the capital of Japan?",
             "How many wheels does a bicycle have?", "What do cows drink?", "Which star is closest to Earth?"]
TOPICS = ["a city park", "a rainy day", "learning to cook", "a long train journey", "a new bicycle", "a garden"]
ANGLES = ["the history", "the costs", "the people", "the best time", "the risks", "the future"]
PEOPLE = [("Maria Lopez", 34, "Lisbon", "engineer"), ("Kenji Sato", 27, "Osaka", "teacher"),
          ("Ruth Miller", 81, "Denver", "retired nurse"), ("Omar Haddad", 45, "Beirut", "chef"),
          ("Lena Vogel", 22, "Berlin", "student"), ("Tom Baker", 58, "Leeds", "baker")]
PERSON_SCHEMA = {"type": "object",
                 "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"},
                                "city": {"type": "string", "maxLength": 20}, "job": {"type": "string", "maxLength": 24}},
                 "required": ["name", "age", "city", "job"], "additionalProperties": False}


def _programs() -> dict[str, Any]:
    @sgl.function
    def few_shot(s, question):
        s += "Answer each question with one word.\n\n"
        for q, a in FEW_SHOT:
            s += f"Q: {q}\nA: {a}\n\n"
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=8, stop="\n")

    @sgl.function
    def branching(s, topic, num_branches):
        s += sgl.system("You write short, plain notes for a travel and lifestyle magazine.")
        s += sgl.user(f"We are planning an article about {topic}. Describe it in two sentences.")
        s += sgl.assistant(sgl.gen("intro", max_tokens=24))
        forks = s.fork(num_branches)
        forks += lambda i: sgl.user(f"Write one sentence about {ANGLES[i % len(ANGLES)]}.")
        forks += sgl.assistant(sgl.gen("angle", max_tokens=16))
        forks.join()
        s += sgl.user("Which angle should lead the article? Reply with its number.")
        s += sgl.assistant(sgl.select("lead", [str(i + 1) for i in range(num_branches)]))

    @sgl.function
    def json_extract(s, bio):
        s += sgl.system("Extract the person described by the user as one JSON object.")
        s += sgl.user(bio)
        s += sgl.assistant(sgl.gen("person", max_tokens=64, json_schema=PERSON_SCHEMA))

    return {"few_shot": few_shot, "branching": branching, "json": json_extract}


def _workload_args(name: str, n: int, branches: int) -> list[dict[str, Any]]:
    if name == "few_shot":
        return [{"question": QUESTIONS[i % len(QUESTIONS)]} for i in range(n)]
    if name == "branching":
        return [{"topic": TOPICS[i % len(TOPICS)], "num_branches": branches} for i in range(n)]
    return [{"bio": f"{p[0]} is a {p[1]} year old {p[3]} who lives in {p[2]}."}
            for p in (PEOPLE[i % len(PEOPLE)] for i in range(n))]


class NaiveHFBackend(BaseBackend):
    """Each gen = one fresh HF `generate` call; each select = one full forward per choice.

    No KV cache survives a call and calls run one at a time: the cost of the same program
    without RadixAttention, batching or jump-forward.
    """

    def __init__(self, model_path: str, tokenizer: Any, eos_token_ids: list[int], chat_template: Any) -> None:
        from transformers import AutoModelForCausalLM

        from ..scheduler.constrained import ConstraintCompiler

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = self.model.config.vocab_size
        self.compiler = ConstraintCompiler(tokenizer, self.vocab_size, eos_token_ids)
        self._chat_template = chat_template
        self.prompt_tokens = 0
        self.generated_tokens = 0

    def get_chat_template(self) -> Any:
        return self._chat_template

    def cache_prefix(self, prefix: str) -> None:
        """No cache to warm: the naive baseline recomputes every prompt."""

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, prompts: list[str], params: list[SamplingParams]) -> list[GenerateOutput]:
        return [self._generate_one(p, sp) for p, sp in zip(prompts, params)]

    def _generate_one(self, prompt: str, params: SamplingParams) -> GenerateOutput:
        from transformers import LogitsProcessorList

        ids = self._encode(prompt)
        self.prompt_tokens += len(ids)
        if params.max_new_tokens == 0:
            return GenerateOutput("", [], "length", RequestMeta(prompt_tokens=len(ids)))
        if not params.is_greedy:
            raise ValueError("the naive baseline runs greedy programs only (temperature=0)")
        constraint = self.compiler.compile(params)
        processors = LogitsProcessorList([_GrammarProcessor(constraint, len(ids), self.compiler, self.eos_token_ids)]
                                         if constraint is not None else [])
        with torch.no_grad():
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=params.max_new_tokens, do_sample=False,
                                      eos_token_id=self.eos_token_ids, pad_token_id=self.eos_token_ids[0],
                                      logits_processor=processors, stop_strings=params.stop or None,
                                      tokenizer=self.tokenizer)
        new = out[0, len(ids):].tolist()
        self.generated_tokens += len(new)
        finish = "length"
        if new and new[-1] in self.eos_token_ids:
            new, finish = new[:-1], "stop"
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        for stop in params.stop:
            if stop in text:
                text, finish = text[: text.index(stop)], "stop"
        return GenerateOutput(text, new, finish, RequestMeta(prompt_tokens=len(ids), completion_tokens=len(new)))  # type: ignore[arg-type]

    def score(self, prefix: str, continuations: list[str], *, unconditional: bool = False) -> list[ChoiceScore]:
        p_ids = self._encode(prefix)
        scores = []
        for c in continuations:
            full = self._encode(prefix + c)
            start = 0
            while start < min(len(p_ids), len(full)) and p_ids[start] == full[start]:
                start += 1
            start = max(start, 1)
            self.prompt_tokens += len(full)
            with torch.no_grad():
                logp = torch.log_softmax(self.model(torch.tensor([full])).logits[0].float(), dim=-1)
            lps = [logp[i - 1, full[i]].item() for i in range(start, len(full))]
            scores.append(ChoiceScore(c, full[start:], lps))
        return scores


class _GrammarProcessor:
    """HF logits processor applying an llguidance constraint (the engine's, minus jump-forward)."""

    def __init__(self, constraint: Any, prompt_len: int, compiler: Any, eos_token_ids: list[int]) -> None:
        self.constraint, self.prompt_len, self.eos = constraint, prompt_len, eos_token_ids
        self.bitmask = compiler.allocate_bitmask(1)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        from ..scheduler.constrained import bitmask_to_bool

        if input_ids.shape[1] > self.prompt_len:
            self.constraint.advance(int(input_ids[0, -1]))
        if self.constraint.is_finished():
            forced = torch.full_like(scores, float("-inf"))
            forced[:, self.eos[0]] = 0.0
            return forced
        self.constraint.fill_bitmask(self.bitmask, 0)
        allowed = bitmask_to_bool(self.bitmask, scores.shape[1])
        return scores.masked_fill(~allowed, float("-inf"))


def _texts(states: list[Any]) -> list[str]:
    return [s.text() for s in states]


def _timed(fn: Callable[[], list[Any]]) -> tuple[list[Any], float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run(model: str | None = None, *, engine: Any = None, workloads: tuple[str, ...] = ("few_shot", "branching", "json"),
        num_items: int = 6, num_branches: int = 3, naive: bool = True, progress: bool = False) -> dict[str, Any]:
    """Time each workload on the engine (DSL) and naively (HF, no reuse); returns a JSON-able dict."""
    from ..engine import Engine

    unknown = [w for w in workloads if w not in ("few_shot", "branching", "json")]
    if unknown:
        raise ValueError(f"unknown workload(s) {unknown}; choose from few_shot, branching, json")
    own_engine = engine is None
    engine = engine or Engine(model)
    try:
        backend = sgl.RadixEngineBackend(engine)
        programs = _programs()
        naive_backend = None
        if naive:
            naive_backend = NaiveHFBackend(str(hf_directory(engine.checkpoint)), engine.tokenizer, sorted(engine.eos_token_ids),
                                           backend.get_chat_template())
        # warm-up: weights, grammar compile caches (not timed)
        programs["json"].run(**_workload_args("json", 1, num_branches)[0], temperature=0, backend=backend)
        results: dict[str, Any] = {"model": str(model or "embedded SmolLM2-135M-Instruct"), "num_items": num_items,
                                   "workloads": {}}
        for name in workloads:
            prog, args = programs[name], _workload_args(name, num_items, num_branches)
            row: dict[str, Any] = {}
            variants = [("dsl", True)] + ([("dsl_no_cache_prefix", False)] if name == "few_shot" else [])
            for label, cache_prefix in variants:
                engine.flush_cache()
                before = engine.cache_stats()
                states, secs = _timed(lambda: prog.run_batch(args, temperature=0, backend=backend,
                                                             cache_prefix=cache_prefix, progress_bar=progress))
                after = engine.cache_stats()
                prompt = after.prompt_tokens - before.prompt_tokens
                cached = after.cached_tokens - before.cached_tokens
                row[label] = {"seconds": secs, "prompt_tokens": prompt, "cached_tokens": cached,
                              "computed_prompt_tokens": prompt - cached,
                              "forward_steps": after.forward_steps - before.forward_steps}
                if label == "dsl":
                    dsl_texts = _texts(states)
            if naive_backend is not None:
                naive_backend.prompt_tokens = 0
                states, secs = _timed(lambda: prog.run_batch(args, temperature=0, backend=naive_backend,
                                                             cache_prefix=False, num_threads=1))
                naive_texts = _texts(states)
                row["naive_hf"] = {"seconds": secs, "computed_prompt_tokens": naive_backend.prompt_tokens}
                row["speedup"] = secs / row["dsl"]["seconds"]
                row["agreement"] = sum(a == b for a, b in zip(dsl_texts, naive_texts)) / len(args)
            if "dsl_no_cache_prefix" in row:
                row["cache_prefix_speedup"] = row["dsl_no_cache_prefix"]["seconds"] / row["dsl"]["seconds"]
            results["workloads"][name] = row
        return results
    finally:
        if own_engine:
            engine.shutdown()


def format_report(result: dict[str, Any]) -> str:
    lines = [f"DSL benchmark on {result['model']}, {result['num_items']} programs per workload",
             f"{'workload':<10} {'variant':<20} {'seconds':>8} {'computed prompt tok':>20} {'cached tok':>11}"]
    for name, row in result["workloads"].items():
        for label in ("dsl", "dsl_no_cache_prefix", "naive_hf"):
            if label in row:
                r = row[label]
                lines.append(f"{name:<10} {label:<20} {r['seconds']:8.2f} {r['computed_prompt_tokens']:20d} "
                             f"{r.get('cached_tokens', 0):11d}")
        extras = [f"{k}={row[k]:.2f}x" for k in ("speedup", "cache_prefix_speedup") if k in row]
        if "agreement" in row:
            extras.append(f"same text as naive: {row['agreement']:.0%}")
        lines.append(f"{'':<10} " + ", ".join(extras))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="DSL programs on the engine vs naive HF transformers calls")
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-items", type=int, default=6)
    ap.add_argument("--num-branches", type=int, default=3)
    ap.add_argument("--workloads", default="few_shot,branching,json")
    ap.add_argument("--no-naive", action="store_true", help="skip the HF baseline")
    ap.add_argument("--json", action="store_true", help="print the result dict as JSON")
    args = ap.parse_args(argv)
    result = run(args.model, workloads=tuple(args.workloads.split(",")), num_items=args.num_items,
                 num_branches=args.num_branches, naive=not args.no_naive, progress=False)
    print(json.dumps(result, indent=2) if args.json else format_report(result))


if __name__ == "__main__":
    main(sys.argv[1:])
