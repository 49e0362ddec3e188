"""One prepared GPU check (~3 min on one H200): `python -m radix_backend.bench.gpu_check`.

1. correctness: Triton and FlashInfer attention backends (decode, extend, cascade) and the Triton
   fused ops against the torch reference (computed in fp32 from the same inputs) on random ragged
   batches, fp32 and bf16; the CUDA-graph decode runner against eager; with `--hf-greedy`, every
   backend's greedy tokens against HF transformers on the same GPU, per model (fp32 exact);
2. kernel timing with CUDA events (median of many runs; each timed call is replayed from a CUDA
   graph when the backend allows it, so Python launch overhead is not counted): decode at batch
   1/32/128 and context 512/4k, an extend over a cached prefix and a prefill, for triton,
   flashinfer, the torch backend and dense SDPA (no paging, a lower bound);
3. end to end: the few-shot, multi-turn and branching workloads through
   `radix_backend.Engine(attention_backend=...)` for every backend and every model of `--models`
   (the embedded SmolLM2 by default; `--random-model DIR` adds a random-weight 0.5B Llama);
4. with `--invariance`, batch invariance per backend and dtype on SmolLM2: each request's logits
   at every step alone on a cold cache against inside a mixed batch (bench.invariance); a check
   for `triton-inv` (Triton with batch invariance), reported for the others;
5. a sweep of Triton launch configs (decode splits / tiles, extend tiles / stages) on the widest
   decode and the extend shape, to tune the defaults;
then prints a short table (last) and writes `gpu_check.json` into the folder given by `--out`
after every section.

Every section is guarded: a failure is recorded in the report and the next section still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from radix_backend.kernels.attention_base import ScoreMask

# Targets: Triton time / FlashInfer time per kernel call.
TARGETS = {"decode": 1.3, "extend": 1.5}


@dataclass
class AttnShape:
    """One attention workload: per-request prefix and new-token counts, heads, head dim."""

    name: str
    prefix_lens: list[int]
    extend_lens: list[int]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def kind(self) -> str:
        return "decode" if all(e == 1 for e in self.extend_lens) else "extend"


def bench_shapes(quick: bool = False) -> list[AttnShape]:
    """Decode at batch 1/32/128 and context 512/4k on a Llama-3-8B-like layer (32 q / 8 kv heads,
    d 128), one SmolLM2 layer (9 / 3, d 64), an extend over a cached prefix and a plain prefill."""
    grid = [(2, 128), (8, 512)] if quick else [(b, ctx) for ctx in (512, 4096) for b in (1, 32, 128)]
    b_small, ctx_small = (8, 512) if quick else (32, 2048)
    b_ext, pre, ext = (2, 256, 128) if quick else (8, 1024, 512)
    decode = [AttnShape(f"decode b{b} ctx{ctx} 32/8x128", [ctx - 1] * b, [1] * b, 32, 8, 128) for b, ctx in grid]
    return decode + [
        AttnShape(f"decode b{b_small} ctx{ctx_small} 9/3x64", [ctx_small - 1] * b_small, [1] * b_small, 9, 3, 64),
        AttnShape(f"extend b{b_ext} pre{pre}+{ext} 32/8x128", [pre] * b_ext, [ext] * b_ext, 32, 8, 128),
        AttnShape(f"prefill b{b_ext // 2 or 1} {2 * ext} 32/8x128", [0] * (b_ext // 2 or 1),
                  [2 * ext] * (b_ext // 2 or 1), 32, 8, 128),
    ]


def sweep_shape(shapes: list[AttnShape], kind: str) -> AttnShape:
    """The shape whose Triton launch configs are swept: the widest batch of the kind (a decode
    sweep on batch 1 would only tune the split count for an idle GPU)."""
    return max((s for s in shapes if s.kind == kind), key=lambda s: (len(s.prefix_lens), s.prefix_lens[0]))


def correctness_shapes(quick: bool = False) -> list[AttnShape]:
    """Small ragged cases: prefix 0, GQA 1/3/4, head dims 64/128, decode and extend.

    `quick` shrinks lengths and heads so the section also runs on CPU under TRITON_INTERPRET=1
    (the tests run it that way)."""
    if quick:
        return [
            AttnShape("decode mha d64", [0, 17, 70], [1] * 3, 2, 2, 64),
            AttnShape("decode gqa4 d128", [5, 90], [1] * 2, 8, 2, 128),
            AttnShape("decode gqa3 d64", [40, 3], [1] * 2, 6, 2, 64),
            AttnShape("extend gqa4 d128", [0, 21], [7, 18], 4, 1, 128),
            AttnShape("extend gqa3 d64", [0, 33], [20, 5], 3, 1, 64),
        ]
    return [
        AttnShape("decode mha d64", [0, 17, 300, 1000], [1] * 4, 8, 8, 64),
        AttnShape("decode gqa4 d128", [5, 2047, 64, 511], [1] * 4, 32, 8, 128),
        AttnShape("decode gqa3 d64", [100, 3, 777], [1] * 3, 9, 3, 64),
        AttnShape("extend gqa4 d128", [0, 40, 300], [7, 129, 64], 32, 8, 128),
        AttnShape("extend gqa3 d64", [0, 0, 513], [1, 200, 33], 9, 3, 64),
    ]


def cascade_cases(quick: bool = False) -> list[tuple[AttnShape, int]]:
    """Forked batches (shape, shared prefix length) for FlashInfer's cascade path."""
    if quick:
        return [(AttnShape("cascade decode gqa4", [70, 80, 65, 90], [1] * 4, 4, 1, 64), 64),
                (AttnShape("cascade extend gqa4", [70, 80, 65, 90], [9, 1, 4, 3], 4, 1, 64), 64)]
    return [(AttnShape("cascade decode gqa4", [600, 700, 650, 900, 601], [1] * 5, 32, 8, 128), 512),
            (AttnShape("cascade extend gqa4", [600, 700, 650, 900], [9, 1, 40, 3], 32, 8, 128), 512)]


