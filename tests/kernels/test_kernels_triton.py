"""Triton kernels (attention extend/decode, fused ops) vs the torch reference.

On CPU the kernels run under Triton's interpreter. TRITON_INTERPRET must be set before triton is
imported and must not leak into other test modules, so in a normal pytest run this module's
kernel tests are skipped and one driver test re-runs this file in a subprocess with
TRITON_INTERPRET=1. With CUDA present the same tests run compiled on the GPU instead.

The interpreter's tl.dot reinterprets bf16 bits, so under it the attention kernels widen bf16
dot operands to fp32 (exact; see kernels/triton_dot.py) and bf16 attention is checked here too;
`test_kernels_compile_for_hopper` compiles the real bf16 tensor-core path for sm_90.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
RUN_KERNELS = HAS_TRITON and (INTERPRET or HAS_CUDA)
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"

if INTERPRET and HAS_TRITON:
    from interpreter_dot import make_dots_row_invariant

    make_dots_row_invariant()

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
kernel_test = pytest.mark.skipif(not RUN_KERNELS, reason="runs in the TRITON_INTERPRET=1 subprocess (driver test)")


@pytest.mark.skipif(INTERPRET or HAS_CUDA, reason="kernels run directly in this process")
def test_kernels_under_triton_interpreter(request) -> None:
    """Driver: runs this file's kernel tests with TRITON_INTERPRET=1 in a fresh interpreter
    (with this run's -m marker selection, so `-m "not slow"` skips the SmolLM2 test there too)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning",
           str(Path(__file__).resolve())]
    if request.config.option.markexpr:
        cmd += ["-m", request.config.option.markexpr]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-3000:]


# ----------------------------------------------------------------------------- GPU compile check

def _ptxas_available() -> bool:
    if not HAS_TRITON:
        return False
    import triton
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


