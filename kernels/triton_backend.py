"""Triton attention backend: split-K decode kernel for decode batches, extend kernel otherwise;
with `batch_invariant`, and for layers with a sliding window or soft-capped scores, the one
invariant kernel (triton_invariant.py) for both.

Plans once per forward batch (split count and split-K scratch shared by all layers). A decode
step depends on the host only through the batch size and the split count, so it can be captured
in a CUDA graph (see cuda_graph.py); pass `num_kv_splits` to pin the split count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_base import PLAIN, AttentionBackend, AttentionMetadata, ScoreMask
from .triton_decode import decode_attention, decode_workspace, default_num_kv_splits
from .triton_extend import ExtendConfig, extend_attention
from .triton_invariant import invariant_attention


@dataclass
class _Plan:
    meta: AttentionMetadata
    num_kv_splits: int
    max_extend_len: int
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, num_kv_splits: int | None = None, max_kv_splits: int = 16, min_split_len: int = 64,
                 decode_block_n: int | None = None, extend_config: ExtendConfig | None = None,
                 batch_invariant: bool = False) -> None:
        """The split / tile arguments are tuning knobs with working defaults (gpu_check sweeps
        them); `batch_invariant` takes the invariant kernel instead, which ignores them."""
        if num_kv_splits is not None and num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
        self.num_kv_splits = num_kv_splits
        self.max_kv_splits = max_kv_splits
        self.min_split_len = min_split_len
        self.decode_block_n = decode_block_n
        self.extend_config = extend_config
        self.batch_invariant = batch_invariant
        self._plan: _Plan | None = None

    def begin_forward(self, meta: AttentionMetadata) -> None:
        self._plan = _Plan(meta=meta, num_kv_splits=0, max_extend_len=max(meta.extend_lens_cpu, default=0))

    def _get_plan(self, meta: AttentionMetadata, q: torch.Tensor, num_kv_heads: int) -> _Plan:
        plan = self._plan_for(meta)
        if meta.is_decode:
            bsz, hq, dim = q.shape
            if plan.num_kv_splits == 0:
                plan.num_kv_splits = self.num_kv_splits or default_num_kv_splits(
                    bsz, num_kv_heads, _num_sms(q.device), self.max_kv_splits)
            ws = plan.workspace
            if ws is None or ws[0].shape != (bsz, hq, plan.num_kv_splits, dim):
                plan.workspace = decode_workspace(bsz, hq, dim, plan.num_kv_splits, q.device)
        return plan

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                mask: ScoreMask = PLAIN) -> torch.Tensor:
        self.store_kv(k, v, k_cache, v_cache, meta)
        if self.batch_invariant or mask.changes(meta):  # a sliding window or soft-capped scores: that kernel too
            return invariant_attention(q, k_cache, v_cache, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                       self._plan_for(meta).max_extend_len, scale, mask)
        plan = self._get_plan(meta, q, k_cache.shape[1])
        if meta.is_decode:
            return decode_attention(q, k_cache, v_cache, meta.kv_indptr, meta.kv_indices, scale,
                                    num_kv_splits=plan.num_kv_splits, workspace=plan.workspace,
                                    min_split_len=self.min_split_len, block_n=self.decode_block_n)
        return extend_attention(q, k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, meta.qo_indptr,
                                meta.kv_indptr, meta.kv_indices, plan.max_extend_len, scale, config=self.extend_config)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132