def make_batch(shape: AttnShape, dtype: torch.dtype, device: str, seed: int = 0, shared_prefix: int = 0,
               extra_slots: int = 64):
    """Random q/k/v and caches; sequences on shuffled slots >= 1 (slot 0 is the padding slot).

    With `shared_prefix` > 0 every request's first `shared_prefix` tokens use the same slots
    (a forked batch, what FlashInfer's cascade path is for).
    """
    from radix_backend.kernels.attention_base import AttentionMetadata
    g = torch.Generator().manual_seed(seed)
    # Values come from a generator on the target device: the 4k-context batches hold ~10^9 of them.
    g_dev = torch.Generator(device=device).manual_seed(seed)
    seq = [p + e for p, e in zip(shape.prefix_lens, shape.extend_lens)]
    if shared_prefix > min(shape.prefix_lens):
        raise ValueError("shared_prefix must not exceed the shortest prefix")
    own = sum(s - shared_prefix for s in seq)
    num_slots = shared_prefix + own + extra_slots
    perm = torch.randperm(num_slots - 1, generator=g) + 1
    shared, rest = perm[:shared_prefix], perm[shared_prefix:]
    kv, out, off = [], [], 0
    for p, s in zip(shape.prefix_lens, seq):
        slots = torch.cat([shared, rest[off: off + s - shared_prefix]])
        off += s - shared_prefix
        kv.append(slots)
        out.append(slots[p:])
    meta = AttentionMetadata.build(shape.prefix_lens, shape.extend_lens, torch.cat(kv).to(device),
                                   torch.cat(out).to(device), device)
    n, hq, hkv, d = sum(shape.extend_lens), shape.num_q_heads, shape.num_kv_heads, shape.head_dim

    def rnd(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=g_dev, device=device, dtype=dtype)
    return rnd(n, hq, d), rnd(n, hkv, d), rnd(n, hkv, d), rnd(num_slots, hkv, d), rnd(num_slots, hkv, d), meta


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


