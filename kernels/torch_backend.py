"""Pure-torch attention backend: the reference every kernel is tested against; runs on CPU and GPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention_base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    """Decode batches are padded into one SDPA call; extend batches run one SDPA per request."""

    name = "torch"

    def __init__(self) -> None:
        self._decode_plan: tuple[torch.Tensor, torch.Tensor] | None = None

    def begin_forward(self, meta: AttentionMetadata) -> None:
        self._decode_plan = self._plan_decode(meta) if meta.is_decode else None

    @staticmethod
    def _plan_decode(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded gather index [B, Lmax] and additive mask [B, 1, 1, Lmax] shared by all layers."""
        seq_lens = meta.seq_lens_cpu
        max_len = max(seq_lens)
        device = meta.kv_indices.device
        ar = torch.arange(max_len, device=device)
        valid = ar[None, :] < meta.seq_lens[:, None]
        gather = meta.kv_indptr[:-1, None] + ar[None, :]
        gather = torch.where(valid, gather, torch.zeros_like(gather))
        slots = meta.kv_indices[gather]
        mask = torch.zeros(valid.shape, dtype=torch.float32, device=device)
        mask.masked_fill_(~valid, float("-inf"))
        return slots, mask[:, None, None, :]

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.store_kv(k, v, k_cache, v_cache, meta)
        if meta.is_decode:
            plan = self._decode_plan if self._decode_plan is not None else self._plan_decode(meta)
            return self._decode(q, k_cache, v_cache, plan, scale)
        return self._extend(q, k_cache, v_cache, meta, scale)

    @staticmethod
    def _decode(q, k_cache, v_cache, plan, scale) -> torch.Tensor:
        slots, mask = plan
        bsz, hq, dim = q.shape
        flat = slots.reshape(-1)  # index_select is ~3x faster than advanced indexing on CPU
        shape = (*slots.shape, *k_cache.shape[1:])
        keys = k_cache.index_select(0, flat).view(shape).transpose(1, 2)  # [B, Hkv, L, D]
        values = v_cache.index_select(0, flat).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.view(bsz, hq, 1, dim), keys, values, attn_mask=mask.to(q.dtype), scale=scale,
            enable_gqa=keys.shape[1] != hq)
        return out.view(bsz, hq, dim)

    @staticmethod
    def _extend(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        hq = q.shape[1]
        qo, kv = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
        for i, (prefix, extend) in enumerate(zip(meta.prefix_lens_cpu, meta.extend_lens_cpu)):
            slots = meta.kv_indices[kv[i]:kv[i + 1]]
            qi = q[qo[i]:qo[i + 1]].transpose(0, 1).unsqueeze(0)  # [1, Hq, E, D]
            keys = k_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
            values = v_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            seq = prefix + extend
            # Query j (position prefix + j) sees keys 0..prefix + j.
            mask = torch.ones(extend, seq, dtype=torch.bool, device=q.device).tril(diagonal=prefix)
            oi = F.scaled_dot_product_attention(qi, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask,
                                                scale=scale, enable_gqa=keys.shape[1] != hq)
            out[qo[i]:qo[i + 1]] = oi[0].transpose(0, 1)
        return out
