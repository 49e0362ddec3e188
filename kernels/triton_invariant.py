"""Batch-invariant Triton attention: one kernel for decode and extend rows whose arithmetic per row
is fixed by the row alone (its position, its keys), never by its batch-mates, by where its prefill
was split into chunks, or by whether its prefix came from the cache.

How (the same three rules as SGLang's and vLLM's deterministic modes, in one kernel):
- every key, the new tokens' too, is read from the KV cache (`store_kv` runs first), in BLOCK_N
  tiles aligned at absolute positions 0, BLOCK_N, 2 BLOCK_N, ...: no prefix / new-token stages
  whose boundary would move with the chunking, no split-K whose count would follow the batch;
- a tile past a row's own position adds exact zeros (scores -inf, alpha 1, p 0), so the extra
  tiles a program visits for its later rows leave an earlier row's bits alone;
- one tile shape per model: a program holds TOKENS consecutive new tokens x the GROUP query heads
  of one KV head as its BLOCK_M rows, a decode row (one token) and an extend row alike, and the
  launch configuration depends on the dtype, head size and group only.
tl.dot computes each output element from its own row and column, so the other rows of a tile do
not change a row's result.
A sliding window (Mistral, Gemma's local layers) masks keys before a row's window as it masks
those past its position, and the tiles wholly before every row's window are skipped: they would
add exact zeros, and the tiles read stay on the grid of absolute positions. Soft-capped scores
(Gemma 2) are capped before the mask (`attend_tile`).
Slower than the split-K decode kernel at small batch and long context (one program per request
and KV head); `gpu_check` times both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_base import PLAIN, ScoreMask
from .triton_dot import LOG2E, attend_tile, cache_tile, dot_config, gqa_group
from .triton_extend import ExtendConfig


@triton.jit
def _invariant_kernel(Q, K_CACHE, V_CACHE, QO_INDPTR, KV_INDPTR, KV_INDICES, O, sm_scale_log2,
                      stride_qt, stride_qh, stride_kct, stride_kch, stride_vct, stride_vch, stride_ot, stride_oh,
                      GROUP, HEAD_DIM, TOKENS, WINDOW, softcap_log2,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                      DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    block = tl.program_id(2)

    q_start = tl.load(QO_INDPTR + b)
    extend_len = tl.load(QO_INDPTR + b + 1) - q_start
    if block * TOKENS >= extend_len:
        return
    kv_start = tl.load(KV_INDPTR + b)
    seq_len = tl.load(KV_INDPTR + b + 1) - kv_start
    prefix_len = seq_len - extend_len

    r = tl.arange(0, BLOCK_M)
    token = block * TOKENS + r // GROUP
    head = kv_head * GROUP + r % GROUP
    rmask = (r < TOKENS * GROUP) & (token < extend_len)
    pos = prefix_len + token  # each row's absolute position: it sees keys 0..pos
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    rows = (q_start + token).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    last = tl.minimum(seq_len, prefix_len + (block + 1) * TOKENS)  # keys this program's rows see
    first = 0
    if HAS_WINDOW:  # the tile holding the first row's first visible key
        first = tl.maximum(prefix_len + block * TOKENS - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(first, last, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        nmask = offs_n < last
        k, v_ptrs, kv_mask = cache_tile(K_CACHE, V_CACHE, KV_INDICES, kv_start, offs_n, nmask, kv_head, offs_d, dmask,
                                        stride_kct, stride_kch, stride_vct, stride_vch)
        visible = (offs_n[None, :] <= pos[:, None]) & nmask[None, :]
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > pos[:, None] - WINDOW)
        acc, m_i, l_i = attend_tile(q, k, v_ptrs, kv_mask, visible, acc, m_i, l_i, sm_scale_log2, softcap_log2,
                                    HAS_SOFTCAP, DOT_DTYPE, DOT_PRECISION)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(O + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def invariant_config(head_dim: int, group: int, dtype: torch.dtype, on_gpu: bool) -> ExtendConfig:
    """The one launch configuration (rows per program, keys per tile) of a model's attention, fixed
    by the model (dtype, head size, GQA group), never by a batch. 64 rows x 64 keys for 16-bit types
    on a GPU; fp32 and wide heads take smaller tiles (registers); the interpreter 16."""
    base = 64 if on_gpu and dtype != torch.float32 and head_dim <= 128 else (32 if on_gpu else 16)
    block_m = max(base, triton.next_power_of_2(group))
    block_n = 64 if base == 64 else base
    return ExtendConfig(block_m, block_n, 4 if block_m <= 64 else 8, 2 if on_gpu else 1)


def invariant_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr: torch.Tensor,
                        kv_indptr: torch.Tensor, kv_indices: torch.Tensor, max_extend_len: int,
                        scale: float, mask: ScoreMask = PLAIN) -> torch.Tensor:
    """q [T, Hq, D] new queries (decode rows are 1-token extends); every key, the new ones
    included, comes from the cache through kv_indices (prefix and new slots of request b at
    kv_indptr[b]..); `mask`: a sliding window and/or soft-capped scores. Returns [T, Hq, D] in
    q.dtype."""
    n_tokens, hq, dim = q.shape
    hkv = k_cache.shape[1]
    group = gqa_group(hq, hkv)
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    bsz = qo_indptr.shape[0] - 1
    if n_tokens == 0 or bsz == 0:
        return out
    cfg = invariant_config(dim, group, q.dtype, q.is_cuda)
    tokens = cfg.block_m // group
    dot = dot_config(q.dtype)
    grid = (bsz, hkv, triton.cdiv(max_extend_len, tokens))
    _invariant_kernel[grid](
        q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, out, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), group, dim, tokens, mask.window or 0, (mask.softcap or 0.0) * LOG2E,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=triton.next_power_of_2(dim),
        HAS_WINDOW=mask.window is not None, HAS_SOFTCAP=mask.softcap is not None,
        DOT_DTYPE=dot.operand_dtype, DOT_PRECISION=dot.precision, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out