@dataclass
class Report:
    """Everything the run measured; serialised to JSON and summarised as a table."""

    device: str = ""
    started: str = ""
    correctness: list[dict[str, Any]] = field(default_factory=list)
    timings: list[dict[str, Any]] = field(default_factory=list)
    e2e: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    targets: list[dict[str, Any]] = field(default_factory=list)
    sweep: list[dict[str, Any]] = field(default_factory=list)
    invariance: list[dict[str, Any]] = field(default_factory=list)

    def guard(self, section: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # a broken section must not hide the others' results
            self.errors.append(f"{section}: {type(exc).__name__}: {exc}")
            traceback.print_exc()


# ----------------------------------------------------------------------------- backends

INVARIANT = "triton-inv"  # Triton with batch invariance: its invariant kernel and fixed-configuration matmuls


# Attention backend and batch invariance per backend name: torch stays the cuBLAS reference and
# triton the split-K fast path (no invariance); triton-inv and the CPU's native backend run with it.
# Other names pass through to the registry, which refuses unknown ones.
BACKENDS = {"torch": ("torch", False), "triton": ("triton", False), INVARIANT: ("triton", True),
            "flashinfer": ("flashinfer", False), "native": ("native", True)}


def engine_backend(name: str) -> dict[str, Any]:
    """The Engine arguments of a backend name."""
    attention, invariant = BACKENDS.get(name, (name, False))
    return dict(attention_backend=attention, batch_invariant=invariant)


def make_backend(name: str, device: str, **kw) -> Any:
    from radix_backend.kernels import create_attention_backend
    attention, invariant = BACKENDS.get(name, (name, False))
    return create_attention_backend(attention, device, batch_invariant=invariant, **kw)


def runs_in(name: str, dtype: str) -> bool:
    """FlashInfer has no fp32 kernels: it runs bf16 only."""
    return not (name == "flashinfer" and dtype == "float32")


def available_kernel_backends(device: str) -> list[str]:
    from radix_backend.kernels.registry import available_backends
    names = available_backends(device)
    return names + [INVARIANT] if "triton" in names else names


# ----------------------------------------------------------------------------- 1. correctness

def masked_cases(quick: bool = False) -> list[ScoreMask]:
    """Sliding windows (under and past a tile, shorter than the shapes' contexts) and Gemma 2's
    soft-capped scores, which the Triton backends run in their own kernel."""
    from radix_backend.kernels.attention_base import ScoreMask
    window = 24 if quick else 256
    return [ScoreMask(window=window), ScoreMask(window=window + 1, softcap=30.0), ScoreMask(softcap=2.0)]


def check_attention(report: Report, device: str, backends: list[str], quick: bool = False) -> None:
    from radix_backend.kernels.attention_base import PLAIN
    ref_backend = make_backend("torch", device)
    cascades = cascade_cases(quick)
    cases = [(s, 0, PLAIN) for s in correctness_shapes(quick)] + [(s, n, PLAIN) for s, n in cascades]
    masked = [(s, 0, mask) for s in correctness_shapes(quick) for mask in masked_cases(quick)]
    min_prefix = min(shared for _, shared in cascades) // 2
    for name in backends:
        if name == "torch":
            continue
        dtypes = [torch.bfloat16] if name == "flashinfer" else [torch.float32, torch.bfloat16]
        for dtype in dtypes:
            for i, (shape, shared, mask) in enumerate(cases + (masked if name.startswith("triton") else [])):
                kw = {"cascade_min_batch": 4, "cascade_min_prefix": min_prefix} if name == "flashinfer" else {}
                backend = make_backend(name, device, **kw)
                q, k, v, kc, vc, meta = make_batch(shape, dtype, device, seed=i, shared_prefix=shared)
                kc_ref, vc_ref = kc.clone(), vc.clone()
                ref_backend.store_kv(k, v, kc_ref, vc_ref, meta)  # the cache rows every backend must write
                # The value reference is the fp32 product of the same (possibly bf16) inputs: a bf16
                # torch reference rounds its own softmax and sits ~2e-2 off on 600+ token contexts.
                ref = ref_backend.forward(q.float(), k.float(), v.float(), kc.float(), vc.float(), meta,
                                          shape.head_dim ** -0.5, mask)
                backend.begin_forward(meta)
                out = backend.forward(q, k, v, kc, vc, meta, shape.head_dim ** -0.5, mask)
                err = rel_err(out, ref)
                plan = getattr(getattr(backend, "_plan", None), "kind", "")
                label = f"{name} {shape.name}" + (f" [{plan}]" if plan else "") + ("" if mask.plain else f" {mask}")
                report.correctness.append(dict(check=label, dtype=str(dtype).removeprefix("torch."), rel_err=err,
                                               ok=bool(err < tolerance(dtype) and torch.equal(kc, kc_ref))))


def check_ops(report: Report, device: str, quick: bool = False) -> None:
    from radix_backend.kernels import ops, triton_ops
    g = torch.Generator().manual_seed(0)
    rows = 12 if quick else 300
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, 576, generator=g).to(device=device, dtype=dtype)
        r = torch.randn(rows, 576, generator=g).to(device=device, dtype=dtype)
        w = torch.randn(576, generator=g).to(device=device, dtype=dtype)
        gu = torch.randn(rows, 2 * 1536, generator=g).to(device=device, dtype=dtype)
        cache = ops.build_cos_sin_cache(ops.default_inv_freq(64, 100000.0), 4096).to(device)
        q = torch.randn(rows, 9, 64, generator=g).to(device=device, dtype=dtype)
        k = torch.randn(rows, 3, 64, generator=g).to(device=device, dtype=dtype)
        pos = torch.randint(0, 4096, (rows,), generator=g).to(device)
        pairs = {
            "rms_norm": (triton_ops.rms_norm(x, w, 1e-5), ops.rms_norm_torch(x, w, 1e-5)),
            "fused_add_rms_norm": (torch.cat(triton_ops.fused_add_rms_norm(x, r, w, 1e-5)),
                                   torch.cat(ops.fused_add_rms_norm_torch(x, r, w, 1e-5))),
            "silu_and_mul": (triton_ops.silu_and_mul(gu), ops.silu_and_mul_torch(gu)),
            "apply_rotary": (torch.cat([t.flatten() for t in triton_ops.apply_rotary(q, k, pos, cache)]),
                             torch.cat([t.flatten() for t in ops.apply_rotary_torch(q, k, pos, cache)])),
        }
        for name, (got, ref) in pairs.items():
            err = rel_err(got, ref)
            report.correctness.append(dict(check=f"triton op {name}", dtype=str(dtype).removeprefix("torch."),
                                           rel_err=err, ok=bool(err < tolerance(dtype))))