def _compile_for(fn, pointer_types: dict, constexprs: dict, arch: int, **options):
    """Ahead-of-time compile a @triton.jit kernel to a cubin for `arch` (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else pointer_types.get(n, "i32") for n in names}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


H200_SMEM_OPTIN = 232448  # bytes, as torch reported on an H200 (A100: 166912)


def test_extend_default_config_follows_shared_memory() -> None:
    """128x128 tiles over 3 stages only where a block may take > 200 KiB of shared memory."""
    from radix_backend.kernels.triton_extend import ExtendConfig, extend_block_sizes
    assert extend_block_sizes(128, torch.bfloat16, True, H200_SMEM_OPTIN) == ExtendConfig(128, 128, 8, 3)
    assert extend_block_sizes(128, torch.bfloat16, True, 166912) == ExtendConfig(128, 64, 8)
    assert extend_block_sizes(64, torch.bfloat16, True, H200_SMEM_OPTIN) == ExtendConfig(128, 64, 4)
    assert extend_block_sizes(128, torch.float32, True, H200_SMEM_OPTIN) == ExtendConfig(32, 32, 4)
    assert extend_block_sizes(128, torch.bfloat16, False, H200_SMEM_OPTIN) == ExtendConfig(16, 16, 4)


@pytest.mark.skipif(INTERPRET or not _ptxas_available(), reason="needs triton's bundled ptxas, not the interpreter")
@pytest.mark.parametrize("dtype,dim", [("bf16", 128), ("fp32", 64)])
def test_kernels_compile_for_hopper(dtype: str, dim: int) -> None:
    """The interpreter does not check GPU constraints (dot shapes, layouts, shared memory): compile
    every kernel for sm_90 with the launch configs the wrappers use on H100/H200."""
    from radix_backend.kernels import triton_decode, triton_extend, triton_invariant, triton_matmul, triton_ops
    from radix_backend.kernels.triton_dot import dot_config
    import torch as _torch
    p = f"*{dtype}"
    ptr_i64, ptr_f32 = "*i64", "*fp32"
    dot = dot_config(_torch.bfloat16 if dtype == "bf16" else _torch.float32, interpreter=False)
    dots = dict(DOT_DTYPE=dot.operand_dtype, DOT_PRECISION=dot.precision)
    dec1 = _compile_for(triton_decode._decode_stage1,
                        dict(Q=p, K_CACHE=p, V_CACHE=p, KV_INDPTR=ptr_i64, KV_INDICES=ptr_i64, MID_O=ptr_f32,
                             MID_LSE=ptr_f32, sm_scale_log2="fp32"),
                        dict(HEADS_PER_PROG=4, PROGS_PER_KV=1, NUM_KV_SPLITS=8, BLOCK_H=16, BLOCK_N=64,
                             BLOCK_D=dim, **dots), 90, num_warps=4, num_stages=2)
    _compile_for(triton_decode._decode_stage2, dict(MID_O=ptr_f32, MID_LSE=ptr_f32, KV_INDPTR=ptr_i64, O=p),
                 dict(NUM_KV_SPLITS=8, BLOCK_D=dim), 90, num_warps=4)
    torch_dtype = _torch.bfloat16 if dtype == "bf16" else _torch.float32
    cfg = triton_extend.extend_block_sizes(dim, torch_dtype, on_gpu=True, smem_per_block=H200_SMEM_OPTIN)
    ext = _compile_for(triton_extend._extend_kernel,
                       dict(Q=p, K=p, V=p, K_CACHE=p, V_CACHE=p, QO_INDPTR=ptr_i64, KV_INDPTR=ptr_i64,
                            KV_INDICES=ptr_i64, O=p, sm_scale_log2="fp32"),
                       dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=dim, **dots), 90,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    for kernel in (dec1, ext):
        assert kernel.metadata.shared <= 227 * 1024, "exceeds Hopper shared memory"
    inv = triton_invariant.invariant_config(dim, 4, torch_dtype, on_gpu=True)
    inv_kernels = [_compile_for(triton_invariant._invariant_kernel,
                                dict(Q=p, K_CACHE=p, V_CACHE=p, QO_INDPTR=ptr_i64, KV_INDPTR=ptr_i64,
                                     KV_INDICES=ptr_i64, O=p, sm_scale_log2="fp32", softcap_log2="fp32"),
                                dict(BLOCK_M=inv.block_m, BLOCK_N=inv.block_n, BLOCK_D=dim, HAS_WINDOW=masked,
                                     HAS_SOFTCAP=masked, **dots), 90,
                                num_warps=inv.num_warps, num_stages=inv.num_stages) for masked in (False, True)]
    mm = triton_matmul.matmul_config(torch_dtype, on_gpu=True)
    mm_kernel = _compile_for(triton_matmul._matmul_kernel, dict(X=p, W=p, BIAS=p, Y=p),
                             dict(HAS_BIAS=True, BLOCK_M=mm.block_m, BLOCK_N=mm.block_n, BLOCK_K=mm.block_k,
                                  **dots), 90, num_warps=mm.num_warps, num_stages=mm.num_stages)
    for kernel in (*inv_kernels, mm_kernel):
        assert kernel.metadata.shared <= 227 * 1024, "exceeds Hopper shared memory"
    _compile_for(triton_ops._rms_norm_kernel, dict(X=p, R=p, W=p, Y=p, RES_OUT=p, eps="fp32"),
                 dict(HAS_RESIDUAL=True, BLOCK=1024), 90, num_warps=4)
    _compile_for(triton_ops._silu_and_mul_kernel, dict(X=p, Y=p), dict(BLOCK=1024), 90)
    _compile_for(triton_ops._rotary_kernel, dict(X=p, OUT=p, POS=ptr_i64, CACHE=ptr_f32),
                 dict(BLOCK_H=16, BLOCK_D=dim), 90)


# ----------------------------------------------------------------------------- helpers

def make_batch(prefix_lens: list[int], extend_lens: list[int], hq: int, hkv: int, dim: int,
               dtype: torch.dtype, seed: int = 0, device: str = DEVICE):
    """Random ragged batch whose sequences occupy shuffled KV slots (slot 0 left unused)."""
    from radix_backend.kernels.attention_base import AttentionMetadata
    g = torch.Generator().manual_seed(seed)
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_slots = sum(seq) + 9
    perm = torch.randperm(num_slots - 1, generator=g)[: sum(seq)] + 1
    out_slots, off = [], 0
    for p, s in zip(prefix_lens, seq):
        out_slots.append(perm[off + p: off + s])
        off += s
    meta = AttentionMetadata.build(prefix_lens, extend_lens, perm.to(device), torch.cat(out_slots).to(device), device)
    n = sum(extend_lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)
    return rnd(n, hq, dim), rnd(n, hkv, dim), rnd(n, hkv, dim), rnd(num_slots, hkv, dim), rnd(num_slots, hkv, dim), meta


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def run_both(backend, prefix_lens, extend_lens, hq, hkv, dim, dtype, seed=0, mask=None):
    """(backend's output, the torch backend's) on one random batch; `mask` (a ScoreMask) for both."""
    from radix_backend.kernels.attention_base import PLAIN
    from radix_backend.kernels.torch_backend import TorchAttentionBackend
    mask = mask or PLAIN
    q, k, v, kc, vc, meta = make_batch(prefix_lens, extend_lens, hq, hkv, dim, dtype, seed)
    scale = dim ** -0.5
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = TorchAttentionBackend().forward(q, k, v, kc_ref, vc_ref, meta, scale, mask)
    backend.begin_forward(meta)
    out = backend.forward(q, k, v, kc, vc, meta, scale, mask)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), "new K/V must land at out_slots"
    return out, ref


def tol(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]


ATTN_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ----------------------------------------------------------------------------- extend

@kernel_test
@pytest.mark.parametrize("dtype", ATTN_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 2)])  # GQA ratios 1, 3, 4
@pytest.mark.parametrize("dim", [64, 128])
def test_extend_matches_torch(dtype, hq, hkv, dim) -> None:
    from radix_backend.kernels.triton_backend import TritonAttentionBackend
    # Ragged: prefix 0 and non-zero, extends shorter/longer than one 16-row block, a 1-token extend.
    out, ref = run_both(TritonAttentionBackend(), [0, 5, 37, 0], [3, 20, 1, 17], hq, hkv, dim, dtype,
                        seed=hq * 7 + dim)
    assert rel_err(out, ref) < tol(dtype)


@kernel_test
def test_extend_odd_head_dim_and_long_prefix() -> None:
    from radix_backend.kernels.triton_backend import TritonAttentionBackend
    out, ref = run_both(TritonAttentionBackend(), [70, 0], [5, 33], 3, 1, 80, torch.float32, seed=3)
    assert rel_err(out, ref) < 1e-5


@kernel_test
def test_extend_kernel_direct_reads_new_kv_from_inputs() -> None:
    """extend_attention takes the new tokens' K/V from k/v, so a stale cache must not matter."""
    from radix_backend.kernels.torch_backend import TorchAttentionBackend
    from radix_backend.kernels.triton_extend import extend_attention
    q, k, v, kc, vc, meta = make_batch([4, 0], [6, 9], 4, 2, 64, torch.float32, seed=5)
    ref = TorchAttentionBackend().forward(q, k, v, kc.clone(), vc.clone(), meta, 0.125)
    out = extend_attention(q, k, v, kc, vc, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, 9, 0.125)
    assert rel_err(out, ref) < 1e-5


