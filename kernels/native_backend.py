"""Native CPU attention backend: the torch backend's plan, with our C kernels reading the pool in place.

On the CPU with fp32 K/V the native kernels (`native.py`) replace the torch path's gathers and
products: decode steps attend each request's remainder with them (a prefix several requests share
is still attended once, by the extend kernel, and merged; with batch invariance on, where a merge
would change bits, the invariant kernel reads such a prefix once per chunk of its requests,
`native.KeySharing`, with every row's bits unchanged), and extends attend every request's
whole context in one call (no shared-prefix pass: the kernel loads each block of keys once for a
tile of query rows, so a shared prefix costs the same arithmetic as the torch path's shared
product, without its gathers). A batch the kernels cannot take (a bf16 model's tensors, a head size
they do not handle) runs the torch path, which stays the reference they are tested against. With
bf16 products the pool may hold bf16 rows (the model runner's choice): the kernels read them as
the products would round the fp32 rows, the same bits at half the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import native, settings
from . import shared_prefix as sp
from .attention_base import AttentionMetadata, ScoreMask
from .torch_backend import Plan, TorchAttentionBackend

# Native decode steps over at least this many keys in all split their requests over the intra-op
# threads (csrc/thread_pool.c). Alone, two threads gain from a few hundred keys on (2-core EPYC, us
# per layer, 1 vs 2 threads: 4 requests x 100 keys 43 vs 24, 32 x 40 185 vs 75, 32 x 150 699 vs
# 348), but inside a per-layer decode step they meet torch's OpenMP threads, which still spin after
# each GEMM: a 32-request step over 3,200 keys took 82-90 ms with a 256-key bound against 66-72 ms
# with this one (three alternating rounds).
NATIVE_THREADED_KEYS = 4096
UNBOUNDED_WINDOW = 1 << 62  # `_window_slots` of a layer without a window: every key


@dataclass
class NativePlan(Plan):
    """An extend (every request's new tokens against its whole context, one call), or a decode step:
    request i's remainder is kv_indices[starts[i]:][:lens[i]], its shared prefix in `groups`."""

    extend: bool = False
    starts: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    threads: int = 1
    sharing: native.KeySharing | None = None  # requests that begin with the same (cached) keys


class NativeCPUAttentionBackend(TorchAttentionBackend):
    name = "native"

    def __init__(self, share_prefixes: bool = True) -> None:
        super().__init__(share_prefixes)
        self._windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # `_window_slots` of one forward
        self._windows_meta: AttentionMetadata | None = None

    def native_decode_slots(
            self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, native.KeySharing | None] | None:
        plan = self._plan
        if self._plan_meta is not meta or not isinstance(plan, NativePlan) or plan.extend or plan.groups:
            return None
        return plan.starts, plan.lens, plan.sharing

    # ---- planning ---------------------------------------------------------------------------
    def _build_plan(self, meta: AttentionMetadata) -> Plan:
        if not self._reads_slot_table(meta):
            return super()._build_plan(meta)
        if not meta.is_decode:
            return NativePlan(extend=True, sharing=self._extend_sharing(meta))
        layout = self._shared_layout(meta)
        starts = [layout.kv_ptr[i] + layout.shared[i] for i in range(len(layout.rest_lens))]
        threads = torch.get_num_threads() if sum(layout.rest_lens) >= NATIVE_THREADED_KEYS else 1
        sharing = None
        if self.share_prefixes and not layout.groups and len(starts) > 1 and settings.current().batch_invariant:
            sharing = native.KeySharing.find(meta.kv_indices, starts, layout.rest_lens)
        return NativePlan(layout.groups, layout.group_rows, starts=torch.tensor(starts, dtype=torch.int64),
                          lens=torch.tensor(layout.rest_lens, dtype=torch.int64), threads=threads, sharing=sharing)

    def _extend_sharing(self, meta: AttentionMetadata) -> native.KeySharing | None:
        """Requests of an extend whose cached prefixes begin with the same whole blocks of slots
        (branches of one prompt): the kernel attends those blocks for all their rows in full tiles."""
        prefixes = meta.prefix_lens_cpu
        if not self.share_prefixes or sum(p >= native.SHARED_BLOCK_KEYS for p in prefixes) < 2:
            return None
        return native.KeySharing.find(meta.kv_indices, meta.kv_indptr[:-1].tolist(), prefixes,
                                      max_members=len(prefixes))

    @staticmethod
    def _reads_slot_table(meta: AttentionMetadata) -> bool:
        """The native kernels can read this batch's slot table (CPU, int64, contiguous)."""
        return (meta.kv_indices.device.type == "cpu" and meta.kv_indices.dtype == torch.int64
                and meta.kv_indices.is_contiguous() and native.available())

    @staticmethod
    def _reads_pool(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: NativePlan) -> bool:
        """The native kernels can read this layer's pool (`_reads_cache`) at this head size."""
        return _reads_cache(q, k_cache, v_cache) and (native.extend_attention_dim_ok(q.shape[-1]) or not plan.extend)

    @staticmethod
    def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """fp32 rows into a bf16 pool are rounded as the bf16 products round them (denormals to
        zero), so the pool holds exactly what the products of an fp32 pool would use; one native
        pass where it applies (`native.store_kv`)."""
        if native.store_kv(k, v, k_cache, v_cache, meta.out_slots):
            return
        if k_cache.dtype == torch.bfloat16 and k.dtype == torch.float32 and k.device.type == "cpu" and native.available():
            k, v = native.round_bf16(k), native.round_bf16(v)
        TorchAttentionBackend.store_kv(k, v, k_cache, v_cache, meta)

    # ---- attention --------------------------------------------------------------------------
    def _attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, plan: Plan, planned: bool,
                scale: float) -> torch.Tensor:
        if not isinstance(plan, NativePlan):
            return super()._attend(q, k, v, k_cache, v_cache, meta, plan, planned, scale)
        if not self._reads_pool(q, k_cache, v_cache, plan):
            plan = super()._build_plan(meta)  # e.g. a bf16 pool: the torch path
            if planned:
                self._plan = plan
            return super()._attend(q, k, v, k_cache, v_cache, meta, plan, planned, scale)
        if plan.extend:
            out, _ = native.extend_attention(q, k_cache, v_cache, meta.kv_indices, meta.qo_indptr[:-1],
                                             meta.extend_lens, meta.kv_indptr[:-1], meta.seq_lens, scale,
                                             causal=True, threads=torch.get_num_threads(), bf16=_bf16(q),
                                             sharing=plan.sharing)
            return out
        out, lse = native.decode_attention(q, k_cache, v_cache, meta.kv_indices, plan.starts, plan.lens, scale,
                                           with_lse=bool(plan.groups), threads=plan.threads,
                                           invariant=settings.current().batch_invariant, sharing=plan.sharing,
                                           bf16=_bf16(q))
        if not plan.groups:
            return out
        tokens, hq, dim = q.shape
        hkv = k_cache.shape[1]
        out, lse = out.view(tokens, hkv, hq // hkv, dim), lse.view(tokens, hkv, hq // hkv, 1)
        return self._merge_shared(q, out, lse, k_cache, v_cache, plan, scale)

    def _attend_masked(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                       mask: ScoreMask) -> torch.Tensor:
        """Sliding windows and soft-capped scores run on the native kernels: a decode row reads only
        its last `window` keys, an extend masks the keys before each row's window, and both cap
        every score in the kernel (head sizes that are multiples of 16). What the kernels cannot
        read takes the plain-torch path."""
        if not (self._reads_slot_table(meta) and _reads_cache(q, k_cache, v_cache)) or (mask.softcap is not None and not native.extend_attention_dim_ok(q.shape[-1])):
            return super()._attend_masked(q, k_cache, v_cache, meta, scale, mask)
        window = mask.window
        if not meta.is_decode:
            if not native.extend_attention_dim_ok(q.shape[-1]):
                return super()._attend_masked(q, k_cache, v_cache, meta, scale, mask)
            out, _ = native.extend_attention(q, k_cache, v_cache, meta.kv_indices, meta.qo_indptr[:-1],
                                             meta.extend_lens, meta.kv_indptr[:-1], meta.seq_lens, scale,
                                             causal=True, threads=torch.get_num_threads(), window=window,
                                             softcap=mask.softcap, bf16=_bf16(q))
            return out
        starts, lens = self._window_slots(meta, window or UNBOUNDED_WINDOW)
        threads = torch.get_num_threads() if int(lens.sum()) >= NATIVE_THREADED_KEYS else 1
        out, _ = native.decode_attention(q, k_cache, v_cache, meta.kv_indices, starts, lens, scale, threads=threads,
                                         invariant=settings.current().batch_invariant,
                                         softcap=mask.softcap, bf16=_bf16(q))  # the decode stack's kernel
        return out

    def _window_slots(self, meta: AttentionMetadata, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(starts, lens) into meta.kv_indices of each decode row's last `window` keys, made once
        per forward and window (every sliding layer of a step shares them)."""
        cached = self._windows.get(window) if self._windows_meta is meta else None
        if cached is None:
            if self._windows_meta is not meta:
                self._windows, self._windows_meta = {}, meta
            seq = meta.seq_lens_cpu
            lens = [min(n, window) for n in seq]
            starts = [end - n for end, n in zip(meta.kv_indptr[1:].tolist(), lens)]
            cached = self._windows[window] = (torch.tensor(starts, dtype=torch.int64),
                                              torch.tensor(lens, dtype=torch.int64))
        return cached

    def _shared_prefix_attention(self, qr, k_cache, v_cache, group: sp.SharedPrefix, plan: Plan, scale: float):
        """The group's queries as one request that sees all of the prefix (not causal), through the
        extend kernel, read from the pool in place."""
        r, hkv, g, dim = qr.shape
        if not (isinstance(plan, NativePlan) and native.extend_attention_dim_ok(dim)):
            return super()._shared_prefix_attention(qr, k_cache, v_cache, group, plan, scale)
        zero, count, length = torch.zeros(1, dtype=torch.int64), torch.tensor([r]), torch.tensor([group.length])
        out_p, lse_p = native.extend_attention(qr.reshape(r, hkv * g, dim), k_cache, v_cache, group.slots, zero,
                                               count, zero, length, scale, causal=False, with_lse=True,
                                               threads=torch.get_num_threads(), bf16=_bf16(qr))
        return out_p.view(r, hkv, g, dim), lse_p.view(r, hkv, g, 1)


def _bf16(q: torch.Tensor) -> bool:
    """Whether this engine's attention products are bf16 pairs (the kernel settings; head sizes
    that are multiples of 32)."""
    return settings.current().attention_bf16 and native.bf16_attention_dim_ok(q.shape[-1])


def _reads_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The kernels read this pool in place: fp32, or bf16 rows with bf16 products (the only way
    they read those: the bits of the fp32 pool the rows were rounded from); contiguous."""
    if not (native.supports(q) and k_cache.device.type == "cpu" and k_cache.dtype == v_cache.dtype
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    return k_cache.dtype == torch.float32 or (k_cache.dtype == torch.bfloat16 and _bf16(q))
