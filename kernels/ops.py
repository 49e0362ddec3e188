"""Layer ops the model calls: linear, RMSNorm (+ residual add), SiLU-and-mul and neox-style RoPE.

`linear` runs fp32 CPU matmuls through oneDNN (torch's own build), the rest are fused kernels.

Each public function has a pure-torch implementation (`*_torch`, the test reference), a Triton
kernel (`triton_ops.py`) used for CUDA tensors when Triton imports, and a native C kernel
(`native.py`) used for fp32 CPU tensors when a C compiler is there. The kernel settings
(`settings.py`, from `EngineConfig.triton_ops` / `native_kernels`) keep either off.

RoPE cache layout (`cos_sin_cache`): a float tensor [max_pos, rot_dim]; row p holds
`cos(p * inv_freq)` in columns [0, rot_dim/2) and `sin(p * inv_freq)` in [rot_dim/2, rot_dim),
where inv_freq has rot_dim/2 entries. Rotation is neox style ("rotate half", as HF Llama):
the first rot_dim features of each head are split into halves x1, x2 and become
(x1*cos - x2*sin, x2*cos + x1*sin); features past rot_dim pass through unchanged.
Build it with `build_cos_sin_cache` (keep it fp32: the kernels upcast anyway).
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from . import native, settings
from .q4 import DenseWeight, q4_matmul


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and settings.current().triton_ops and triton_available()


# ----------------------------------------------------------------------------- public API
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias). On a GPU with batch invariance (the default kernel settings) and
    Triton: the fixed-configuration Triton matmul (`triton_matmul`; cuBLAS picks its kernel by the
    row count). fp32 on the CPU: with batch invariance and the native kernels built, our
    fixed-order kernel (`fixed_order_linear`); otherwise oneDNN's
    matmul, which torch ships for its bf16 linears anyway: torch.nn.functional.linear's fp32 BLAS
    (MKL) reaches 40-45 % of its speed on the AMD EPYC measured (1024 x 576 @ 576 x 3072 on 2
    threads: 18.2 vs 8.0 ms; 17 rows: 0.66 vs 0.25 ms), with the same fp32 accuracy."""
    current = settings.current()
    if current.batch_invariant and _use_triton(x) and x.dtype == weight.dtype:
        from . import triton_matmul
        return triton_matmul.invariant_linear(x, weight, bias)
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu":
        if current.batch_invariant and current.native and native.available():
            return fixed_order_linear(x, weight, bias)
        if weight.is_contiguous() and onednn_linear_available():
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def fixed_order_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 x [..., K] @ weight^T (+ bias) on the CPU, each output summed in one order fixed by K
    alone (csrc/f32_matmul.c), so a row's result never depends on how many rows came with it: no
    BLAS promises that (oneDNN sums one row in another order than many; MKL's split over threads
    changes with the row count)."""
    flat = x.reshape(-1, weight.shape[1])
    out = q4_matmul(flat, DenseWeight(weight, bias), threads=settings.matmul_threads())
    return out.view(*x.shape[:-1], weight.shape[0])


@functools.lru_cache(maxsize=1)
def onednn_linear_available() -> bool:
    """Whether torch's oneDNN linear runs here (and agrees with F.linear on a small product)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    x, w, b = torch.randn(3, 40), torch.randn(5, 40), torch.randn(5)
    try:
        got = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    except RuntimeError:
        return False
    return bool(torch.allclose(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim (fp32 statistics, as HF LlamaRMSNorm); returns x.dtype."""
    _check_norm_args(x, weight)
    if _use_triton(x):
        from . import triton_ops
        return triton_ops.rms_norm(x, weight, eps)
    if native.supports(x, weight):
        return native.add_rms_norm(None, x, weight, eps)[0]
    return rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual; returns (rms_norm(new_residual), new_residual). Inputs untouched."""
    _check_norm_args(x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} must equal x shape {tuple(x.shape)}")
    if _use_triton(x):
        from . import triton_ops
        return triton_ops.fused_add_rms_norm(x, residual, weight, eps)
    if native.supports(x, residual, weight):
        return native.add_rms_norm(x, residual, weight, eps)
    return fused_add_rms_norm_torch(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor, fp32_math: bool = False) -> torch.Tensor:
    """x [..., 2d] = cat(gate, up) -> silu(gate) * up, shape [..., d] (Llama MLP activation).

    `fp32_math`: compute a bf16/fp16 x in fp32 and round once (the quantized CPU path, whose dense
    bf16 GEMMs hand bf16 to each other); default: the dtype's own arithmetic, as HF computes."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim (gate and up halves), got {x.shape[-1]}")
    if fp32_math and x.dtype != torch.float32:
        if native.supports(x, dtypes=(torch.bfloat16,)):
            return native.silu_and_mul(x)
        return silu_and_mul(x.float()).to(x.dtype)
    if _use_triton(x):
        from . import triton_ops
        return triton_ops.silu_and_mul(x)
    if native.supports(x):
        return native.silu_and_mul(x)
    return silu_and_mul_torch(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] = cat(gate, up) -> gelu_tanh(gate) * up, shape [..., d] (Gemma's GeGLU, HF's
    `gelu_pytorch_tanh`), in x's dtype as HF computes it."""
    if x.shape[-1] % 2:
        raise ValueError(f"gelu_tanh_and_mul needs an even last dim (gate and up halves), got {x.shape[-1]}")
    if native.supports(x):
        return native.gelu_tanh_and_mul(x)
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE. q [T, Hq, D], k [T, Hkv, D], positions [T] int; returns new (q, k).

    cos_sin_cache is [max_pos, rot_dim] (see the module docstring), rot_dim <= D and even.
    """
    _check_rotary_args(q, k, positions, cos_sin_cache)
    if _use_triton(q):
        from . import triton_ops
        return triton_ops.apply_rotary(q, k, positions, cos_sin_cache)
    if native.supports(q, k, cos_sin_cache) and native.head_rows_ok(q) and native.head_rows_ok(k):
        cos_sin_cache = cos_sin_cache.contiguous()
        return native.rope(q, positions, cos_sin_cache), native.rope(k, positions, cos_sin_cache)
    return apply_rotary_torch(q, k, positions, cos_sin_cache)


def default_inv_freq(rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    """Plain RoPE frequencies (HF `rope_type="default"`): base ** (-2i / rot_dim), fp32, on the CPU
    whatever the default device (on the meta device these ops would import torch._dynamo)."""
    if rot_dim <= 0 or rot_dim % 2:
        raise ValueError(f"rot_dim must be a positive even number, got {rot_dim}")
    return 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64, device="cpu").float() / rot_dim))


def build_cos_sin_cache(inv_freq: torch.Tensor, max_pos: int, attention_scaling: float = 1.0,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """[max_pos, 2 * len(inv_freq)] fp32 table in the layout above.

    Pass HF's inv_freq (e.g. from `ROPE_INIT_FUNCTIONS[rope_type](config, device)`) to get the
    scaled variants (llama3, yarn...); `attention_scaling` multiplies cos and sin as HF does.
    """
    inv = inv_freq.detach().to(device=device or inv_freq.device, dtype=torch.float32)
    t = torch.arange(max_pos, dtype=torch.float32, device=inv.device)
    freqs = torch.outer(t, inv)
    return torch.cat([freqs.cos() * attention_scaling, freqs.sin() * attention_scaling], dim=-1).contiguous()


# ----------------------------------------------------------------------------- torch paths

def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype)).to(x.dtype)


def fused_add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual.to(x.dtype)
    return rms_norm_torch(new_residual, weight, eps), new_residual


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def apply_rotary_torch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                       cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rot = cos_sin_cache.shape[-1]
    cs = cos_sin_cache.index_select(0, positions.to(torch.long)).float()
    cos, sin = cs[:, None, : rot // 2], cs[:, None, rot // 2:]  # [T, 1, rot/2]
    return _rotate(q, cos, sin, rot), _rotate(k, cos, sin, rot)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    xf = x[..., :rot].float()
    x1, x2 = xf[..., : rot // 2], xf[..., rot // 2:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    if rot == x.shape[-1]:
        return rotated
    return torch.cat([rotated, x[..., rot:]], dim=-1)


# ----------------------------------------------------------------------------- validation

def _check_norm_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be 1-D of size {x.shape[-1]} (x's last dim), got {tuple(weight.shape)}")


def _check_rotary_args(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                       cos_sin_cache: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [tokens, heads, head_dim], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or positions.shape != (q.shape[0],):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and positions {tuple(positions.shape)} "
                         "must agree on tokens and head_dim")
    rot = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rot % 2 or rot > q.shape[2]:
        raise ValueError(f"cos_sin_cache must be [max_pos, rot_dim] with even rot_dim <= head_dim "
                         f"{q.shape[2]}, got {tuple(cos_sin_cache.shape)}")