# ----------------------------------------------------------------------------- batch-invariant kernels

@kernel_test
@pytest.mark.parametrize("dtype", ATTN_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (9, 3), (32, 1)])  # group 32 > 16 rows: one token a tile
def test_invariant_attention_matches_torch(dtype, hq, hkv) -> None:
    from radix_backend.kernels.triton_backend import TritonAttentionBackend
    backend = TritonAttentionBackend(batch_invariant=True)
    for prefix, extend in (([0, 5, 37, 0], [3, 20, 1, 17]), ([0, 9, 40, 3], [1, 1, 1, 1])):
        out, ref = run_both(backend, prefix, extend, hq, hkv, 64, dtype, seed=hq + len(prefix))
        assert rel_err(out, ref) < tol(dtype)


MASKS = {  # (window, softcap): windows under, at and past the interpreter's 16-key tiles
    "window1": (1, None), "window16": (16, None), "window17": (17, None), "window40": (40, None),
    "softcap": (None, 5.0), "window20-softcap": (20, 3.0), "softcap-saturated": (None, 0.5)}


@kernel_test
@pytest.mark.parametrize("dtype,mask_name,batch_invariant",
                         [(dtype, name, True) for dtype in (torch.float32, torch.bfloat16) for name in sorted(MASKS)]
                         + [(torch.float16, "window20-softcap", True), (torch.float32, "window20-softcap", False)])
