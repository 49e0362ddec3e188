"""`radix-backend bench restart`: time to first token after a process restart, with the disk KV
tier against cold prefill, and llama.cpp's prompt-cache file (LlamaDiskCache) when its venv exists.

Every measurement is its own process (a real restart: nothing in memory), on the same prompt
token ids. Per prompt length:
- radix cold: a fresh engine without the disk tier computes the prompt;
- radix write: a fresh engine with an empty disk directory (the cold run that fills it);
- radix restart: a new process on that directory;
- llama.cpp cold / restart: the same with `LlamaDiskCache` on an empty, then a filled directory.
TTFT = the call with max_new_tokens=1, after the model is loaded (load time is reported apart).
The files are fresh in the OS page cache, as they are when an app restarts soon after its last run.
Run: `radix-backend bench restart [--lengths 2000,8000] [--json OUT]`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PEER_SCRIPT = Path(__file__).parent / "peer_drivers" / "run_llamacpp_restart.py"
LLAMACPP_PYTHON = Path(".peers") / "llamacpp" / "bin" / "python"


def document_ids(tokenizer: Any, n_tokens: int) -> list[int]:
    """`n_tokens` ids of a long record-keeping document (distinct lines, so nothing repeats)."""
    lines, ids = [], []
    i = 0
    while len(ids) < n_tokens:
        lines.extend(f"Entry {j}: shipment {j * 37 % 1009} left dock {j % 17} carrying {j * 13 % 97} crates."
                     for j in range(i, i + 200))
        i += 200
        ids = tokenizer.encode("\n".join(lines))
    return ids[:n_tokens]


def child(args: argparse.Namespace) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    from ..engine import Engine
    from ..sampling_params import SamplingParams

    ids = json.loads(Path(args.ids).read_text())
    start = time.perf_counter()
    engine = Engine(args.model, disk_cache_dir=args.disk or None, kv_cache_tokens=len(ids) + 1024)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    out = engine.generate(input_ids=ids, params=SamplingParams(max_new_tokens=1, temperature=0.0))
    ttft = time.perf_counter() - start
    stats = engine.cache_stats()
    engine.shutdown()  # lands the queued block writes
    print(json.dumps({"ttft_s": ttft, "load_s": load_s, "cached_tokens": out.meta.cached_tokens,
                      "disk_hit_tokens": stats.disk_hit_tokens, "disk_load_s": stats.disk_load_s,
                      "token": out.token_ids, "weights": engine.runner.quantization.mode}))


def _run(cmd: list[str]) -> dict[str, Any]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])}... failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(model: str | None, lengths: list[int], llamacpp_python: Path | None) -> dict[str, Any]:
    from ..model_executor.loader import embedded_gguf_path, load_tokenizer, resolve_checkpoint

    checkpoint = resolve_checkpoint(model)
    tokenizer = load_tokenizer(checkpoint)
    if model is None:
        gguf: Path | None = embedded_gguf_path()
    else:
        gguf = Path(model) if model.lower().endswith(".gguf") else None  # llama.cpp loads GGUF files only
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in lengths:
            ids_path = Path(tmp) / f"ids{n}.json"
            ids_path.write_text(json.dumps(document_ids(tokenizer, n)))
            me = [sys.executable, "-m", "radix_backend.bench.restart_bench", "--child", "--ids", str(ids_path)]
            me += ["--model", model] if model else []
            disk = str(Path(tmp) / f"disk{n}")
            row: dict[str, Any] = {"prompt_tokens": n,
                                   "radix_cold": _run(me + ["--disk", ""]),
                                   "radix_write": _run(me + ["--disk", disk]),
                                   "radix_restart": _run(me + ["--disk", disk])}
            if llamacpp_python is not None and gguf is not None:
                cache = str(Path(tmp) / f"llamacpp{n}")
                peer = [str(llamacpp_python), str(PEER_SCRIPT), str(gguf), str(ids_path), cache]
                row["llamacpp_cold"] = _run(peer)
                row["llamacpp_restart"] = _run(peer)
            rows.append(row)
    from .peer_drivers.driver_protocol import cpu_model

    return {"cpu": cpu_model(), "rows": rows}


def format_table(result: dict[str, Any]) -> str:
    lines = ["| prompt tokens | radix cold TTFT s | radix restart TTFT s (disk tier) | speedup | tokens from disk "
             "| llama.cpp cold s | llama.cpp restart s (prompt-cache file) | speedup |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        cold, warm = r["radix_cold"]["ttft_s"], r["radix_restart"]["ttft_s"]
        line = (f"| {r['prompt_tokens']:,} | {cold:.2f} | {warm:.3f} | {cold / warm:.1f}x | "
                f"{r['radix_restart']['disk_hit_tokens']:,} |")
        if "llamacpp_cold" in r:
            lc, lw = r["llamacpp_cold"]["ttft_s"], r["llamacpp_restart"]["ttft_s"]
            line += f" {lc:.2f} | {lw:.3f} | {lc / lw:.1f}x |"
        else:
            line += " n/a | n/a | |"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--lengths", default="2000,8000", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--json", default=None, help="also write the raw results to this file")
    parser.add_argument("--llamacpp-python", default=str(LLAMACPP_PYTHON),
                        help="python of the llama.cpp venv (skipped when missing)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    parser.add_argument("--disk", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    peer = Path(args.llamacpp_python)
    if not peer.exists():
        print(f"llama.cpp skipped: {peer} not found (bash scripts/setup_peer_llamacpp.sh installs it)")
    result = measure(args.model, [int(x) for x in args.lengths.split(",")], peer if peer.exists() else None)
    print(f"CPU: {result['cpu']}\n{format_table(result)}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
