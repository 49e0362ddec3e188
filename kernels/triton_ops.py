"""Triton kernels behind `ops.py` (RMSNorm (+residual), SiLU-and-mul, neox RoPE).

Called by ops.py for CUDA tensors; the tests also call them directly on CPU tensors under
TRITON_INTERPRET=1. Statistics and arithmetic run in fp32; results are cast to the input dtype
at the same points as the torch reference so fp32 results agree to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# ----------------------------------------------------------------------------- RMSNorm

@triton.jit
def _rms_norm_kernel(X, R, W, Y, RES_OUT, stride_x, stride_r, stride_y, stride_ro, N, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        # Round the sum to the input dtype first, as `x + residual` does in torch.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(RES_OUT + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / N
    normed = (h * (1.0 / tl.sqrt(var + eps))).to(x.dtype).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (w * normed).to(x.dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = _rows(residual.to(x.dtype))
        res_out = torch.empty_like(y)
    else:
        r2 = res_out = y  # unused when HAS_RESIDUAL is False
    block = triton.next_power_of_2(n)
    num_warps = min(max(block // 256, 1), 16)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, y, res_out, x2.stride(0), r2.stride(0), y.stride(0), res_out.stride(0), n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps)
    new_res = res_out.view(x.shape) if residual is not None else None
    return y.view(x.shape), new_res


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, res = _norm(x, residual, weight, eps)
    assert res is not None
    return y, res


# ----------------------------------------------------------------------------- SiLU and mul

@triton.jit
def _silu_and_mul_kernel(X, Y, stride_x, stride_y, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(Y + row * stride_y + cols, out.to(Y.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = _rows(x)
    y = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(d), 1024)
    if x2.shape[0] and d:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, y, x2.stride(0), y.stride(0), d, BLOCK=block)
    return y.view(*x.shape[:-1], d)


# ----------------------------------------------------------------------------- RoPE

@triton.jit
def _rotary_kernel(Q, K, POS, CACHE, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
                   HQ, HKV, HALF, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One program per token rotates all its q and k heads in place (first 2*HALF features)."""
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + tok).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    dmask = offs < HALF
    cos = tl.load(CACHE + pos * stride_c + offs, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(CACHE + pos * stride_c + HALF + offs, mask=dmask, other=0.0).to(tl.float32)[None, :]
    heads = tl.arange(0, BLOCK_H)
    for h0 in range(0, HQ, BLOCK_H):
        hm = ((h0 + heads) < HQ)[:, None] & dmask[None, :]
        p = Q + tok * stride_qt + (h0 + heads)[:, None] * stride_qh + offs[None, :]
        x1 = tl.load(p, mask=hm, other=0.0)
        x2 = tl.load(p + HALF, mask=hm, other=0.0)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(p, (a * cos - b * sin).to(x1.dtype), mask=hm)
        tl.store(p + HALF, (b * cos + a * sin).to(x1.dtype), mask=hm)
    for h0 in range(0, HKV, BLOCK_H):
        hm = ((h0 + heads) < HKV)[:, None] & dmask[None, :]
        p = K + tok * stride_kt + (h0 + heads)[:, None] * stride_kh + offs[None, :]
        x1 = tl.load(p, mask=hm, other=0.0)
        x2 = tl.load(p + HALF, mask=hm, other=0.0)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(p, (a * cos - b * sin).to(x1.dtype), mask=hm)
        tl.store(p + HALF, (b * cos + a * sin).to(x1.dtype), mask=hm)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place: rotates copies of q and k (features past rot_dim are copied through)."""
    q_out = q.clone(memory_format=torch.contiguous_format)
    k_out = k.clone(memory_format=torch.contiguous_format)
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = cache.shape[-1] // 2
    n_tokens = q.shape[0]
    if n_tokens and half:
        block_h = min(triton.next_power_of_2(max(q.shape[1], k.shape[1])), 16)
        _rotary_kernel[(n_tokens,)](
            q_out, k_out, positions, cache, q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cache.stride(0), q.shape[1], k.shape[1], half,
            BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(half))
    return q_out, k_out