def test_masked_attention_matches_torch(dtype, mask_name, batch_invariant) -> None:
    """A sliding window and soft-capped scores in the Triton kernel (the one for masked layers,
    batch-invariant or not) against the torch path's masks, for decode rows and extends over
    cached prefixes longer than the window."""
    from radix_backend.kernels.attention_base import ScoreMask
    from radix_backend.kernels.triton_backend import TritonAttentionBackend
    mask = ScoreMask(*MASKS[mask_name])
    backend = TritonAttentionBackend(batch_invariant=batch_invariant)
    for prefix, extend in (([40, 7, 130, 64], [1, 1, 1, 1]), ([100, 0, 5, 33], [3, 70, 17, 1])):
        out, ref = run_both(backend, prefix, extend, 6, 2, 64, dtype, seed=len(mask_name), mask=mask)
        assert rel_err(out, ref) < tol(dtype), (prefix, extend)


def _target_request(hq: int, hkv: int, dim: int, tokens: int = 75):
    g = torch.Generator().manual_seed(hq * 100 + hkv)
    return (torch.randn(tokens, hq, dim, generator=g), torch.randn(tokens, hkv, dim, generator=g),
            torch.randn(tokens, hkv, dim, generator=g))


def _invariant_rows(target, span: tuple[int, int], others: list[tuple[int, int]], position: int,
                    dtype: torch.dtype, mask=None) -> torch.Tensor:
    """The invariant kernel's rows for the target request's tokens span[0] .. span[0]+span[1]-1
    (the ones before them cached), inside a batch of `others` (prefix, extend) with the target at
    index `position`; the target's K/V sit at slots 1..T, the others' after, random. `mask`: a
    ScoreMask for every row."""
    from radix_backend.kernels.attention_base import PLAIN, AttentionMetadata
    from radix_backend.kernels.triton_backend import TritonAttentionBackend
    q_all, k_all, v_all = target
    n_tok, hq, dim = q_all.shape
    hkv = k_all.shape[1]
    g = torch.Generator().manual_seed(31 * len(others) + position)
    reqs: list[tuple[int, int, bool]] = [(p, e, False) for p, e in others]
    reqs.insert(position, (span[0], span[1], True))
    num_slots = 1 + n_tok + sum(p + e for p, e, _ in reqs) + 3
    k_cache = torch.randn(num_slots, hkv, dim, generator=g)
    v_cache = torch.randn(num_slots, hkv, dim, generator=g)
    k_cache[1:n_tok + 1], v_cache[1:n_tok + 1] = k_all, v_all
    kv, out_slots, qs, ks, vs, nxt = [], [], [], [], [], n_tok + 1
    for p, e, is_target in reqs:
        if is_target:
            slots = torch.arange(1, 1 + p + e)
            q, k, v = q_all[p:p + e], k_all[p:p + e], v_all[p:p + e]
        else:
            slots, nxt = torch.arange(nxt, nxt + p + e), nxt + p + e
            q, k, v = (torch.randn(e, h, dim, generator=g) for h in (hq, hkv, hkv))
        kv.append(slots)
        out_slots.append(slots[p:])
        qs.append(q), ks.append(k), vs.append(v)
    meta = AttentionMetadata.build([r[0] for r in reqs], [r[1] for r in reqs], torch.cat(kv).to(DEVICE),
                                   torch.cat(out_slots).to(DEVICE), DEVICE)
    backend = TritonAttentionBackend(batch_invariant=True)
    backend.begin_forward(meta)
    to = dict(dtype=dtype, device=DEVICE)
    out = backend.forward(torch.cat(qs).to(**to), torch.cat(ks).to(**to), torch.cat(vs).to(**to),
                          k_cache.to(**to), v_cache.to(**to), meta, dim ** -0.5, mask or PLAIN)
    start = sum(r[1] for r in reqs[:position])
    return out[start:start + span[1]].cpu()


