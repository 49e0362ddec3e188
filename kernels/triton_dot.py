"""What the Triton attention kernels share: how they feed tl.dot (operand dtype and input
precision per input dtype), the gather of one K tile through the slot table (`cache_tile`) and the
online-softmax step that folds one K/V tile into a running output (`attend_tile`), both inlined
into the decode, extend and invariant kernels.

On a GPU the operands keep the input dtype (bf16/fp16 tensor-core dots accumulating in fp32;
fp32 inputs use exact "ieee" dots so fp32 results match the torch reference to rounding).
Triton's CPU interpreter (TRITON_INTERPRET=1) computes bf16 dots on the raw bits, so there bf16
operands are widened to fp32 first. The widening is exact (bf16 values and their pairwise
products are exact in fp32), so the interpreter still computes what the tensor cores compute,
up to summation order, and bf16 attention is checked on CPU too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
LOG2E = 1.4426950408889634  # the kernels' softmax runs in exp2: scores are scaled by scale * LOG2E


def gqa_group(num_q_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head; a head count that does not divide is an error."""
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    return num_q_heads // num_kv_heads


@dataclass(frozen=True)
class DotConfig:
    """Constexpr arguments of a kernel's tl.dot calls."""

    operand_dtype: tl.dtype
    precision: str  # tl.dot input_precision


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_config(dtype: torch.dtype, interpreter: bool | None = None) -> DotConfig:
    if dtype not in _TL_DTYPES:
        raise ValueError(f"attention kernels take float32, float16 or bfloat16 inputs, got {dtype}")
    if interpreter is None:
        interpreter = interpreting()
    operand = tl.float32 if interpreter and dtype == torch.bfloat16 else _TL_DTYPES[dtype]
    # "tf32" only matters for fp32 operands, which here are always meant exact.
    return DotConfig(operand, "ieee" if operand == tl.float32 else "tf32")


@triton.jit
def soft_cap(x, cap):
    """cap * tanh(x / cap) (Gemma 2's attention logit soft-capping), written as the native kernel
    does: tanh|y| = (1 - e) / (1 + e) with e = exp(-2|y|) <= 1 (no overflow), the sign put back."""
    y = x / cap
    e = tl.exp2(tl.abs(y) * -2.8853900817779268)  # exp(-2|y|): -2 * LOG2E
    t = (1.0 - e) / (1.0 + e)
    return tl.where(y < 0, -t, t) * cap


@triton.jit
def attend_tile(q, k, v_ptrs, kv_mask, score_mask, acc, m_i, l_i, sm_scale_log2, softcap_log2,
                HAS_SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one K/V tile into the running (acc, m_i, l_i) of rows q (log2-domain online softmax).

    `k` is the loaded key tile; V is loaded here from `v_ptrs` (under `kv_mask`) only after the
    scores, as a hand-written loop would. With HAS_SOFTCAP the scaled scores are soft-capped before
    the mask (`softcap_log2` = cap * LOG2E: capping in the log2 domain is the same function).
    Scores outside `score_mask` are -inf; a row that has seen no key yet keeps m_i = -inf and adds
    nothing (no NaN). Returns (acc, m_i, l_i).
    """
    qk = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(q.dtype).to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    qk = qk * sm_scale_log2
    if HAS_SOFTCAP:
        qk = soft_cap(qk, softcap_log2)
    qk = tl.where(score_mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype).to(DOT_DTYPE), v.to(q.dtype).to(DOT_DTYPE),
                                        input_precision=DOT_PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def cache_tile(K_CACHE, V_CACHE, KV_INDICES, kv_start, offs_n, nmask, kv_head, offs_d, dmask,
               stride_kt, stride_kh, stride_vt, stride_vh):
    """Keys `offs_n` (under `nmask`) of one sequence whose slots start at KV_INDICES + kv_start:
    the loaded K tile, the V tile's pointers (`attend_tile` loads it after the scores) and the mask."""
    kv_mask = nmask[:, None] & dmask[None, :]
    slots = tl.load(KV_INDICES + kv_start + offs_n, mask=nmask, other=0).to(tl.int64)
    k = tl.load(K_CACHE + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v_ptrs = V_CACHE + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
    return k, v_ptrs, kv_mask
