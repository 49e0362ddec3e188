"""Batch-invariant linear layers on a GPU: x @ W^T (+ bias) with one launch configuration per
dtype, so each output element is summed over K in one order whatever the row count.

cuBLAS picks its kernel (tile shape, split-K) from the matrix sizes, so one row's result changes
with how many rows came with it; the batch-invariant modes of SGLang and vLLM replace it by a
fixed-configuration Triton matmul, as here: BLOCK_K-wide steps in ascending K, accumulated in
fp32 by tl.dot (bf16/fp16 tensor-core products; exact "ieee" products for fp32), no split-K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_dot import dot_config


@triton.jit
def _matmul_kernel(X, W, BIAS, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < M
    nmask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        x = tl.load(X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(W + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def matmul_config(dtype: torch.dtype, on_gpu: bool) -> MatmulConfig:
    """One configuration per dtype and device kind, never per shape (that is the invariance)."""
    if not on_gpu:
        return MatmulConfig(16, 16, 16, 4, 1)
    if dtype == torch.float32:
        return MatmulConfig(32, 64, 32, 4, 2)
    return MatmulConfig(64, 64, 64, 4, 3)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias[N]) in x's dtype, every row's sums in one fixed order."""
    if x.dtype != weight.dtype:
        raise ValueError(f"x ({x.dtype}) and weight ({weight.dtype}) must share a dtype")
    n, k = weight.shape
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = flat.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        cfg = matmul_config(x.dtype, x.is_cuda)
        dot = dot_config(x.dtype)
        grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
        _matmul_kernel[grid](flat, weight, bias if bias is not None else weight, out, m, n, k,
                             flat.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                             DOT_DTYPE=dot.operand_dtype, DOT_PRECISION=dot.precision,
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.view(*x.shape[:-1], n)
