"""`radix-backend bench spec`: speculative decoding on and off, side by side, on repetitive and
open-ended work built from real text.

Workloads (each a few chat prompts):
- code-edit: a real function of Python's standard library, to repeat with one variable renamed;
- rag-quote: a ShareGPT answer as the retrieved passage, to quote verbatim;
- tool-loop: a chat whose tool call returned a JSON listing (the standard library's own files),
  to repeat for the user;
- json-reemit: a ShareGPT conversation as a JSON record, to re-emit with one field changed;
- open-chat: ShareGPT questions (drafts rarely match: the adaptive sizing should cost nothing).

Each prompt's KV is cached first (a 1-token run), so the timed runs measure decoding. Batch 1 runs
the prompts one after another, batch 8 all at once; each run starts from a flushed cache (so drafts
never come from another run's answers), the modes alternate, the fastest run of each counts, and
every run's outputs must be identical. With `--llamacpp`,
llama-cpp-python's prompt-lookup decoding (its `LlamaPromptLookupDecoding`) runs the same token
ids at batch 1 in the llama.cpp peer venv, on and off.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from radix_backend import Engine, SamplingParams
from radix_backend.bench.peer_drivers.driver_protocol import cpu_model
from radix_backend.bench.workloads import load_sharegpt_conversations

WORKLOADS = ("code-edit", "rag-quote", "tool-loop", "json-reemit", "open-chat")
LLAMACPP_PYTHON = Path(".peers/llamacpp/bin/python")
DRIVER = Path(__file__).parent / "peer_drivers" / "run_llamacpp_spec.py"


def _stdlib_functions(n: int) -> list[str]:
    """Functions of 12-40 lines from a fixed list of standard-library modules."""
    import difflib
    import shlex
    import textwrap
    from json import decoder, encoder

    found = []
    for module in (textwrap, shlex, difflib, decoder, encoder):
        for _, fn in sorted(inspect.getmembers(module, inspect.isfunction)):
            if fn.__module__ == module.__name__ and 12 <= len(inspect.getsource(fn).splitlines()) <= 40:
                found.append(fn)
    return [inspect.getsource(fn) for fn in found[:n]]


def _first_argument(source: str) -> str:
    head = source[source.index("(") + 1:source.index(")")]
    return head.split(",")[0].split("=")[0].split(":")[0].strip() or "value"


def build_messages(workload: str, n: int) -> list[list[dict[str, str]]]:
    """`n` chats (OpenAI messages) of one workload."""
    if workload == "code-edit":
        return [[{"role": "user", "content": f"Here is a Python function:\n\n```python\n{src}```\n\nRename the variable "
                  f"`{_first_argument(src)}` to `{_first_argument(src)}_in` everywhere and output the whole "
                  "function, otherwise unchanged."}] for src in _stdlib_functions(n)]
    if workload == "rag-quote":
        convs = load_sharegpt_conversations(4 * n, max_turns=2, max_message_chars=1200, seed=1)
        passages = [m["content"] for c in convs for m in c if m["role"] == "assistant" and len(m["content"]) > 400][:n]
        return [[{"role": "user", "content": f"Passage:\n{p}\n\nQuote the first three sentences of the passage word "
                  "for word."}] for p in passages]
    if workload == "tool-loop":
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in stdlib.glob("*.py"))
        chats = []
        for i in range(n):
            listing = [{"name": p.name, "bytes": p.stat().st_size} for p in files[12 * i:12 * i + 12]]
            chats.append([
                {"role": "user", "content": f"List the files of batch {i} of the standard library."},
                {"role": "assistant", "content": f'{{"tool": "list_files", "arguments": {{"batch": {i}}}}}'},
                {"role": "user", "content": "Tool result: " + json.dumps(listing)},
                {"role": "user", "content": "Show me that tool result again exactly as it was returned."}])
        return chats
    if workload == "json-reemit":
        convs = load_sharegpt_conversations(n, max_turns=2, max_message_chars=300, seed=2)
        return [[{"role": "user", "content": "Re-emit this JSON record with \"id\" set to \"copy-" + str(i) + "\" and "
                  "every other field unchanged:\n" + json.dumps({"id": f"conv-{i}", "turns": c}, indent=1)}]
                for i, c in enumerate(convs)]
    if workload == "open-chat":
        convs = load_sharegpt_conversations(n, max_turns=1, max_message_chars=600, seed=3)
        return [c[:1] for c in convs]
    raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")


@dataclass
class ModeResult:
    seconds: float
    tokens: int
    accepted: int
    drafted: int
    steps: int  # forward steps (a request's step gives 1 + its accepted draft tokens)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def run_mode(engine: Engine, prompts: list[list[int]], batch: int, max_new_tokens: int,
             speculative: bool) -> tuple[ModeResult, list[list[int]]]:
    """Decode `prompts` (their KV cached first) in waves of `batch`; returns timing and token ids."""
    engine.scheduler.set_speculative(speculative)
    if not engine.flush_cache():
        raise RuntimeError("the cache could not be flushed (requests still running)")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
    before = engine.cache_stats()
    seconds, outputs = 0.0, []
    for i in range(0, len(prompts), batch):
        wave = prompts[i:i + batch]
        engine.generate(input_ids=wave, params=SamplingParams(max_new_tokens=1, temperature=0))  # cache the prompts
        start = time.perf_counter()
        outs = engine.generate(input_ids=wave, params=params)
        seconds += time.perf_counter() - start
        outputs.extend(list(o.token_ids) for o in outs)
    after = engine.cache_stats()
    return ModeResult(seconds, sum(len(o) for o in outputs), after.spec_accepted_tokens - before.spec_accepted_tokens,
                      after.spec_draft_tokens - before.spec_draft_tokens,
                      after.forward_steps - before.forward_steps), outputs


def best_of(runs: list[tuple[ModeResult, list[list[int]]]]) -> tuple[ModeResult, bool]:
    """The fastest run (a shared machine's noise only ever adds time) and whether all gave the same tokens."""
    return min((r for r, _ in runs), key=lambda r: r.seconds), all(ids == runs[0][1] for _, ids in runs)


def run(engine: Engine, *, workloads: tuple[str, ...] = WORKLOADS, prompts_per_workload: int = 8,
        batches: tuple[int, ...] = (1, 8), max_new_tokens: int = 128, repeats: int = 2) -> dict[str, Any]:
    tok = engine.tokenizer
    report: dict[str, Any] = {"cpu": cpu_model(), "model": engine.model_id, "kernel_path": str(engine.kernel_path),
                              "max_new_tokens": max_new_tokens, "date": time.strftime("%Y-%m-%d"), "repeats": repeats,
                              "rows": [],
                              "prompts": {}}
    engine.generate("warm up", SamplingParams(max_new_tokens=4))
    own_setting = engine.scheduler.set_speculative(engine.scheduler.speculative)
    for name in workloads:
        prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
                   for m in build_messages(name, prompts_per_workload)]
        prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]  # a BatchEncoding or ids
        report["prompts"][name] = prompts
        for batch in batches:
            runs: dict[bool, list] = {False: [], True: []}
            for _ in range(repeats):  # alternating, so a slow spell of the machine hits both modes
                for speculative in (False, True):
                    runs[speculative].append(run_mode(engine, prompts, batch, max_new_tokens, speculative))
            (plain, plain_same), (spec, spec_same) = best_of(runs[False]), best_of(runs[True])
            row = {"workload": name, "batch": batch, "plain": asdict(plain), "spec": asdict(spec),
                   "speedup": spec.tok_s / plain.tok_s,
                   "identical": plain_same and spec_same and runs[False][0][1] == runs[True][0][1],
                   "acceptance": spec.accepted / spec.drafted if spec.drafted else 0.0}
            report["rows"].append(row)
            print(f"[spec] {name} b{batch}: plain {plain.tok_s:.1f} tok/s, spec {spec.tok_s:.1f} tok/s "
                  f"({row['speedup']:.2f}x), accepted {spec.accepted}/{spec.drafted}, identical {row['identical']}",
                  file=sys.stderr, flush=True)
    engine.scheduler.set_speculative(own_setting)
    return report


