"""Pure-torch attention backend: the reference every kernel is tested against; runs on CPU and GPU.

Per forward it plans once (shared by all layers): each request's keys are its slot list; prefixes
that several requests share (one radix node) are attended once for all of them
(`shared_prefix.py`), and only each request's remainder is gathered per request. Requests are
batched into one padded product when padding wastes little, else attended one by one. The native
CPU backend (`native_backend.py`) keeps this plan and swaps the products for C kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import settings
from . import shared_prefix as sp
from .attention_base import PLAIN, AttentionBackend, AttentionMetadata, ScoreMask
from .decode_kv import DecodeKVBuffer
from .masked_attention import masked_attention

# Pad ragged requests into one batched product while the padded work is at most this many times
# the real work; beyond it, one product per request is cheaper.
MAX_PADDING_FACTOR = 2.0
# Decode steps that gather at least this many keys (all rows, padding included) keep them in the
# DecodeKVBuffer between steps; below it the ~10 extra small ops per layer cost more than the gather
# they save (`bench peers` batch-1 decode of short chat prompts: 45.9 tok/s before the buffer, 33.8 through it).
MIN_BUFFERED_KEYS = 4096
# Longer extends run one request at a time: there the flash kernel's causal mode skips the masked
# half, which an explicit padding mask cannot (1024-token prefill: 650 -> 444 ms of attention)
MAX_PADDED_EXTEND = 32
@dataclass
class Plan:
    """How one forward's attention runs, shared by every layer."""

    groups: list[sp.SharedPrefix] = field(default_factory=list)
    group_rows: list[torch.Tensor] = field(default_factory=list)  # per group: its members' query rows, in order
    padded: bool = False
    # padded layout: query row and key slot per (request, position), validity as an additive mask
    query_rows: torch.Tensor | None = None  # [B, Emax] int64 row of q for each (request, new token)
    key_slots: torch.Tensor | None = None  # [B, Lmax] int64
    key_lens: torch.Tensor | None = None  # [B] int64 valid keys per row
    mask: torch.Tensor | None = None  # [B, 1, Emax, Lmax] fp32, 0 or -inf
    valid_rows: torch.Tensor | None = None  # [B * Emax] bool: padded positions that are real tokens
    # per-request layout (not padded): remainder slots and causal offset of each request
    rest_slots: list[torch.Tensor] = field(default_factory=list)
    causal_offsets: list[int] = field(default_factory=list)