@kernel_test
@pytest.mark.parametrize("dtype,hq,hkv,mask",
                         [(dtype, hq, hkv, None) for dtype in (torch.float32, torch.bfloat16)
                          for hq, hkv in ((6, 2), (9, 3), (8, 8))]
                         + [(torch.float32, 6, 2, (20, None)), (torch.float32, 9, 3, (33, 4.0))])
def test_invariant_attention_rows_do_not_depend_on_batch_chunking_or_cache(dtype, hq, hkv, mask) -> None:
    """A row's bits are the same computed in a whole prefill, in a later chunk over a cached
    prefix, as a decode row, alone or among other requests of any lengths and at any index; with
    a sliding window (whose skipped tiles differ between those cases) and soft-capped scores too."""
    from radix_backend.kernels.attention_base import ScoreMask
    mask = ScoreMask(*mask) if mask else None
    target = _target_request(hq, hkv, 64)
    whole = _invariant_rows(target, (0, 75), [], 0, dtype, mask)
    cases = [((40, 35), [], 0), ((40, 35), [(0, 20), (13, 1), (50, 7)], 1), ((74, 1), [], 0),
             ((74, 1), [(30, 1), (5, 1)], 2), ((60, 15), [(100, 33), (0, 64)], 1), ((0, 75), [(10, 5)], 1),
             ((17, 1), [(3, 40)], 0)]
    for span, others, position in cases:
        rows = _invariant_rows(target, span, others, position, dtype, mask)
        assert torch.equal(rows, whole[span[0]:span[0] + span[1]]), (span, others, position)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_invariant_linear_rows_do_not_depend_on_the_row_count(dtype) -> None:
    import torch.nn.functional as F

    from radix_backend.kernels.triton_matmul import invariant_linear
    g = torch.Generator().manual_seed(4)
    x, w, b = (torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE) for shape in ((100, 72), (50, 72), (50,)))
    full = invariant_linear(x, w, b)
    assert rel_err(full, F.linear(x.float(), w.float(), b.float())) < {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    for lo, hi in [(0, 1), (5, 6), (0, 17), (33, 97), (99, 100)]:
        assert torch.equal(invariant_linear(x[lo:hi], w, b), full[lo:hi]), (lo, hi)
    assert torch.equal(invariant_linear(x.view(4, 25, 72), w).view(100, 50), invariant_linear(x, w))


@kernel_test
@pytest.mark.parametrize("fixture", ["tiny_gemma2_dir", "tiny_mistral_window_dir"])
def test_engine_with_triton_attention_serves_windowed_and_soft_capped_models_like_hf(fixture, request) -> None:
    """Gemma 2 (local layers with a 16-key window, soft-capped scores) and Mistral (a 64-key window)
    through the engine with Triton attention: HF transformers' greedy tokens and log-probabilities
    on prompts longer than the window, and the same tokens again from the cache."""
    from transformers import AutoModelForCausalLM

    from radix_backend import Engine, SamplingParams
    model_dir = request.getfixturevalue(fixture)
    prompts = ["Hello, my name is", "The quick brown fox jumps over the lazy dog. " * 8]
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with Engine(str(model_dir), device=DEVICE, dtype="float32", attention_backend="triton",
                kv_cache_tokens=1024) as engine:
        outs = engine.generate(prompts, params)
        assert len(engine.encode(prompts[-1])) > 64
        for prompt, out in zip(prompts, outs):
            ids = engine.encode(prompt)
            with torch.no_grad():
                full = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
                logprobs = torch.log_softmax(hf(full).logits[0, len(ids) - 1:-1].float(), -1)
            assert out.token_ids == full[0, len(ids):].tolist(), prompt
            got = torch.tensor([lp.logprob for lp in out.logprobs])
            torch.testing.assert_close(got, logprobs[range(6), out.token_ids], atol=1e-4, rtol=1e-4)
        again = engine.generate(prompts, params)
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]
        assert all(o.meta.cached_tokens > 0 for o in again)


