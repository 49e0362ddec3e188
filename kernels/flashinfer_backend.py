"""FlashInfer attention backend: paged prefill/decode wrappers planned from the radix slot tables.

The KV pool stores token slot s of a layer at row s of `[num_slots + page_size, Hkv, D]`, and page
p holds slots p*page_size .. p*page_size + page_size - 1, with token t of a sequence at offset
t % page_size of its page (the allocator keeps sequences page-aligned). Viewed as
`[num_pages, page_size, Hkv, D]` that is FlashInfer's NHD paged layout, so a request's page table
is the page of every page_size-th entry of its slot list, and its last page holds
`seq_len - (num_pages - 1) * page_size` tokens. With page_size 1 pages are slots.

Per forward batch (shared by every layer) the backend plans once, on the first layer:
- decode batches: `BatchDecodeWithPagedKVCacheWrapper` (tensor cores for GQA groups >= 4);
- extend batches: `BatchPrefillWithPagedKVCacheWrapper` with the causal mask (the new tokens'
  K/V are written to the cache first, so the page table covers prefix + new tokens);
- fork-heavy batches, where at least `cascade_min_batch` requests all start with the same run
  of at least `cascade_min_prefix` cached slots: `MultiLevelCascadeAttentionWrapper` with two
  levels, the shared prefix once for all queries (non-causal) and each request's own suffix
  (causal), merged by log-sum-exp. This reads the shared prefix once instead of once per request.

flashinfer-python needs CUDA and is imported lazily; this module itself imports on CPU so its
planning logic (page tables, shared-prefix detection) is testable without a GPU.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from .attention_base import PLAIN, AttentionBackend, AttentionMetadata, ScoreMask
from .masked_attention import masked_attention

INSTALL_HINT = "pip install flashinfer-python  (needs an NVIDIA GPU; see https://docs.flashinfer.ai/installation.html)"


def import_flashinfer() -> Any:
    try:
        return importlib.import_module("flashinfer")
    except ImportError as exc:
        raise ImportError(f"the flashinfer attention backend needs flashinfer-python: {INSTALL_HINT}") from exc


@dataclass
class PageTable:
    """FlashInfer paged-KV description of a batch (all int32, on the KV device)."""

    indptr: torch.Tensor  # [B+1]
    indices: torch.Tensor  # [indptr[-1]] page ids
    last_page_len: torch.Tensor  # [B], in 1..page_size


def build_page_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, seq_lens: list[int], page_size: int,
                     starts: list[int] | None = None) -> PageTable:
    """Page table of tokens [starts[b], seq_lens[b]) of every request (starts page-aligned, default 0).

    Gathers the slot of every page_size-th token on the device and divides by page_size; the
    gather positions are computed on the host from the host lengths (no device sync).
    """
    starts = starts or [0] * len(seq_lens)
    device = kv_indices.device
    counts, positions, last = [], [], []
    for start, seq in zip(starts, seq_lens):
        if start % page_size or start >= seq:
            raise ValueError(f"start {start} must be page-aligned (page_size {page_size}) and below seq_len {seq}")
        n_pages = -(-(seq - start) // page_size)
        counts.append(n_pages)
        positions.append(torch.arange(start, start + n_pages * page_size, page_size, dtype=torch.int64))
        last.append(seq - start - (n_pages - 1) * page_size)
    indptr_host = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    indptr_host[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
    offsets = torch.repeat_interleave(kv_indptr[:-1].to(torch.int64), torch.tensor(counts, device=kv_indptr.device))
    gather = offsets + torch.cat(positions).to(device) if positions else offsets
    pages = torch.div(kv_indices[gather], page_size, rounding_mode="floor")
    return PageTable(indptr=indptr_host.to(device=device, dtype=torch.int32),
                     indices=pages.to(torch.int32),
                     last_page_len=torch.tensor(last, dtype=torch.int32, device=device))


def check_page_layout(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, seq_lens: list[int], page_size: int) -> None:
    """Raise ValueError unless token t of every sequence sits at offset t % page_size of the page
    that holds its page's first token (what the page table assumes). Costs one device sync."""
    if page_size == 1:
        return
    pos = torch.cat([torch.arange(n, dtype=torch.int64) for n in seq_lens]).to(kv_indices.device)
    starts = torch.repeat_interleave(kv_indptr[:-1].to(torch.int64),
                                     torch.tensor(seq_lens, device=kv_indptr.device))
    slots = kv_indices[starts + pos].to(torch.int64)
    first = kv_indices[starts + pos // page_size * page_size].to(torch.int64)
    ok = (slots % page_size == pos % page_size) & (slots // page_size == first // page_size)
    if not bool(ok.all()):
        bad = int((~ok).nonzero()[0, 0])
        raise ValueError(f"KV slot {int(slots[bad])} of token {int(pos[bad])} breaks the page layout "
                         f"(page_size {page_size}): sequences must fill whole pages in order")


def shared_prefix_len(meta: AttentionMetadata, page_size: int, min_len: int) -> int:
    """Length of the leading slot run every request of the batch shares, rounded down to whole pages.

    Only cached prefix tokens count (never new tokens). Returns 0 without touching the device when
    the shortest prefix is below `min_len`; otherwise one small device-to-host copy.
    """
    if meta.batch_size < 2:
        return 0
    limit = min(meta.prefix_lens_cpu) // page_size * page_size
    if limit < max(min_len, 1):
        return 0
    ar = torch.arange(limit, device=meta.kv_indices.device)
    rows = meta.kv_indices[meta.kv_indptr[:-1, None] + ar[None, :]]  # [B, limit]
    same = (rows == rows[:1]).all(0)
    run = int(torch.cumprod(same.to(torch.int32), 0).sum().item())
    return run // page_size * page_size


@dataclass
class _Plan:
    meta: AttentionMetadata
    kind: str  # "decode" | "prefill" | "cascade"
    shared_len: int = 0
    planned: bool = False


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, device: torch.device | str = "cuda", page_size: int = 1, workspace_mb: int = 128,
                 use_cascade: bool = True, cascade_min_batch: int = 4, cascade_min_prefix: int = 256,
                 decode_tensor_cores: bool | None = None, debug_checks: bool = False) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.flashinfer = import_flashinfer()
        self.device = torch.device(device)
        self.page_size = page_size
        self.use_cascade = use_cascade
        self.cascade_min_batch = cascade_min_batch
        self.cascade_min_prefix = cascade_min_prefix
        self.decode_tensor_cores = decode_tensor_cores
        self.debug_checks = debug_checks
        self.workspace = torch.zeros(workspace_mb << 20, dtype=torch.uint8, device=self.device)
        self._prefill = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._cascade = self.flashinfer.MultiLevelCascadeAttentionWrapper(2, self.workspace, "NHD")
        self._decode: dict[bool, Any] = {}  # by use_tensor_cores
        self._plan: _Plan | None = None

    # ----------------------------------------------------------------------------- planning
    def begin_forward(self, meta: AttentionMetadata) -> None:
        kind, shared = ("decode" if meta.is_decode else "prefill"), 0
        if self.use_cascade and meta.batch_size >= self.cascade_min_batch:
            shared = shared_prefix_len(meta, self.page_size, self.cascade_min_prefix)
            if shared:
                kind = "cascade"
        self._plan = _Plan(meta=meta, kind=kind, shared_len=shared)

    def _decode_wrapper(self, group: int) -> Any:
        tensor_cores = self.decode_tensor_cores if self.decode_tensor_cores is not None else group >= 4
        if tensor_cores not in self._decode:
            self._decode[tensor_cores] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=tensor_cores)
        return self._decode[tensor_cores]

    def _ensure_planned(self, meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> _Plan:
        plan = self._plan_for(meta)
        if plan.planned:
            return plan
        hq, dim = q.shape[1], q.shape[2]
        hkv = k_cache.shape[1]
        if hq % hkv:
            raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
        ps = self.page_size
        dtypes = dict(q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        seq = meta.seq_lens_cpu
        if self.debug_checks:
            check_page_layout(meta.kv_indptr, meta.kv_indices, seq, ps)
        if plan.kind == "cascade":
            shared = plan.shared_len
            top = build_page_table(meta.kv_indptr[:2], meta.kv_indices, [shared], ps)
            unique = build_page_table(meta.kv_indptr, meta.kv_indices, seq, ps, starts=[shared] * len(seq))
            all_q = torch.tensor([0, meta.num_tokens], dtype=torch.int32, device=q.device)
            qo = meta.qo_indptr.to(torch.int32)
            self._cascade.plan([all_q, qo], [top.indptr, unique.indptr], [top.indices, unique.indices],
                               [top.last_page_len, unique.last_page_len], hq, hkv, dim, ps,
                               causal=True, sm_scale=scale, **dtypes)
        else:
            table = build_page_table(meta.kv_indptr, meta.kv_indices, seq, ps)
            if plan.kind == "decode":
                self._decode_wrapper(hq // hkv).plan(table.indptr, table.indices, table.last_page_len, hq, hkv, dim,
                                                     ps, sm_scale=scale, **dtypes)
            else:
                self._prefill.plan(meta.qo_indptr.to(torch.int32), table.indptr, table.indices, table.last_page_len,
                                   hq, hkv, dim, ps, causal=True, sm_scale=scale, **dtypes)
        plan.planned = True
        return plan

    # ----------------------------------------------------------------------------- forward
    def paged_view(self, cache: torch.Tensor) -> torch.Tensor:
        """[rows, Hkv, D] -> [rows // page_size, page_size, Hkv, D] (no copy)."""
        rows = cache.shape[0] // self.page_size * self.page_size
        return cache[:rows].view(-1, self.page_size, cache.shape[1], cache.shape[2])

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                mask: ScoreMask = PLAIN) -> torch.Tensor:
        self.store_kv(k, v, k_cache, v_cache, meta)
        if mask.changes(meta):  # a sliding window or soft-capped scores: the plain-torch path
            return masked_attention(q, k_cache, v_cache, meta, scale, mask)
        plan = self._ensure_planned(meta, q, k_cache, scale)
        kv = (self.paged_view(k_cache), self.paged_view(v_cache))
        q = q.contiguous()
        if plan.kind == "cascade":
            return self._cascade.run(q, kv)
        if plan.kind == "decode":
            return self._decode_wrapper(q.shape[1] // k_cache.shape[1]).run(q, kv)
        return self._prefill.run(q, kv)
