"""llama.cpp's prompt-cache file for `radix-backend bench restart`: one process, one call.

`python run_llamacpp_restart.py MODEL.gguf IDS.json CACHE_DIR` loads the GGUF with
`LlamaDiskCache(CACHE_DIR)` (llama-cpp-python's on-disk prompt cache: the saved context state of
earlier prompts) and times one 1-token completion of the prompt; prints one JSON line. Run it on
an empty directory (cold, which fills it), then again (restart). Runs in the llama.cpp venv.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    from llama_cpp import Llama, LlamaDiskCache

    gguf, ids_path, cache_dir = sys.argv[1:4]
    with open(ids_path) as f:
        ids = json.load(f)
    start = time.perf_counter()
    llm = Llama(model_path=gguf, n_ctx=len(ids) + 64, n_batch=512, n_threads=os.cpu_count(), verbose=False)
    llm.set_cache(LlamaDiskCache(cache_dir=cache_dir, capacity_bytes=8 << 30))
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    out = llm.create_completion(prompt=ids, max_tokens=1, temperature=0.0)
    ttft = time.perf_counter() - start
    print(json.dumps({"ttft_s": ttft, "load_s": load_s, "text": out["choices"][0]["text"]}))


if __name__ == "__main__":
    main()
