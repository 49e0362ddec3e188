"""KVManager: the slot allocator, the radix tree and the disk tier behind one small interface.

The scheduler asks it four things: how much KV could be had (`available`), slots for a
request's next tokens (`alloc`, evicting cached leaves when the pool is short), a request's
cached prefix (`match`, memory then disk, locked until released) and where a request's KV goes
when it stops or pauses (`cache`: into the tree, with the slots it no longer needs freed).
Each request's share is a `RequestSlots` record, so this module never sees a request.
Called on the scheduler thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..outputs import KVUsage
from .disk_tier import DiskTier, open_disk_tier
from .kv_pool import SlotAllocator
from .radix_cache import RadixCache, TreeNode

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..model_executor.model_runner import ModelRunner


def _no_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass(eq=False)
class RequestSlots:
    """The KV slots one request holds, slot i for token i. Slots [0, cached_len) belong to the
    tree (on the path locked at `last_node`); slots [cached_len, kv_len) are the request's own."""

    slots: torch.Tensor = field(default_factory=_no_slots)
    cached_len: int = 0
    last_node: TreeNode | None = None

    @property
    def kv_len(self) -> int:
        """Tokens whose KV is computed (or cached)."""
        return int(self.slots.numel())

    @property
    def last_slot(self) -> int | None:
        return int(self.slots[-1]) if self.slots.numel() else None

    def extend(self, new_slots: torch.Tensor) -> None:
        self.slots = torch.cat([self.slots, new_slots])

    def clear(self) -> None:
        self.slots, self.cached_len, self.last_node = _no_slots(), 0, None


class KVManager:
    def __init__(self, allocator: SlotAllocator, *, page_size: int = 1, disable_tree: bool = False) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.tree = RadixCache(allocator, page_size=page_size, disable=disable_tree)
        self.disk: DiskTier | None = None

    @classmethod
    def for_runner(cls, runner: ModelRunner, config: EngineConfig) -> KVManager:
        """The KV of `runner`'s pool, with the disk tier when the config names a directory."""
        kv = cls(runner.kv_pool.make_allocator(debug=config.debug_slots), page_size=config.page_size,
                 disable_tree=config.disable_radix_cache)
        if config.disk_cache_dir:
            kv.disk = open_disk_tier(config, runner, kv.tree, kv.alloc_after)
        return kv

    # ---- capacity ---------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return self.allocator.num_total

    def available(self) -> int:
        """Slots free now plus slots the tree could give up."""
        return self.allocator.num_free + self.tree.evictable_size()

    def usage(self) -> KVUsage:
        a = self.allocator
        return KVUsage(nodes=self.tree.num_nodes(), evictions=self.tree.evicted_tokens_total, slots_total=a.num_total,
                       slots_used=a.num_total - a.num_free, slots_free=a.num_free, cached_slots=self.tree.total_size())

    # ---- allocation -------------------------------------------------------------------------
    def alloc(self, held: RequestSlots, n: int) -> torch.Tensor | None:
        """`n` slots for the request's next tokens, or None when even eviction cannot free them."""
        if n == 0:
            return _no_slots()
        return self.alloc_after(held.last_slot, held.kv_len, n)

    def alloc_decode(self, count: int) -> tuple[torch.Tensor, ...] | None:
        """One slot each for `count` requests that decode one token, from free slots, in one
        allocation: the slots `count` calls of `alloc(held, 1)` would give, in that order, without
        their per-call tensor work (~10 us a request, 0.3 ms of a batch-32 step). None where a call
        could differ (pages of several slots) or the free slots do not suffice: the caller then
        allocates request by request, evicting or retracting as that needs."""
        if self.page_size != 1:
            return None
        slots = self.allocator.alloc(count)  # None, taking nothing, when the free slots do not suffice
        return None if slots is None else slots.view(count, 1).unbind(0)

    def alloc_after(self, last_slot: int | None, cur_len: int, n: int) -> torch.Tensor | None:
        """`n` slots continuing a sequence of `cur_len` tokens, evicting from the tree if needed."""
        slots = self.allocator.alloc_extend(last_slot, cur_len, n)
        if slots is None:
            need = self.allocator.pages_needed(cur_len, n) * self.page_size
            self.tree.evict(max(need - self.allocator.num_free, 0))
            slots = self.allocator.alloc_extend(last_slot, cur_len, n)
        return slots

    def alloc_spare(self, last_slot: int, cur_len: int, n: int) -> torch.Tensor | None:
        """`n` slots continuing a sequence, from free slots only (never evicting cached KV for a
        speculative draft); None when there are not enough."""
        return self.allocator.alloc_extend(last_slot, cur_len, n)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self.allocator.free(slots)

    def free_after(self, slots: torch.Tensor, keep: int) -> None:
        """Free `slots[keep:]` of a request that keeps `slots[:keep]` (rejected draft tokens); slots
        on the page of the last kept one stay with it (its next allocation continues that page)."""
        drop = slots[keep:]
        if keep and self.page_size > 1:
            drop = drop[drop // self.page_size != int(slots[keep - 1]) // self.page_size]
        self.free(drop)

    def continuation(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
        """What the tree holds right after all of `tokens` (see `RadixCache.continuation`)."""
        return self.tree.continuation(tokens, max_tokens)

    # ---- prefix matching --------------------------------------------------------------------
    def match(self, held: RequestSlots, tokens: Sequence[int], *, from_disk: bool = True) -> None:
        """Point `held` at the longest cached prefix of `tokens` (the tree, then, `from_disk`, the
        disk tier, whose blocks are loaded into the pool) and lock that path so it is not evicted
        while the request waits or runs."""
        m = self.tree.match_prefix(tokens)
        if from_disk and self.disk is not None:
            m = self.disk.extend_match(tokens, m)
        self.tree.inc_lock_ref(m.last_node)
        held.slots, held.last_node = m.slots.to(torch.int64), m.last_node
        held.cached_len = held.kv_len

    def match_with_disk(self, held: RequestSlots, tokens: Sequence[int]) -> None:
        """A match made without the disk tier, made again with it (the request is about to be
        admitted: now its blocks are worth loading)."""
        if self.disk is not None and held.kv_len == held.cached_len:
            self.release_match(held)
            self.match(held, tokens)

    def release_match(self, held: RequestSlots) -> None:
        """Unlock a match that computed nothing yet (the request stays waiting; it matches again)."""
        if held.last_node is not None and held.kv_len == held.cached_len:
            self.tree.dec_lock_ref(held.last_node)
            held.clear()

    def cache(self, held: RequestSlots, tokens: Sequence[int], *, finished: bool) -> None:
        """Hand the request's computed KV (of `tokens`, one per slot) to the tree. Finished: the
        request lets go of all of it. Unfinished: the tree shares its prefix with other requests
        now, and `held` keeps going with the tree's slots for that prefix."""
        if self.disk is not None:
            self.disk.on_cached(tokens, held.slots)
        if finished:
            self.tree.cache_finished(tokens, held.slots, held.cached_len, held.last_node)
            held.clear()
            return
        kv = self.tree.cache_unfinished(tokens, held.slots, held.cached_len, held.last_node)
        held.slots, held.cached_len, held.last_node = kv.slots.to(torch.int64), kv.prefix_len, kv.last_node

    # ---- maintenance ------------------------------------------------------------------------
    def evict_all(self) -> None:
        self.tree.evict(self.tree.evictable_size())

    def reset(self) -> None:
        """Drop every cached prefix in memory (no request may hold slots)."""
        self.tree.reset()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.store.close()  # queued block writes land before the process may exit
