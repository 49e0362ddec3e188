"""Triton extend (prefill with a cached prefix) attention over the slot-indexed KV cache.

Request b contributes new tokens q[qo_indptr[b]:qo_indptr[b+1]] at positions prefix_len ..
seq_len-1. Each program owns BLOCK_M new tokens of one query head and runs an online softmax in
two stages: (1) over the cached prefix, whose K/V rows are gathered through the slot table
`kv_indices[kv_indptr[b] : kv_indptr[b] + prefix_len]`, no mask needed; (2) over the new tokens'
own K/V, read contiguously from the k/v inputs, with the causal mask. Splitting the stages keeps
the gather off the causal part and the mask off the prefix part.
Modelled on SGLang's triton_ops/extend_attention.py, written from scratch here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_dot import LOG2E, attend_tile, cache_tile, dot_config, gqa_group



@triton.jit
def _extend_kernel(Q, K, V, K_CACHE, V_CACHE, QO_INDPTR, KV_INDPTR, KV_INDICES, O,
                   sm_scale_log2, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_kct, stride_kch, stride_vct, stride_vch, stride_ot, stride_oh, GROUP, HEAD_DIM,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    b = tl.program_id(0)
    head = tl.program_id(1)
    block_m = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(QO_INDPTR + b)
    extend_len = tl.load(QO_INDPTR + b + 1) - q_start
    if block_m * BLOCK_M >= extend_len:
        return
    kv_start = tl.load(KV_INDPTR + b)
    prefix_len = tl.load(KV_INDPTR + b + 1) - kv_start - extend_len

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < extend_len
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Stage 1: the cached prefix, every new token sees all of it.
    for start in range(0, prefix_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        nmask = offs_n < prefix_len
        k, v_ptrs, kv_mask = cache_tile(K_CACHE, V_CACHE, KV_INDICES, kv_start, offs_n, nmask, kv_head, offs_d, dmask,
                                        stride_kct, stride_kch, stride_vct, stride_vch)
        acc, m_i, l_i = attend_tile(q, k, v_ptrs, kv_mask, nmask[None, :], acc, m_i, l_i, sm_scale_log2, 0.0, False,
                                    DOT_DTYPE, DOT_PRECISION)

    # Stage 2: the new tokens themselves, causal. Keys past this block's last row are never seen;
    # rows past extend_len see nothing.
    end = tl.minimum((block_m + 1) * BLOCK_M, extend_len)
    for start in range(0, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        nmask = offs_n < extend_len
        kv_mask = nmask[:, None] & dmask[None, :]
        krows = (q_start + offs_n).to(tl.int64)
        k = tl.load(K + krows[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        causal = (offs_m[:, None] >= offs_n[None, :]) & nmask[None, :]
        v_ptrs = V + krows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
        acc, m_i, l_i = attend_tile(q, k, v_ptrs, kv_mask, causal, acc, m_i, l_i, sm_scale_log2, 0.0, False,
                                    DOT_DTYPE, DOT_PRECISION)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(O + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=mmask[:, None] & dmask[None, :])


@dataclass(frozen=True)
class ExtendConfig:
    """Launch configuration of the extend kernel (tile sizes, warps, software-pipelining stages)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int = 1


# Shared memory per block from which the 128x128-tile, 3-stage config fits (Hopper: 227 KiB; an
# A100's 163 KiB or a consumer GPU's ~100 KiB do not).
LARGE_TILE_SMEM = 200 * 1024


def extend_block_sizes(head_dim: int, dtype: torch.dtype, on_gpu: bool, smem_per_block: int = 0) -> ExtendConfig:
    """Default config: SGLang-like 128x64 tiles for 16-bit types; smaller for fp32 / wide heads.

    With room for them, 128x128 tiles pipelined over 3 stages: on an H200 the extend of 8 x 512
    tokens over 1024 cached ones (32/8 heads of 128) took 0.377 ms against 0.448 with 128x64,
    a 4 x 1024 prefill 0.206 against 0.201 (`bench.gpu_check`'s sweep)."""
    block_d = triton.next_power_of_2(head_dim)
    if not on_gpu:
        return ExtendConfig(16, 16, 4)
    if dtype == torch.float32 or block_d > 128:
        return ExtendConfig(32, 32, 4)
    if block_d == 128 and smem_per_block >= LARGE_TILE_SMEM:
        return ExtendConfig(128, 128, 8, 3)
    return ExtendConfig(128, 64, 4 if block_d <= 64 else 8)


@functools.cache
def shared_memory_per_block(device_index: int) -> int:
    """Opt-in shared memory per block of a CUDA device, in bytes (0 where unknown)."""
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0))


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, max_extend_len: int, scale: float,
                     out: torch.Tensor | None = None, config: ExtendConfig | None = None) -> torch.Tensor:
    """q [T, Hq, D] new queries, k/v [T, Hkv, D] their keys/values; the prefix comes from the cache.

    kv_indices for request b lists its prefix slots first; only those are read here (the new
    tokens' K/V are taken from k/v directly). Returns [T, Hq, D] in q.dtype.
    """
    n_tokens, hq, dim = q.shape
    hkv = k.shape[1]
    group = gqa_group(hq, hkv)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if out is None:
        out = torch.empty_like(q)
    bsz = qo_indptr.shape[0] - 1
    if n_tokens == 0 or bsz == 0:
        return out
    cfg = config or extend_block_sizes(dim, q.dtype, q.is_cuda,
                                       shared_memory_per_block(q.device.index or 0) if q.is_cuda else 0)
    dot = dot_config(q.dtype)
    grid = (bsz, hq, triton.cdiv(max_extend_len, cfg.block_m))
    _extend_kernel[grid](
        q, k, v, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, out, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), group, dim,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=triton.next_power_of_2(dim),
        DOT_DTYPE=dot.operand_dtype, DOT_PRECISION=dot.precision, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out
