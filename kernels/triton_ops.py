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
def _rotary_kernel(X, OUT, POS, CACHE, stride_xt, stride_xh, stride_ot, stride_oh, stride_c,
                   H, HALF, HEAD_DIM, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (token, head block): out = x*cos + rotate_half(x)*sin on the first 2*HALF features,
    a copy past them. Out of place, one pass: the partner feature (d +- HALF) is a second load."""
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    rot = 2 * HALF
    in_rot = d < rot
    first = d < HALF
    partner = tl.where(first, d + HALF, tl.where(in_rot, d - HALF, d))
    pos = tl.load(POS + tok).to(tl.int64)
    freq = tl.where(first, d, d - HALF)
    cos = tl.load(CACHE + pos * stride_c + freq, mask=in_rot, other=1.0).to(tl.float32)
    sin = tl.load(CACHE + pos * stride_c + HALF + freq, mask=in_rot, other=0.0).to(tl.float32)
    sign = tl.where(first, -1.0, 1.0)
    mask = (heads < H)[:, None] & (d < HEAD_DIM)[None, :]
    row = X + tok * stride_xt + heads[:, None] * stride_xh
    x = tl.load(row + d[None, :], mask=mask, other=0.0)
    xp = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    y = x.to(tl.float32) * cos[None, :] + sign[None, :] * xp * sin[None, :]
    tl.store(OUT + tok * stride_ot + heads[:, None] * stride_oh + d[None, :], y.to(x.dtype), mask=mask)


def _rotate(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    n_tokens, heads, dim = x.shape
    out = torch.empty((n_tokens, heads, dim), dtype=x.dtype, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if n_tokens and heads:
        block_h = min(triton.next_power_of_2(heads), 16)
        _rotary_kernel[(n_tokens, triton.cdiv(heads, block_h))](
            x, out, positions, cache, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cache.stride(0),
            heads, cache.shape[-1] // 2, dim, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(dim))
    return out


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place: new contiguous q and k (features past rot_dim are copied through)."""
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    return _rotate(q, positions, cache), _rotate(k, positions, cache)