@kernel_test
def test_engine_with_invariant_triton_gives_each_request_its_solo_bits(tiny_llama_dir) -> None:
    """The engine with Triton attention and batch invariance: each request's logits at every step
    alone on a cold cache == inside a mixed batch (shared prefixes, 48-token prefill chunks,
    staggered arrivals). On a GPU this is the whole invariant path (Triton matmuls too); under the
    interpreter the linears are the CPU's fixed-order kernel."""
    from radix_backend import Engine
    from radix_backend.bench import invariance
    from radix_backend.kernels import native
    if DEVICE == "cpu" and not native.available():
        pytest.skip("the CPU linears are invariant only with the native kernels")
    cases = invariance.random_cases(0)[:8]
    with Engine(str(tiny_llama_dir), device=DEVICE, dtype="float32", attention_backend="triton", batch_invariant=True,
                kv_cache_tokens=2000, chunked_prefill_tokens=48) as engine, \
            invariance.recording_step_logits() as logits:
        assert engine.kernel_path.batch_invariant is (DEVICE == "cuda")  # on the CPU only native claims it
        alone = invariance.run_alone(engine, cases, logits)
        together = invariance.run_together(engine, cases, logits, seed=0)
    result = invariance.compare(alone, together)
    assert result.steps > 0 and result.identical_steps == result.steps, result
    assert result.same_tokens == result.requests


# ----------------------------------------------------------------------------- decode