def check_cuda_graph(report: Report, device: str) -> None:
    """Graph replay of a one-layer decoder over the Triton backend equals eager execution."""
    from radix_backend.kernels.cuda_graph import CudaGraphDecodeRunner
    shape = AttnShape("graph", [0], [1], 8, 2, 64)
    _, _, _, kc, vc, _ = make_batch(shape, torch.bfloat16, device, extra_slots=4000)
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 10 * 64, generator=g) / 8).to(device=device, dtype=torch.bfloat16)
    emb = torch.randn(100, 64, generator=g).to(device=device, dtype=torch.bfloat16)

    def decoder(backend):
        def fn(ids, pos, meta):
            h = emb[ids] @ w
            q, k, v = h.view(-1, 10, 64).split([8, 1, 1], dim=1)
            k, v = k.expand(-1, 2, -1), v.expand(-1, 2, -1)
            backend.begin_forward(meta)
            return backend.forward(q, k, v, kc, vc, meta, 0.125).float().sum(-1)
        return fn

    runner = CudaGraphDecodeRunner(decoder(make_backend("triton", device)), max_batch_size=16, max_kv_tokens=4000,
                                   device=device, max_context_len=1024)
    runner.capture()
    eager = decoder(make_backend("triton", device))
    worst = 0.0
    for seed, lens in enumerate([[5, 300, 17], [300] * 9, [64] * 16]):
        sub = AttnShape("graph", [n - 1 for n in lens], [1] * len(lens), 8, 2, 64)
        # Slots stay below the 4001 rows of kc/vc.
        _, _, _, _, _, meta = make_batch(sub, torch.bfloat16, device, seed=seed + 10, extra_slots=3990 - sum(lens))
        ids = torch.randint(0, 100, (len(lens),), device=device)
        pos = torch.tensor([n - 1 for n in lens], device=device)
        got = runner.run(ids, pos, meta).clone()
        worst = max(worst, rel_err(got, eager(ids, pos, meta)))
    report.correctness.append(dict(check="cuda-graph decode replay (triton)", dtype="bfloat16", rel_err=worst,
                                   ok=bool(worst < 1e-2)))


# ----------------------------------------------------------------------------- 2. timing

