"""Paged KV storage (`KVPool`) and the slot allocator that hands out its token slots.

Layout: K and V are each one tensor `[num_layers, num_slots + page_size, kv_heads, head_dim]`.
Token slot `s` of layer `l` lives at `k[l, s]`. Page `p` holds token slots
`p * page_size .. p * page_size + page_size - 1`. Page 0 (slot 0 when page_size is 1) is a padding
page that is never allocated: padded batch entries (e.g. CUDA-graph padding) write their K/V there.

Ownership is per page (page_size 1: per slot). Every allocatable page is, at any time, free or
owned by exactly one holder (a running request or one radix-tree node). `SlotAllocator.free`
therefore takes token slots and returns to the pool every page that contains one of them; the
caller must own those pages whole. This matches how the radix cache works with pages: tree keys
are page-aligned, so a node always owns whole pages, and a request owns its unaligned last page.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidRequestError, RadixBackendError


class SlotAccountingError(RadixBackendError, RuntimeError):
    """A KV slot was freed twice, freed while never allocated, or is the reserved padding slot.

    This is always a bug in the caller (scheduler / cache bookkeeping), never bad user input.
    """


@dataclass
class KVPoolConfig:
    """Shape of the KV cache of one model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"

    def bytes_per_token(self) -> int:
        """Bytes one token's K and V take across all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


def kv_tokens_for_budget(cfg: KVPoolConfig, budget_bytes: int) -> int:
    """How many token slots fit in `budget_bytes` of KV memory (0 if none)."""
    if budget_bytes <= 0:
        return 0
    return int(budget_bytes) // cfg.bytes_per_token()


class KVPool:
    """Per-layer K and V buffers indexed by token slot (see the module docstring for the layout)."""

    def __init__(self, cfg: KVPoolConfig, num_slots: int, page_size: int = 1) -> None:
        _check_sizes(num_slots, page_size)
        self.cfg = cfg
        self.page_size = page_size
        # Only whole pages are usable; a ragged remainder would be a page nobody can allocate.
        self.num_slots = num_slots // page_size * page_size
        shape = (cfg.num_layers, self.num_slots + page_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_buffer = _zeros(shape, cfg.dtype, torch.device(cfg.device))
        self.v_buffer = _zeros(shape, cfg.dtype, torch.device(cfg.device))

    @property
    def device(self) -> torch.device:
        return self.k_buffer.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k_buffer.dtype

    def k_cache(self, layer: int) -> torch.Tensor:
        """View `[num_slots + page_size, kv_heads, head_dim]` of layer `layer`'s keys."""
        return self.k_buffer[layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        """View `[num_slots + page_size, kv_heads, head_dim]` of layer `layer`'s values."""
        return self.v_buffer[layer]

    def size_bytes(self) -> int:
        return 2 * self.k_buffer.numel() * self.k_buffer.element_size()

    def make_allocator(self, debug: bool = False, device: torch.device | str = "cpu") -> "SlotAllocator":
        """An allocator over exactly this pool's slots."""
        return SlotAllocator(self.num_slots, self.page_size, device=device, debug=debug)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed buffer. On the CPU an anonymous memory map: the OS hands over zero pages as they are
    first written, so a pool sized for many tokens costs neither load time nor resident memory
    until it is used (torch.zeros writes every byte up front: 6 GB and ~10 s for the default pool).
    Plain 4 KB pages on purpose: numpy's calloc asks for transparent huge pages, whose first-touch
    faults cost ~50x more per written KV byte on the machines measured (direct compaction)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(pages, dtype=torch.uint8, count=nbytes)  # holds the map alive
    return flat.view(dtype).view(shape)


def _check_sizes(num_slots: int, page_size: int) -> None:
    if page_size < 1:
        raise InvalidRequestError(f"page_size must be >= 1, got {page_size}")
    if num_slots < page_size:
        raise InvalidRequestError(
            f"the KV pool needs at least one page ({page_size} token slots), got {num_slots}: raise kv_cache_tokens")


class SlotAllocator:
    """Hands out KV token slots, a whole page at a time (SGLang's TokenToKVPoolAllocator).

    Free pages sit on a stack (one int64 tensor of num_pages entries, no per-slot Python objects):
    `alloc` pops k pages, `free` pushes them, O(k) each, no merging. Freed pages are reused first
    (LIFO) and a fresh pool hands out pages in ascending order, so a workload touches only as much
    of the pool as it holds at once: on the CPU, a page of the pool's memory costs a first-touch
    fault the first time it is written, and recently used slots are still in the caches. A
    boolean per-page "is free" mask catches double frees, duplicates and frees of the padding
    page; the check runs on CPU always (vectorised) and on GPU only with `debug=True`, since it
    needs a device sync there. `debug=True` also re-verifies the free count against the mask on
    every call.

    Not thread-safe: only the scheduler thread calls it.
    """

    def __init__(self, num_slots: int, page_size: int = 1, device: torch.device | str = "cpu",
                 debug: bool = False) -> None:
        _check_sizes(num_slots, page_size)
        self.page_size = page_size
        self.num_pages = num_slots // page_size  # allocatable pages: 1 .. num_pages
        self.device = torch.device(device)
        self.debug = debug
        self._check = debug or self.device.type == "cpu"
        self.reset()

    # --- accounting -------------------------------------------------------------------------
    @property
    def num_total(self) -> int:
        """Allocatable token slots (the padding page excluded)."""
        return self.num_pages * self.page_size

    @property
    def num_free(self) -> int:
        """Free token slots (whole free pages times page_size)."""
        return self._num_free_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        return self._num_free_pages

    def reset(self) -> None:
        """Mark every page free again (drops all ownership; the caller must hold none)."""
        # free pages, the next to hand out last: a fresh pool pops 1, 2, 3, ...
        self._stack = torch.arange(self.num_pages, 0, -1, dtype=torch.int64, device=self.device)
        self._num_free_pages = self.num_pages
        self._page_free = torch.ones(self.num_pages + 1, dtype=torch.bool, device=self.device)
        self._page_free[0] = False  # the padding page is never free, never allocated
        # what alloc and free index: on the CPU numpy views of the same memory (a decode step's
        # torch indexing took ~100 us right after a forward had swept the caches), else the tensors
        cpu = self.device.type == "cpu"
        self._stack_ops = self._stack.numpy() if cpu else self._stack
        self._free_ops = self._page_free.numpy() if cpu else self._page_free

    def free_slots(self) -> torch.Tensor:
        """Every currently free token slot, sorted (for invariant checks; O(pool))."""
        pages = torch.nonzero(self._page_free).flatten()
        return self._pages_to_slots(pages)

    def is_free(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool tensor: is the page of each slot free."""
        return self._page_free[slots // self.page_size]

    # --- allocation -------------------------------------------------------------------------
    def pages_needed(self, cur_len: int, n: int) -> int:
        """New pages that `alloc_extend(_, cur_len, n)` takes."""
        room = (-cur_len) % self.page_size  # free slots left in the sequence's last page
        return max(0, math.ceil((n - room) / self.page_size))

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` token slots starting on a fresh page, or None if there is not enough room (never partial)."""
        return self.alloc_extend(None, 0, n)

    def alloc_extend(self, last_slot: int | None, cur_len: int, n: int) -> torch.Tensor | None:
        """`n` slots continuing a sequence of `cur_len` tokens whose last token sits at `last_slot`.

        The rest of the sequence's current page is used first (slots last_slot+1, ...), then whole
        new pages. With page_size 1 this is `alloc(n)`. Returns None (allocating nothing) if the
        free pages do not suffice.
        """
        if n < 0 or cur_len < 0:
            raise InvalidRequestError(f"alloc_extend needs n >= 0 and cur_len >= 0, got n={n}, cur_len={cur_len}")
        ps = self.page_size
        room = min((-cur_len) % ps, n)
        if room and (last_slot is None or last_slot % ps != (cur_len - 1) % ps):
            raise SlotAccountingError(
                f"last_slot {last_slot} is not at offset {(cur_len - 1) % ps} of its page for a sequence of "
                f"length {cur_len} (page_size {ps})")
        k = self.pages_needed(cur_len, n)
        if k > self._num_free_pages:
            return None
        pages = self._take_pages(k)
        if ps == 1:
            return pages
        fresh = self._pages_to_slots(pages)[: n - room]
        if not room:
            return fresh
        tail = torch.arange(last_slot + 1, last_slot + 1 + room, dtype=torch.int64, device=self.device)
        return torch.cat((tail, fresh))

    def free(self, slots: torch.Tensor) -> None:
        """Return to the pool every page that holds one of `slots` (the caller owned them whole)."""
        if slots.numel() == 0:
            return
        slots = slots.to(device=self.device, dtype=torch.int64).flatten()
        pages = slots if self.page_size == 1 else torch.unique(slots // self.page_size)
        if self.device.type == "cpu":
            pages = pages.numpy()
        m = len(pages)
        if self._check:
            self._validate_free(pages)
        if self._num_free_pages + m > self.num_pages:  # the stack would overflow: checked everywhere
            raise SlotAccountingError(f"freeing {m} pages with {self._num_free_pages} of {self.num_pages} "
                                      "already free: double free")
        self._free_ops[pages] = True
        top = self._num_free_pages  # pushed in reverse, so the next alloc pops them in this order
        self._stack_ops[top:top + m] = _reversed(pages)  # a copy: the caller may overwrite its tensor later
        self._num_free_pages += m
        if self.debug and int(self._page_free.sum()) != self._num_free_pages:
            raise SlotAccountingError("free-page count drifted from the free mask")

    # --- internals --------------------------------------------------------------------------
    def _validate_free(self, pages: torch.Tensor | np.ndarray) -> None:
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 1 or hi > self.num_pages:
            bad = lo if lo < 1 else hi
            what = "the reserved padding page" if bad == 0 else "out of range"
            raise SlotAccountingError(
                f"freeing page {bad} (page_size {self.page_size}), which is {what}; valid pages are 1..{self.num_pages}")
        already = self._free_ops[pages]
        if bool(already.any()):
            page = int(pages[already][0])
            raise SlotAccountingError(f"double free of page {page} (slots {page * self.page_size}.."
                                      f"{page * self.page_size + self.page_size - 1})")
        if self.page_size == 1 and len(pages) > 1 and _distinct(pages) != len(pages):
            raise SlotAccountingError("the same slot appears twice in one free() call")

    def _take_pages(self, k: int) -> torch.Tensor:
        if k == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        top = self._num_free_pages
        pages = _reversed(self._stack_ops[top - k:top])  # a copy: later pushes overwrite the stack
        self._free_ops[pages] = False
        self._num_free_pages -= k
        return torch.from_numpy(pages) if isinstance(pages, np.ndarray) else pages

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return pages
        offs = torch.arange(self.page_size, dtype=torch.int64, device=pages.device)
        return (pages[:, None] * self.page_size + offs[None, :]).flatten()


def _reversed(pages: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """A reversed copy, of a numpy array or a tensor."""
    return pages[::-1].copy() if isinstance(pages, np.ndarray) else pages.flip(0)


def _distinct(pages: torch.Tensor | np.ndarray) -> int:
    """How many different values, in a numpy array or a tensor."""
    return int(np.unique(pages).size if isinstance(pages, np.ndarray) else torch.unique(pages).numel())