@dataclass
class SharedLayout:
    """Each request's keys split into a prefix shared with others (attended once per group) and
    its remainder."""

    kv_ptr: list[int]
    qo_ptr: list[int]
    groups: list[sp.SharedPrefix]
    group_rows: list[torch.Tensor]
    shared: list[int]  # keys of request i inside a shared group
    rest_lens: list[int]  # keys of request i after that


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, share_prefixes: bool = True) -> None:
        self.share_prefixes = share_prefixes
        self._plan: Plan | None = None
        self._plan_meta: AttentionMetadata | None = None
        self.decode_kv = DecodeKVBuffer()  # K/V of consecutive decode steps, kept between them
        self.min_buffered_keys = MIN_BUFFERED_KEYS

    def begin_forward(self, meta: AttentionMetadata) -> None:
        self._plan, self._plan_meta = self._build_plan(meta), meta
        if self._buffered(meta, self._plan):
            self.decode_kv.plan(self._plan.key_slots, self._plan.key_lens)
        else:
            self.decode_kv.reset()  # an extend may rewrite slots the buffer copied

    def _buffered(self, meta: AttentionMetadata, plan: Plan) -> bool:
        """Decode steps that gather enough K/V for the buffer to pay for its extra small ops."""
        return meta.is_decode and plan.key_slots is not None and plan.key_slots.numel() >= self.min_buffered_keys

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                mask: ScoreMask = PLAIN) -> torch.Tensor:
        self.store_kv(k, v, k_cache, v_cache, meta)
        if mask.changes(meta):
            return self._attend_masked(q, k_cache, v_cache, meta, scale, mask)
        planned = self._plan_meta is meta
        plan = self._plan if planned else self._build_plan(meta)
        return self._attend(q, k, v, k_cache, v_cache, meta, plan, planned, scale)

    def _attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, plan: Plan, planned: bool,
                scale: float) -> torch.Tensor:
        tokens, hq, dim = q.shape
        if planned and self._buffered(meta, plan):
            out, lse = self._decode(q, k, v, k_cache, v_cache, plan, scale)
            if not plan.groups:
                return out.view(tokens, hq, dim)
        elif not plan.groups:
            if plan.padded:
                return self._padded_sdpa(q, k_cache, v_cache, plan, scale)
            return self._per_request(q, k_cache, v_cache, meta, plan, scale, with_lse=False)[0]
        elif plan.padded:
            out, lse = self._padded_attend(q, k_cache, v_cache, plan, scale)
        else:
            out, lse = self._per_request(q, k_cache, v_cache, meta, plan, scale, with_lse=True)
        return self._merge_shared(q, out, lse, k_cache, v_cache, plan, scale)

    def _attend_masked(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                       mask: ScoreMask) -> torch.Tensor:
        """A sliding window or soft-capped scores: the plain-torch path (native_backend.py takes
        the window alone in its kernels)."""
        return masked_attention(q, k_cache, v_cache, meta, scale, mask)

    def _merge_shared(self, q, out, lse, k_cache, v_cache, plan: Plan, scale: float) -> torch.Tensor:
        """Attend each group's queries over its shared prefix once and merge that into `out`
        ([T, Hkv, G, D], with `lse`, over the remainders)."""
        tokens, hq, dim = q.shape
        hkv = k_cache.shape[1]
        q_groups = q.view(tokens, hkv, hq // hkv, dim)
        for group, rows in zip(plan.groups, plan.group_rows):
            qr = q_groups.index_select(0, rows)  # [R, Hkv, G, D]
            out_p, lse_p = self._shared_prefix_attention(qr, k_cache, v_cache, group, plan, scale)
            merged = sp.merge(out_p, lse_p, out.index_select(0, rows), lse.index_select(0, rows))
            out.index_copy_(0, rows, merged.to(out.dtype))
        return out.view(tokens, hq, dim)

    def _shared_prefix_attention(self, qr, k_cache, v_cache, group: sp.SharedPrefix, plan: Plan, scale: float):
        """(out, lse) [R, Hkv, G, D|1] of a group's queries over its shared prefix: one product."""
        r, hkv, g, dim = qr.shape
        keys = sp.read_slots(k_cache, group.slots, group.contiguous_start).transpose(0, 1)  # [Hkv, Lp, D]
        values = sp.read_slots(v_cache, group.slots, group.contiguous_start).transpose(0, 1)
        qr = qr.permute(1, 0, 2, 3).reshape(1, hkv, r * g, dim)
        out_p, lse_p = sp.attend(qr, keys[None].to(qr.dtype), values[None].to(qr.dtype), scale)
        return out_p.view(hkv, r, g, dim).permute(1, 0, 2, 3), lse_p.view(hkv, r, g, 1).permute(1, 0, 2, 3)

    # ---- planning ---------------------------------------------------------------------------
    def _shared_layout(self, meta: AttentionMetadata) -> SharedLayout:
        prefix = meta.prefix_lens_cpu
        kv_ptr = meta.kv_indptr.tolist()
        qo_ptr = meta.qo_indptr.tolist()
        groups, shared = ([], [0] * len(prefix))
        # a shared-prefix pass merges two partial softmaxes: other sums than one pass over the keys
        if self.share_prefixes and len(prefix) > 1 and not settings.current().batch_invariant:
            groups, shared = sp.find_shared_prefixes(meta.kv_indices, kv_ptr, prefix)
        rest_lens = [kv_ptr[i + 1] - kv_ptr[i] - shared[i] for i in range(len(prefix))]
        device = meta.kv_indices.device
        group_rows = [torch.cat([torch.arange(qo_ptr[i], qo_ptr[i + 1]) for i in g.members.tolist()]).to(device)
                      for g in groups]
        return SharedLayout(kv_ptr, qo_ptr, groups, group_rows, shared, rest_lens)

    def _build_plan(self, meta: AttentionMetadata) -> Plan:
        prefix, extend = meta.prefix_lens_cpu, meta.extend_lens_cpu
        layout = self._shared_layout(meta)
        rest_lens, shared = layout.rest_lens, layout.shared
        max_e, max_l = max(extend), max(rest_lens)
        real = sum(e * n for e, n in zip(extend, rest_lens))
        padded = meta.is_decode or (max_e <= MAX_PADDED_EXTEND
                                    and len(prefix) * max_e * max_l <= MAX_PADDING_FACTOR * real)
        plan = Plan(layout.groups, layout.group_rows, padded)
        if padded:
            self._plan_padded(plan, meta, layout.kv_ptr, layout.qo_ptr, shared, rest_lens, max_e, max_l)
        else:
            kv_ptr = layout.kv_ptr
            plan.rest_slots = [meta.kv_indices[kv_ptr[i] + shared[i]:kv_ptr[i + 1]] for i in range(len(prefix))]
            plan.causal_offsets = [prefix[i] - shared[i] for i in range(len(prefix))]
        return plan

    @staticmethod
    def _plan_padded(plan: Plan, meta: AttentionMetadata, kv_ptr: list[int], qo_ptr: list[int],
                     shared: list[int], rest_lens: list[int], max_e: int, max_l: int) -> None:
        device = meta.kv_indices.device
        bsz = len(rest_lens)
        starts = torch.tensor([kv_ptr[i] + shared[i] for i in range(bsz)], device=device)
        lens = torch.tensor(rest_lens, device=device)
        ar_l = torch.arange(max_l, device=device)
        key_valid = ar_l[None, :] < lens[:, None]  # [B, Lmax]
        plan.key_slots = meta.kv_indices[torch.where(key_valid, starts[:, None] + ar_l[None, :], 0)]
        plan.key_lens = lens
        extend = torch.tensor(meta.extend_lens_cpu, device=device)
        ar_e = torch.arange(max_e, device=device)
        query_valid = ar_e[None, :] < extend[:, None]  # [B, Emax]
        plan.query_rows = torch.where(query_valid, torch.tensor(qo_ptr[:-1], device=device)[:, None] + ar_e, 0)
        plan.valid_rows = query_valid.reshape(-1)
        # query j of request i sits at position rest_len - extend + j within its keys; it sees keys <= that
        query_pos = (lens - extend)[:, None] + ar_e[None, :]  # [B, Emax]
        visible = key_valid[:, None, :] & (ar_l[None, None, :] <= query_pos[:, :, None])
        visible |= ~query_valid[:, :, None]  # padded query rows see everything: no NaN, discarded anyway
        mask = torch.zeros(visible.shape, dtype=torch.float32, device=device)
        plan.mask = mask.masked_fill_(~visible, float("-inf"))[:, None]  # [B, 1, Emax, Lmax]

    # ---- the remainder of each request ----------------------------------------------------------
    def _decode(self, q, k, v, k_cache, v_cache, plan: Plan, scale: float):
        """One new token per request: (out, lse) [B, Hkv, G, D|1] over each request's remainder."""
        keys, values = self.decode_kv.read(k_cache, v_cache, k, v)
        bsz, hkv = keys.shape[:2]
        grouped = q.view(bsz, hkv, q.shape[1] // hkv, q.shape[2])
        return sp.attend_decode(grouped, keys.to(q.dtype), values.to(q.dtype), scale, plan.mask.to(q.dtype),
                                with_lse=bool(plan.groups))

    @staticmethod
    def _gather_padded(q, k_cache, v_cache, plan: Plan):
        bsz, max_e = plan.query_rows.shape
        max_l = plan.key_slots.shape[1]
        flat = plan.key_slots.reshape(-1)  # index_select is ~3x faster than advanced indexing on CPU
        keys = k_cache.index_select(0, flat).view(bsz, max_l, *k_cache.shape[1:]).transpose(1, 2)
        values = v_cache.index_select(0, flat).view(bsz, max_l, *v_cache.shape[1:]).transpose(1, 2)
        queries = q.index_select(0, plan.query_rows.reshape(-1)).view(bsz, max_e, *q.shape[1:]).transpose(1, 2)
        return queries, keys.to(q.dtype), values.to(q.dtype)  # [B, H, E|L, D]

    def _padded_sdpa(self, q, k_cache, v_cache, plan: Plan, scale: float) -> torch.Tensor:
        queries, keys, values = self._gather_padded(q, k_cache, v_cache, plan)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=plan.mask.to(q.dtype), scale=scale,
                                             enable_gqa=keys.shape[1] != q.shape[1])
        return self._unpad(out.transpose(1, 2), plan, q.shape[0])

    def _padded_attend(self, q, k_cache, v_cache, plan: Plan, scale: float):
        queries, keys, values = self._gather_padded(q, k_cache, v_cache, plan)
        bsz, hq, max_e, dim = queries.shape
        hkv = keys.shape[1]
        g = hq // hkv
        queries = queries.reshape(bsz, hkv, g * max_e, dim)  # head h = kv head h // G, query rows (g, e)
        mask = plan.mask.to(q.dtype).repeat(1, 1, g, 1)  # [B, 1, G * Emax, Lmax]
        out, lse = sp.attend(queries, keys, values, scale, mask)
        out = out.view(bsz, hkv, g, max_e, dim).permute(0, 3, 1, 2, 4)  # [B, Emax, Hkv, G, D]
        lse = lse.view(bsz, hkv, g, max_e, 1).permute(0, 3, 1, 2, 4)
        return self._unpad(out, plan, q.shape[0]), self._unpad(lse, plan, q.shape[0])

    @staticmethod
    def _unpad(x: torch.Tensor, plan: Plan, tokens: int) -> torch.Tensor:
        """[B, Emax, ...] padded rows -> [T, ...] in token order (requests are contiguous in q)."""
        flat = x.reshape(-1, *x.shape[2:])
        if flat.shape[0] == tokens:
            return flat.contiguous()
        return flat[plan.valid_rows]

    @staticmethod
    def _per_request(q, k_cache, v_cache, meta: AttentionMetadata, plan: Plan, scale: float, with_lse: bool):
        """One request at a time: its new tokens against its remainder, without explicit masks."""
        tokens, hq, dim = q.shape
        hkv = k_cache.shape[1]
        qo = meta.qo_indptr.tolist()
        out = torch.empty(tokens, hq, dim, dtype=q.dtype, device=q.device)
        lse = torch.empty(tokens, hq, 1, dtype=q.dtype, device=q.device) if with_lse else None
        for i, (slots, offset) in enumerate(zip(plan.rest_slots, plan.causal_offsets)):
            # kv head j serves query heads j*G..(j+1)*G-1 (HF's repeat_kv): expand it to them
            keys = k_cache.index_select(0, slots).to(q.dtype).repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
            values = v_cache.index_select(0, slots).to(q.dtype).repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
            qi = q[qo[i]:qo[i + 1]].transpose(0, 1)[None]  # [1, Hq, E, D]
            oi, li = sp.attend_after_prefix(qi, keys[None], values[None], offset, scale)
            out[qo[i]:qo[i + 1]] = oi[0].transpose(0, 1)
            if with_lse:
                lse[qo[i]:qo[i + 1]] = li[0].transpose(0, 1)
        if not with_lse:
            return out, None
        return out.view(tokens, hkv, hq // hkv, dim), lse.view(tokens, hkv, hq // hkv, 1)