def cuda_time_ms(fn: Callable[[], Any], iters: int, reps_per_graph: int = 10,
                 use_graph: bool = True) -> tuple[float, str]:
    """Median ms per call, CUDA events. Replays `reps_per_graph` calls per graph when capturable."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    mode, graph = "eager", None
    if use_graph:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(reps_per_graph):
                    fn()
            mode = "graph"
        except Exception:  # e.g. host syncs inside fn: time eagerly instead
            graph = None
            torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if graph is not None:
            graph.replay()
        else:
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / (reps_per_graph if graph is not None else 1))
    return statistics.median(samples), mode


def dense_sdpa_fn(shape: AttnShape, q: torch.Tensor, k_cache: torch.Tensor) -> Callable[[], Any]:
    """Unpaged SDPA on contiguous [B, H, L, D] tensors: the no-gather lower bound."""
    import torch.nn.functional as F
    b, seq = len(shape.prefix_lens), shape.prefix_lens[0] + shape.extend_lens[0]
    ext = shape.extend_lens[0]
    qd = q.view(b, ext, shape.num_q_heads, shape.head_dim).transpose(1, 2).contiguous()
    kd = torch.randn(b, shape.num_kv_heads, seq, shape.head_dim, device=q.device, dtype=q.dtype)
    vd = torch.randn_like(kd)
    causal = shape.kind != "decode"
    if causal and shape.prefix_lens[0]:
        mask = torch.ones(ext, seq, dtype=torch.bool, device=q.device).tril(diagonal=shape.prefix_lens[0])
        return lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True)
    return lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, enable_gqa=True)


def bench_attention(report: Report, device: str, backends: list[str], iters: int, quick: bool) -> None:
    for shape in bench_shapes(quick):
        q, k, v, kc, vc, meta = make_batch(shape, torch.bfloat16, device, seed=1)
        scale = shape.head_dim ** -0.5
        for name in [b for b in backends] + ["sdpa_dense"]:
            if name == "sdpa_dense":
                fn = dense_sdpa_fn(shape, q, kc)
            else:
                backend = make_backend(name, device)
                backend.begin_forward(meta)
                backend.forward(q, k, v, kc, vc, meta, scale)  # plan + compile outside the timing

                def fn(backend=backend):
                    return backend.forward(q, k, v, kc, vc, meta, scale)
            ms, mode = cuda_time_ms(fn, iters)
            report.timings.append(dict(shape=shape.name, kind=shape.kind, backend=name, ms=ms, mode=mode))
    report.targets = evaluate_targets(report.timings)


def sweep_candidates() -> dict[str, list[dict[str, Any]]]:
    """Triton launch configs to try per kind (TritonAttentionBackend kwargs); defaults come first."""
    from radix_backend.kernels.triton_extend import ExtendConfig
    decode = [dict(num_kv_splits=None, decode_block_n=None)] + [
        dict(num_kv_splits=s, decode_block_n=bn) for s in (None, 1, 2, 4, 8) for bn in (32, 64, 128)]
    extend = [dict(extend_config=None)] + [dict(extend_config=ExtendConfig(m, n, w, st)) for m, n, w, st in
                                           ((128, 64, 8, 1), (64, 64, 4, 1), (64, 64, 4, 2), (128, 32, 4, 2),
                                            (64, 128, 8, 1), (128, 64, 8, 2))]
    return {"decode": decode, "extend": extend}


def describe_config(kwargs: dict[str, Any]) -> str:
    parts = []
    for key, value in kwargs.items():
        if value is None:
            parts.append(f"{key}=default")
        elif hasattr(value, "block_m"):
            parts.append(f"M{value.block_m}/N{value.block_n}/w{value.num_warps}/st{value.num_stages}")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


def sweep_triton(report: Report, device: str, iters: int, quick: bool) -> None:
    """Time Triton launch configs on the first decode shape and the first extend shape."""
    shapes = bench_shapes(quick)
    candidates = sweep_candidates()
    for kind in ("decode", "extend"):
        shape = sweep_shape(shapes, kind)
        q, k, v, kc, vc, meta = make_batch(shape, torch.bfloat16, device, seed=1)
        scale = shape.head_dim ** -0.5
        for kwargs in candidates[kind]:
            row = dict(shape=shape.name, kind=kind, config=describe_config(kwargs), ms=float("inf"), mode="")
            try:
                backend = make_backend("triton", device, **kwargs)
                backend.begin_forward(meta)
                backend.forward(q, k, v, kc, vc, meta, scale)

                def fn(backend=backend):
                    return backend.forward(q, k, v, kc, vc, meta, scale)
                row["ms"], row["mode"] = cuda_time_ms(fn, iters)
            except Exception as exc:  # e.g. a tile config that exceeds shared memory: skip it
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            report.sweep.append(row)


def best_sweep(sweep: list[dict[str, Any]]) -> list[str]:
    """One line per shape: fastest config against the default (first) one."""
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in sweep):
        rows = [r for r in sweep if r["shape"] == shape]
        best = min(rows, key=lambda r: r["ms"])
        lines.append(f"  sweep {shape}: best {best['config']} {best['ms']:.4f} ms (default {rows[0]['ms']:.4f} ms)")
    return lines


def evaluate_targets(timings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Triton / FlashInfer time ratio per shape against the issue's targets."""
    by = {(t["shape"], t["backend"]): t for t in timings}
    out = []
    for (shape, backend), t in by.items():
        fi = by.get((shape, "flashinfer"))
        if backend != "triton" or fi is None or fi["ms"] <= 0:
            continue
        ratio = t["ms"] / fi["ms"]
        target = TARGETS[t["kind"]]
        out.append(dict(shape=shape, ratio=ratio, target=target, ok=ratio <= target))
    return out


# ----------------------------------------------------------------------------- 3. end to end

