"""llama.cpp peer for `bench spec`: llama-cpp-python's prompt-lookup decoding off and on.

Each prompt (token ids from the plan) is evaluated first with a 1-token call, so the timed call
reuses its KV (llama.cpp keeps the live context) and measures decoding, as radix-backend's runs do.
Greedy. Run in the llama.cpp venv: `python run_llamacpp_spec.py PLAN.json RESULT.json`.
"""

from __future__ import annotations

import json
import os
import sys
import time

NUM_PRED_TOKENS = 10  # LlamaPromptLookupDecoding's default


def decode_rate(llm, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, list[str]]:
    seconds, tokens, texts = 0.0, 0, []
    for ids in prompts:
        llm.create_completion(prompt=ids, max_tokens=1, temperature=0.0)
        start = time.perf_counter()
        out = llm.create_completion(prompt=ids, max_tokens=max_new_tokens, temperature=0.0)
        seconds += time.perf_counter() - start
        tokens += out["usage"]["completion_tokens"]
        texts.append(out["choices"][0]["text"])
    return tokens / seconds, texts


def main() -> None:
    from llama_cpp import Llama, __version__
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    with open(sys.argv[1]) as handle:
        plan = json.load(handle)
    # a draft model needs every position's logits kept (llama-cpp-python's eval writes them per row)
    common = dict(model_path=plan["model_gguf"], n_ctx=plan["context_tokens"], n_batch=512,
                  n_threads=os.cpu_count(), logits_all=True, verbose=False)
    plain = Llama(**common)
    lookup = Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=NUM_PRED_TOKENS))
    result = {"version": f"llama-cpp-python {__version__}", "num_pred_tokens": NUM_PRED_TOKENS, "workloads": {}}
    plain.create_completion(prompt="warm up", max_tokens=4)
    lookup.create_completion(prompt="warm up", max_tokens=4)
    for name, prompts in plan["workloads"].items():
        plain_rate, plain_texts = decode_rate(plain, prompts, plan["max_new_tokens"])
        lookup_rate, lookup_texts = decode_rate(lookup, prompts, plan["max_new_tokens"])
        result["workloads"][name] = {"plain_tok_s": plain_rate, "lookup_tok_s": lookup_rate,
                                     "identical": plain_texts == lookup_texts}
        print(f"[llama.cpp] {name}: {plain_rate:.1f} -> {lookup_rate:.1f} tok/s", file=sys.stderr, flush=True)
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
