"""Attention with a sliding window and/or soft-capped scores, in plain torch, over the paged pool.

Why: Mistral, Qwen2 (`use_sliding_window`), Phi-3 and Gemma's local layers let a query see only
the last `window` keys (HF's sliding-window mask: key j is visible from query i when
i - window < j <= i), and Gemma 2 soft-caps every score (`cap * tanh(score / cap)`) before the
mask. The native CPU kernels and the Triton invariant kernel apply both masks themselves; the
torch and FlashInfer backends hand a batch with either mask here, so the product never runs
such a model with full attention. The KV of every token stays in the
pool (the radix cache may share it), so a cached prefix longer than the window gives the same
tokens as a cold run: the window is applied when reading, never by dropping keys.

Each request is one product in fp32 (HF's eager attention computes its softmax in fp32), over
only the keys its queries can see, its queries cut into chunks so the score matrix stays small.
"""

from __future__ import annotations

import torch

from .attention_base import AttentionMetadata, ScoreMask

# Query rows per product: bounds the score matrix at rows x keys x heads fp32 values.
QUERY_CHUNK = 256


def first_visible_key(position: int, window: int | None) -> int:
    """The earliest key position a query at `position` sees."""
    return 0 if window is None else max(0, position - window + 1)


def masked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, mask: ScoreMask) -> torch.Tensor:
    """q [T, Hq, D] of the batch's new tokens (K/V already in the pool) -> out [T, Hq, D]."""
    tokens, hq, dim = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    out = torch.empty_like(q)
    kv_ptr, qo_ptr = meta.kv_indptr.tolist(), meta.qo_indptr.tolist()
    for i, (prefix, extend) in enumerate(zip(meta.prefix_lens_cpu, meta.extend_lens_cpu)):
        for row in range(0, extend, QUERY_CHUNK):
            rows = min(QUERY_CHUNK, extend - row)
            first_pos = prefix + row
            lo = first_visible_key(first_pos, mask.window)
            hi = first_pos + rows  # keys [lo, hi) cover every query of the chunk
            slots = meta.kv_indices[kv_ptr[i] + lo:kv_ptr[i] + hi]
            keys = k_cache.index_select(0, slots).float()  # [L, Hkv, D]
            values = v_cache.index_select(0, slots).float()
            start = qo_ptr[i] + row
            queries = q[start:start + rows].float().view(rows, hkv, group, dim)
            scores = torch.einsum("rhgd,lhd->hgrl", queries, keys) * scale
            if mask.softcap is not None:
                scores = torch.tanh(scores / mask.softcap) * mask.softcap
            query_pos = torch.arange(first_pos, first_pos + rows, device=q.device)[:, None]
            key_pos = torch.arange(lo, hi, device=q.device)[None, :]
            visible = key_pos <= query_pos
            if mask.window is not None:
                visible &= key_pos > query_pos - mask.window
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            chunk = torch.einsum("hgrl,lhd->rhgd", probs, values)
            out[start:start + rows] = chunk.reshape(rows, hq, dim).to(q.dtype)
    return out