FEW_SHOT_EXAMPLES = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Egypt", "Cairo"),
                     ("Canada", "Ottawa"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Norway", "Oslo")]
FEW_SHOT_QUERIES = ["Spain", "Germany", "Brazil", "India", "China", "Mexico", "Chile", "Greece", "Turkey",
                    "Poland", "Sweden", "Finland", "Ireland", "Portugal", "Austria", "Hungary", "Cuba", "Iran",
                    "Iraq", "Nepal", "Ghana", "Mali", "Chad", "Fiji", "Laos", "Oman", "Qatar", "Yemen", "Togo",
                    "Benin", "Niger", "Gabon"]


def few_shot_prompts(n: int) -> list[str]:
    """n prompts sharing one long few-shot prefix (the radix cache serves it after the first)."""
    prefix = "Answer with the capital city.\n\n" + "".join(
        f"Country: {c}\nCapital: {cap}\n\n" for c, cap in FEW_SHOT_EXAMPLES * 3)
    queries = (FEW_SHOT_QUERIES * (n // len(FEW_SHOT_QUERIES) + 1))[:n]
    return [f"{prefix}Country: {q}\nCapital:" for q in queries]


def branching_prompts(base: str, width: int) -> list[str]:
    """`width` continuations forked from one shared context (tree-of-thought style)."""
    return [f"{base}\nIdea {i + 1} of {width}, take a different angle:" for i in range(width)]


BRANCH_BASE = ("You are planning a small garden on a sunny balcony. List practical ideas, each one short "
               "and specific, considering light, water, containers and the season.")


def run_workloads(engine: Any, quick: bool) -> dict[str, Any]:
    """Few-shot and branching: the project's benchmark workloads (bench.workloads, run as
    bench.core_bench runs them) so GPU and CPU figures compare; built-in prompts if those cannot
    load (e.g. the ShareGPT data set is not installed on the GPU machine)."""
    results: dict[str, Any] = {}
    for name in ("few-shot", "multi-turn", "branching"):
        try:
            results[name] = _run_project_workload(engine, name, quick)
        except Exception as exc:  # fall back to the self-contained prompts below
            results[name] = _run_builtin_workload(engine, name, quick)
            results[name]["note"] = f"built-in prompts ({type(exc).__name__}: {exc})"[:200]
    return results


def _run_project_workload(engine: Any, name: str, quick: bool) -> dict[str, Any]:
    from radix_backend.bench import core_bench
    workload = core_bench.build_workload(name, engine, quick)
    result, outputs = core_bench.run_engine(engine, workload)
    return dict(source="bench.workloads", requests=len(outputs), wall_s=result.wall_s,
                tokens=result.completion_tokens, tok_per_s=result.completion_tokens / max(result.wall_s, 1e-9),
                hit_rate=result.cached_prompt_tokens / max(result.prompt_tokens, 1), outputs=outputs)


def _run_builtin_workload(engine: Any, name: str, quick: bool) -> dict[str, Any]:
    """Few-shot, or for the other workloads the two-level branching prompts."""
    from radix_backend import SamplingParams
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    engine.flush_cache()
    before = engine.cache_stats()
    start = time.perf_counter()
    if name == "few-shot":
        outs = engine.generate(few_shot_prompts(16 if quick else 64), params)
    else:
        outs = _branching_two_levels(engine, params, quick)
    wall = time.perf_counter() - start
    after = engine.cache_stats()
    prompt_tokens = after.prompt_tokens - before.prompt_tokens
    tokens = sum(len(o.token_ids) for o in outs)
    return dict(source="builtin", requests=len(outs), wall_s=wall, tokens=tokens, tok_per_s=tokens / max(wall, 1e-9),
                hit_rate=(after.cached_tokens - before.cached_tokens) / max(prompt_tokens, 1),
                outputs=[list(o.token_ids) for o in outs])


def _branching_two_levels(engine: Any, params: Any, quick: bool) -> list[Any]:
    width = 4 if quick else 8
    first = engine.generate(branching_prompts(BRANCH_BASE, width), params)
    second_prompts = [p + o.text + "\nRefine it:" for p, o in zip(branching_prompts(BRANCH_BASE, width), first)
                      for _ in range(2)]
    second = engine.generate([p + f" (variant {i % 2})" for i, p in enumerate(second_prompts)], params)
    return list(first) + list(second)


def model_label(model: str | None) -> str:
    return "SmolLM2-135M" if model is None else os.path.basename(os.path.normpath(model))


def bench_e2e(report: Report, device: str, backends: list[str], quick: bool, kv_cache_tokens: int = 200_000,
              engine_factory: Callable[..., Any] | None = None, warmup: bool = True,
              models: list[str | None] | None = None) -> None:
    """Every workload on every model (None = the embedded SmolLM2) with every backend; each
    backend's greedy tokens are compared with the first backend's on the same model."""
    if engine_factory is None:
        try:
            from radix_backend import Engine as engine_factory
        except ImportError as exc:
            report.errors.append(f"e2e: radix_backend.Engine not importable: {exc}")
            return
    for model in models or [None]:
        reference: dict[str, list[list[int]]] = {}
        for name in backends:
            start = time.perf_counter()
            with engine_factory(model=model, device=device, kv_cache_tokens=kv_cache_tokens,
                                **engine_backend(name)) as engine:
                load_s = time.perf_counter() - start
                if warmup:
                    run_workloads(engine, quick=True)  # compiles kernels, fills allocator caches
                results = run_workloads(engine, quick)
            for workload, r in results.items():
                outputs = r.pop("outputs")
                reference.setdefault(workload, outputs)
                same = sum(a == b for a, b in zip(outputs, reference[workload])) / max(len(outputs), 1)
                report.e2e.append(dict(model=model_label(model), backend=name, workload=workload, load_s=load_s,
                                       same_as_first=same, **r))
            if device.startswith("cuda"):
                torch.cuda.empty_cache()


GREEDY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
                  "Once upon a time, in a small village,", "The three primary colors are",
                  "To make a cup of tea, first", "import numpy as np\n\narr =", "The largest planet in the solar system"]


def check_hf_greedy(report: Report, device: str, backends: list[str], model: str | None, new_tokens: int = 24,
                    dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> None:
    """Greedy tokens of every backend against HF transformers' `generate` on the same GPU and dtype.

    fp32 must match token for token (the engine's reference claim); bf16 rows report how many
    prompts agree on all tokens and on the first 8 (bf16 rounding may flip near-ties, so those
    rows inform and do not fail the check). FlashInfer has no fp32 kernels and runs bf16 only."""
    from transformers import AutoModelForCausalLM

    from radix_backend import Engine, SamplingParams
    from radix_backend.model_executor.loader import hf_directory, resolve_checkpoint
    hf_dir = hf_directory(resolve_checkpoint(model))
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for dtype in dtypes:
        hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=getattr(torch, dtype)).to(device).eval()
        expected: list[list[int]] | None = None
        for name in backends:
            if not runs_in(name, dtype):
                continue
            with Engine(model=model, device=device, dtype=dtype, kv_cache_tokens=8192,
                        **engine_backend(name)) as engine:
                if expected is None:
                    expected = [_hf_greedy(hf, engine.encode(p), new_tokens, device) for p in GREEDY_PROMPTS]
                got = [list(o.token_ids) for o in engine.generate(GREEDY_PROMPTS, params)]
            full = sum(a == b for a, b in zip(got, expected))
            first8 = sum(a[:8] == b[:8] for a, b in zip(got, expected))
            strict = dtype == "float32"
            report.correctness.append(dict(
                check=f"greedy == HF {model_label(model)} {name} ({full}/{len(got)} full, {first8} first-8)",
                dtype=dtype, rel_err=1.0 - full / len(got), ok=bool(full == len(got)) if strict else True))
        del hf
        torch.cuda.empty_cache()


def _hf_greedy(hf: Any, ids: list[int], new_tokens: int, device: str) -> list[int]:
    """HF's greedy continuation of exactly `new_tokens` tokens, EOS included like any other token
    (what `ignore_eos` asks of the engine; `generate` would stop at or suppress EOS)."""
    out, past, step = [], None, torch.tensor([ids], device=device)
    with torch.no_grad():
        for _ in range(new_tokens):
            res = hf(input_ids=step, past_key_values=past, use_cache=True)
            past = res.past_key_values
            step = res.logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(step))
    return out


RANDOM_LLAMA_0_5B = dict(hidden_size=1536, num_hidden_layers=18, num_attention_heads=12, num_key_value_heads=4,
                         intermediate_size=4096, max_position_embeddings=8192, rope_theta=500000.0,
                         tie_word_embeddings=True, initializer_range=0.02)


def write_random_llama(dest: str, device: str, tokenizer_source: str | None = None, seed: int = 0) -> str:
    """A random-weight Llama of 0.53B parameters (18 layers, d 1536, 12 q / 4 kv heads of 128) in
    bf16 safetensors with SmolLM2's tokenizer: a >= 0.5B shape to time without any download.
    Random weights make its text meaningless; its speed is a real model's of that shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from radix_backend.model_executor.loader import load_tokenizer, resolve_checkpoint
    if os.path.isfile(os.path.join(dest, "config.json")):
        return dest
    tokenizer = load_tokenizer(resolve_checkpoint(tokenizer_source))
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **RANDOM_LLAMA_0_5B)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


# ----------------------------------------------------------------------------- 4. batch invariance

def check_invariance(report: Report, device: str, backends: list[str], model: str | None = None,
                     dtypes: tuple[str, ...] = ("float32", "bfloat16"), seed: int = 0) -> None:
    """Per backend and dtype: how many steps' logits are bit-identical alone and in a mixed batch."""
    from radix_backend import Engine
    from radix_backend.bench import invariance
    cases = invariance.random_cases(seed)
    for dtype in dtypes:
        for name in backends:
            if not runs_in(name, dtype):
                continue
            with Engine(model=model, device=device, dtype=dtype, kv_cache_tokens=20_000, chunked_prefill_tokens=48,
                        **engine_backend(name)) as engine, invariance.recording_step_logits() as logits:
                alone = invariance.run_alone(engine, cases, logits)
                together = invariance.run_together(engine, cases, logits, seed)
            result = invariance.compare(alone, together)
            report.invariance.append(dict(model=model_label(model), backend=name, dtype=dtype, **asdict(result)))
            if name == INVARIANT:  # the one backend that claims it
                report.correctness.append(dict(
                    check=f"batch invariance {model_label(model)} {name}", dtype=dtype,
                    rel_err=1.0 - result.identical_steps / max(result.steps, 1), ok=result.invariant))
            if device.startswith("cuda"):
                torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- report

def format_table(report: Report) -> str:
    lines = ["== correctness (rel. error vs the fp32 torch reference)"]
    for c in report.correctness:
        lines.append(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['check']:<52} {c['dtype']:<9} {c['rel_err']:.2e}")
    if report.timings:
        lines.append("== attention time per layer call, ms (median, CUDA events)")
        shapes = list(dict.fromkeys(t["shape"] for t in report.timings))
        names = list(dict.fromkeys(t["backend"] for t in report.timings))
        by = {(t["shape"], t["backend"]): t for t in report.timings}
        lines.append("  " + f"{'shape':<34}" + "".join(f"{n:>12}" for n in names))
        for s in shapes:
            cells = "".join(f"{by[(s, n)]['ms']:>12.4f}" if (s, n) in by else f"{'-':>12}" for n in names)
            lines.append(f"  {s:<34}{cells}")
    for t in report.targets:
        lines.append(f"  target {t['shape']}: triton/flashinfer = {t['ratio']:.2f}x (<= {t['target']}x) "
                     f"{'ok' if t['ok'] else 'MISSED'}")
    lines += best_sweep(report.sweep)
    if report.e2e:
        lines.append("== end to end")
        for e in report.e2e:
            lines.append(f"  {e.get('model', 'SmolLM2-135M'):<14} {e['backend']:<11} {e['workload']:<10} {e['requests']:>4} req "
                         f"{e['tok_per_s']:>9.1f} tok/s hit {e['hit_rate']:.2f} "
                         f"same-as-first {e['same_as_first']:.2f} (load {e['load_s']:.1f}s, {e['source']})")
    if report.invariance:
        lines.append("== batch invariance (logits alone vs in a mixed batch, bit for bit)")
        for r in report.invariance:
            lines.append(f"  {r['model']:<14} {r['backend']:<11} {r['dtype']:<9} identical steps "
                         f"{r['identical_steps']}/{r['steps']}, requests {r['identical_requests']}/{r['requests']}, "
                         f"same tokens {r['same_tokens']}/{r['requests']}, max |diff| {r['max_abs_diff']:.2e}")
    for err in report.errors:
        lines.append(f"  ERROR {err}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m radix_backend.bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="CUDA device (default: cuda)")
    p.add_argument("--backends", default="auto",
                   help=f"comma list of torch,triton,{INVARIANT},flashinfer (default: those available; "
                        f"{INVARIANT} is Triton with batch invariance, the others run without)")
    p.add_argument("--iters", type=int, default=50, help="timed samples per kernel (default: 50)")
    p.add_argument("--quick", action="store_true", help="small shapes and workloads (smoke run)")
    p.add_argument("--models", default="embedded",
                   help="comma list of models for the end-to-end and HF sections: 'embedded' (SmolLM2), "
                        "HF checkpoint dirs or .gguf files (default: embedded)")
    p.add_argument("--random-model", default=None, metavar="DIR",
                   help="write a random-weight 0.5B Llama (SmolLM2's tokenizer) to DIR and add it to --models")
    p.add_argument("--hf-greedy", action="store_true",
                   help="compare every backend's greedy tokens with HF transformers on the GPU, per model")
    p.add_argument("--invariance", action="store_true",
                   help="measure batch invariance per backend and dtype on the first model of --models")
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--skip-sweep", action="store_true", help="skip the Triton launch-config sweep")
    p.add_argument("--out", default=None, help="folder for gpu_check.json (default: none written)")
    return p.parse_args(argv)


def parse_models(text: str) -> list[str | None]:
    return [None if m.strip() in ("", "embedded") else m.strip() for m in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = Report(device=args.device, started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    if torch.device(args.device).type != "cuda" or not torch.cuda.is_available():
        print(f"gpu_check needs a CUDA device (got {args.device!r}, cuda available: {torch.cuda.is_available()})",
              file=sys.stderr)
        return 2
    report.device = torch.cuda.get_device_name(torch.device(args.device))
    backends = available_kernel_backends(args.device) if args.backends == "auto" else args.backends.split(",")
    models = parse_models(args.models)
    if args.random_model:
        report.guard("random model", lambda: models.append(write_random_llama(args.random_model, args.device)))
    t0 = time.perf_counter()

    def section(name: str, fn: Callable[[], None]) -> None:
        """Run one section, then save the report so far (a run cut short keeps what it measured)."""
        report.guard(name, fn)
        print(f"[gpu_check] {name} done at {time.perf_counter() - t0:.0f}s", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
                json.dump(asdict(report), f, indent=1)

    if not args.skip_correctness:
        section("attention correctness", lambda: check_attention(report, args.device, backends, args.quick))
        if "triton" in backends:
            section("ops correctness", lambda: check_ops(report, args.device, args.quick))
            section("cuda graph", lambda: check_cuda_graph(report, args.device))
        if args.hf_greedy:
            for model in models:
                section(f"greedy vs HF {model_label(model)}",
                        lambda model=model: check_hf_greedy(report, args.device, backends, model))
    if not args.skip_bench:
        section("kernel timing", lambda: bench_attention(report, args.device, backends, args.iters, args.quick))
    if not args.skip_e2e:
        section("end to end", lambda: bench_e2e(report, args.device, backends, args.quick, models=models))
    if args.invariance:
        section("batch invariance", lambda: check_invariance(report, args.device, backends, models[0]))
    if not args.skip_bench and "triton" in backends and not args.skip_sweep:
        section("triton sweep", lambda: sweep_triton(report, args.device, args.iters // 2 or 1, args.quick))
    print(format_table(report))
    failed = any(not c["ok"] for c in report.correctness) or bool(report.errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