def run_llamacpp(report: dict[str, Any], model_gguf: str, context_tokens: int) -> dict[str, Any]:
    """llama-cpp-python at batch 1, prompt lookup off and on, on the same token ids (its own venv)."""
    if not LLAMACPP_PYTHON.exists():
        raise FileNotFoundError(f"{LLAMACPP_PYTHON} is missing: run scripts/setup_peer_llamacpp.sh")
    with tempfile.TemporaryDirectory() as tmp:
        plan, result = Path(tmp, "plan.json"), Path(tmp, "result.json")
        plan.write_text(json.dumps({"model_gguf": model_gguf, "context_tokens": context_tokens,
                                    "max_new_tokens": report["max_new_tokens"], "workloads": report["prompts"]}))
        subprocess.run([str(LLAMACPP_PYTHON.absolute()), str(DRIVER), str(plan), str(result)], check=True,
                       cwd=DRIVER.parent, env={**os.environ, "PYTHONPATH": ""})
        return json.loads(result.read_text())


def format_report(report: dict[str, Any]) -> str:
    lines = [f"CPU: {report['cpu']}; model: {report['model']}; {report['max_new_tokens']} new tokens, greedy; "
             f"best of {report['repeats']} runs per mode; {report['date']}", "",
             "| workload | batch | plain tok/s | speculative tok/s | speedup | accepted / drafted | tokens per step "
             "| identical |", "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        s = r["spec"]
        lines.append(f"| {r['workload']} | {r['batch']} | {r['plain']['tokens'] / r['plain']['seconds']:.1f} | "
                     f"{s['tokens'] / s['seconds']:.1f} | {r['speedup']:.2f}x | {s['accepted']} / {s['drafted']} | "
                     f"{s['tokens'] / max(1, s['tokens'] - s['accepted']):.2f} | {'yes' if r['identical'] else 'NO'} |")
    peer = report.get("llamacpp")
    if peer:
        lines += ["", f"llama.cpp ({peer['version']}), batch 1, prompt lookup (LlamaPromptLookupDecoding, "
                  f"{peer['num_pred_tokens']} tokens):", "",
                  "| workload | llama.cpp tok/s | with lookup tok/s | its speedup | radix speculative / llama.cpp lookup |",
                  "|---|---|---|---|---|"]
        ours = {r["workload"]: r for r in report["rows"] if r["batch"] == 1}
        for name, w in peer["workloads"].items():
            radix = ours[name]["spec"]["tokens"] / ours[name]["spec"]["seconds"] if name in ours else float("nan")
            lines.append(f"| {name} | {w['plain_tok_s']:.1f} | {w['lookup_tok_s']:.1f} | "
                         f"{w['lookup_tok_s'] / w['plain_tok_s']:.2f}x | {radix / w['lookup_tok_s']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode; the fastest counts")
    parser.add_argument("--llamacpp", action="store_true", help="also run llama-cpp-python's prompt lookup "
                        "(needs .peers/llamacpp and a GGUF model)")
    parser.add_argument("--json", default=None, help="write the full report here")
    args = parser.parse_args(argv)
    with Engine(args.model) as engine:
        report = run(engine, workloads=tuple(args.workloads.split(",")), prompts_per_workload=args.prompts,
                     batches=tuple(int(b) for b in args.batches.split(",")), max_new_tokens=args.max_new_tokens,
                     repeats=args.repeats)
        gguf = str(engine.checkpoint.path) if engine.checkpoint.gguf is not None else None
        context = engine.context_length
    if args.llamacpp:
        if gguf is None:
            raise SystemExit("--llamacpp needs a GGUF model")
        longest = max(len(p) for prompts in report["prompts"].values() for p in prompts)
        report["llamacpp"] = run_llamacpp(report, gguf, min(context, longest + args.max_new_tokens + 16))
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps({k: v for k, v in report.items() if k != "prompts"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