@kernel_test
@pytest.mark.parametrize("dtype", ATTN_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("dim", [64, 128])
def test_decode_matches_torch(dtype, hq, hkv, dim) -> None:
    from radix_backend.kernels.triton_backend import TritonAttentionBackend
    # min_split_len 8 forces several splits, including requests shorter than one split.
    backend = TritonAttentionBackend(num_kv_splits=4, min_split_len=8)
    out, ref = run_both(backend, [0, 9, 40, 3], [1, 1, 1, 1], hq, hkv, dim, dtype, seed=hq + dim)
    assert rel_err(out, ref) < tol(dtype)


@kernel_test
@pytest.mark.parametrize("splits", [1, 2, 3, 16])
def test_decode_split_count_does_not_change_result(splits: int) -> None:
    from radix_backend.kernels.triton_backend import TritonAttentionBackend
    out, ref = run_both(TritonAttentionBackend(num_kv_splits=splits, min_split_len=4), [0, 30, 61], [1, 1, 1],
                        12, 3, 64, torch.float32, seed=splits)
    assert rel_err(out, ref) < 1e-5


@kernel_test
def test_decode_group_larger_than_head_block() -> None:
    """GQA group 32 > the kernel's 16-head block: two programs per KV head."""
    from radix_backend.kernels.triton_backend import TritonAttentionBackend
    out, ref = run_both(TritonAttentionBackend(num_kv_splits=2, min_split_len=8), [12, 25], [1, 1], 32, 1, 64,
                        torch.float32)
    assert rel_err(out, ref) < 1e-5


@kernel_test
def test_backend_reuses_plan_across_layers_and_replans_per_batch() -> None:
    from radix_backend.kernels.triton_backend import TritonAttentionBackend
    from radix_backend.kernels.torch_backend import TorchAttentionBackend
    backend = TritonAttentionBackend(min_split_len=8)
    for seed, (prefix, extend) in enumerate([([5, 17], [1, 1]), ([3, 0, 8], [4, 2, 1]), ([40], [1])]):
        q, k, v, kc, vc, meta = make_batch(prefix, extend, 4, 2, 64, torch.float32, seed)
        ref = TorchAttentionBackend().forward(q, k, v, kc.clone(), vc.clone(), meta, 0.1)
        backend.begin_forward(meta)
        for _layer in range(2):
            out = backend.forward(q, k, v, kc, vc, meta, 0.1)
            assert rel_err(out, ref) < 1e-5


@kernel_test
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_greedy_tokens_match_torch_backend(tiny_llama_dir, monkeypatch, dtype) -> None:
    """Whole engine on a tiny model: Triton attention (the invariant kernel, then, with batch
    invariance off, the split-K decode and extend kernels beside the Triton fused ops: the
    invariant Triton matmul has its own test, and under the interpreter it would take minutes
    here) gives the torch path's greedy tokens, on cold prompts (extend from prefix 0, decode) and
    on radix-cache hits (extend with prefix), in fp32 and in bf16 (weights and KV)."""
    from radix_backend import Engine, SamplingParams
    from radix_backend.kernels import ops
    prompts = ["The quick brown fox", "The quick brown fox jumps over", "Hello there"]
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    tokens = {}
    for name in ("torch", "triton", "triton+ops"):
        if name == "triton+ops":  # the model's norms, RoPE and MLP activation through Triton too
            from radix_backend.kernels import triton_ops
            monkeypatch.setattr(ops, "_use_triton", lambda x: True)
            calls = []
            real_rotary = triton_ops.apply_rotary
            monkeypatch.setattr(triton_ops, "apply_rotary", lambda *a: calls.append(1) or real_rotary(*a))
        with Engine(str(tiny_llama_dir), device=DEVICE, dtype=dtype, attention_backend=name.split("+")[0],
                    kv_cache_tokens=1024, batch_invariant=name != "triton+ops") as engine:
            cold = engine.generate(prompts, params)
            warm = engine.generate(prompts, params)
            assert all(o.meta.cached_tokens > 0 for o in warm)
            tokens[name] = [o.token_ids for o in cold + warm]
    assert tokens["triton"] == tokens["torch"]
    assert tokens["triton+ops"] == tokens["torch"] and calls


@kernel_test
@pytest.mark.slow
def test_smollm2_greedy_tokens_match_torch_backend() -> None:
    """The embedded SmolLM2 (30 layers, GQA 9:3, head dim 64) with Triton attention: same greedy
    tokens as the torch backend (itself checked against HF), cold and on a radix-cache hit."""
    from radix_backend import Engine, SamplingParams
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    tokens = {}
    for name in ("torch", "triton"):
        with Engine(device=DEVICE, attention_backend=name, kv_cache_tokens=2048) as engine:
            cold = engine.generate("The capital of France is", params)
            warm = engine.generate("The capital of France is a city", params)
            assert warm.meta.cached_tokens > 0
            tokens[name] = [cold.token_ids, warm.token_ids]
    assert tokens["triton"] == tokens["torch"]


def test_default_num_kv_splits_bounds() -> None:
    from radix_backend.kernels.triton_decode import default_num_kv_splits
    assert default_num_kv_splits(1, 1) == 16
    assert default_num_kv_splits(64, 8) == 1
    assert 1 <= default_num_kv_splits(8, 2, num_sms=132) <= 16


@kernel_test
def test_gpu_check_correctness_section_runs_on_these_kernels() -> None:
    """gpu_check's correctness section (quick shapes, windowed and soft-capped layers too) on the
    real Triton kernels, fp32 and bf16."""
    from radix_backend.bench import gpu_check as gc
    report = gc.Report()
    gc.check_attention(report, DEVICE, ["torch", "triton"], quick=True)
    gc.check_ops(report, DEVICE, quick=True)
    shapes = len(gc.correctness_shapes(quick=True))
    cases = shapes * (1 + len(gc.masked_cases(quick=True))) + len(gc.cascade_cases(quick=True))
    assert len(report.correctness) == 2 * cases + 2 * 4
    assert sum("ScoreMask(" in c["check"] for c in report.correctness) == 2 * len(gc.masked_cases(quick=True)) * shapes
    assert all(c["ok"] for c in report.correctness), [c for c in report.correctness if not c["ok"]]
    assert {c["dtype"] for c in report.correctness} == {"float32", "bfloat16"}


def test_dot_config_widens_bf16_only_under_the_interpreter() -> None:
    import triton.language as tl
    from radix_backend.kernels.triton_dot import dot_config
    assert dot_config(torch.bfloat16, interpreter=False).operand_dtype == tl.bfloat16
    assert dot_config(torch.bfloat16, interpreter=True).operand_dtype == tl.float32
    assert dot_config(torch.bfloat16, interpreter=True).precision == "ieee"
    assert dot_config(torch.float16, interpreter=True).operand_dtype == tl.float16
    assert dot_config(torch.float32, interpreter=False).precision == "ieee"
    with pytest.raises(ValueError, match="bfloat16"):
        dot_config(torch.int8)


def test_mismatched_heads_raise() -> None:
    from radix_backend.kernels.triton_decode import decode_attention
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(torch.randn(1, 5, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8),
                         torch.tensor([0, 1]), torch.tensor([1]), 1.0)


# ----------------------------------------------------------------------------- fused ops

OPS_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ops_tol(dtype: torch.dtype) -> dict:
    # The interpreter rounds bf16 by truncation, so allow one bf16 ulp there.
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3),
            torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}[dtype]


@kernel_test
@pytest.mark.parametrize("dtype", OPS_DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 576])
def test_triton_rms_norm(dtype, hidden) -> None:
    from radix_backend.kernels import ops, triton_ops
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=g).to(dtype).to(DEVICE)
    r = torch.randn(7, hidden, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(hidden, generator=g).to(dtype).to(DEVICE)
    torch.testing.assert_close(triton_ops.rms_norm(x, w, 1e-5), ops.rms_norm_torch(x, w, 1e-5), **ops_tol(dtype))
    y, res = triton_ops.fused_add_rms_norm(x, r, w, 1e-5)
    y_ref, res_ref = ops.fused_add_rms_norm_torch(x, r, w, 1e-5)
    torch.testing.assert_close(res, res_ref, **ops_tol(dtype))
    torch.testing.assert_close(y, y_ref, **ops_tol(dtype))


@kernel_test
def test_triton_rms_norm_strided_3d_input() -> None:
    from radix_backend.kernels import ops, triton_ops
    x = torch.randn(3, 4, 128, device=DEVICE)[:, :, :64]  # non-contiguous rows
    w = torch.randn(64, device=DEVICE)
    torch.testing.assert_close(triton_ops.rms_norm(x, w, 1e-6), ops.rms_norm_torch(x, w, 1e-6), rtol=1e-5, atol=1e-5)


@kernel_test
@pytest.mark.parametrize("dtype", OPS_DTYPES)
@pytest.mark.parametrize("d", [5, 64, 1536])
def test_triton_silu_and_mul(dtype, d) -> None:
    from radix_backend.kernels import ops, triton_ops
    x = torch.randn(2, 3, 2 * d, generator=torch.Generator().manual_seed(d)).to(dtype).to(DEVICE)
    torch.testing.assert_close(triton_ops.silu_and_mul(x), ops.silu_and_mul_torch(x), **ops_tol(dtype))


@kernel_test
@pytest.mark.parametrize("dtype", OPS_DTYPES)
@pytest.mark.parametrize("hq,hkv,dim,rot", [(9, 3, 64, 64), (4, 4, 128, 128), (20, 4, 96, 48)])
def test_triton_rotary(dtype, hq, hkv, dim, rot) -> None:
    from radix_backend.kernels import ops, triton_ops
    g = torch.Generator().manual_seed(dim + hq)
    cache = ops.build_cos_sin_cache(ops.default_inv_freq(rot, 10000.0), 128).to(DEVICE)
    qkv = torch.randn(11, (hq + 2 * hkv) * dim, generator=g).to(dtype).to(DEVICE)
    # Strided views of a fused qkv projection, as the model passes them.
    q = qkv[:, : hq * dim].reshape(11, hq, dim)
    k = qkv[:, hq * dim: (hq + hkv) * dim].reshape(11, hkv, dim)
    pos = torch.randint(0, 128, (11,), generator=g).to(DEVICE)
    q_before, k_before = q.clone(), k.clone()
    q2, k2 = triton_ops.apply_rotary(q, k, pos, cache)
    q_ref, k_ref = ops.apply_rotary_torch(q, k, pos, cache)
    torch.testing.assert_close(q2, q_ref, **ops_tol(dtype))
    torch.testing.assert_close(k2, k_ref, **ops_tol(dtype))
    assert torch.equal(q, q_before) and torch.equal(k, k_before), "apply_rotary is out of place"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_ops_dispatch_to_triton_on_cuda(monkeypatch) -> None:
    from radix_backend.kernels import ops, triton_ops
    called = []
    monkeypatch.setattr(triton_ops, "rms_norm", lambda *a: called.append(1) or ops.rms_norm_torch(*a))
    ops.rms_norm(torch.randn(2, 8, device="cuda"), torch.ones(8, device="cuda"), 1e-6)
    assert called
