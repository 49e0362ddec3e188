"""Packed weights carved out of large anonymous maps backed by transparent huge pages.

Each packed tensor of a GGUF load used to be its own allocation: the kernel then faults its pages
in 4 KiB at a time while the packer writes them (on a VM, 0.5B parameters took ~0.3 s of faults,
more than the packing itself, and two packing threads contended on them), and a decode step then
walks ~100 thousand small pages per pass over the weights. An arena hands out 64-byte aligned
slices of 64 MiB chunks, each 2 MiB aligned and advised `MADV_HUGEPAGE` (honoured where the
kernel's THP mode is `always` or `madvise`; elsewhere the advice is a no-op and the chunk behaves
as plain memory). A chunk is freed when the last tensor viewing it goes. The trade where a fresh
huge page's first touch is slow (a VM whose host takes back free memory): the load pays for it
once (~0.2-0.6 s for a 0.5B Q4_K_M file on the one measured) and every decode step gains
(BENCHMARKS.md, "Load, third round").

`active(arena)` makes `empty` take from the arena (the model build does this); outside, `empty` is
`torch.empty`.
"""

from __future__ import annotations

import contextvars
import ctypes
import math
import mmap
from collections.abc import Iterator
from contextlib import contextmanager

import torch

CHUNK_BYTES = 64 << 20
HUGE_PAGE = 2 << 20
ALIGN = 64  # a cache line: every slice suits any dtype and the kernels' vector loads

_current: contextvars.ContextVar[WeightArena | None] = contextvars.ContextVar("weight_arena", default=None)


class WeightArena:
    """A bump allocator over huge-page chunks; slices are never returned individually."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if self._chunk is None or self._used + nbytes > self._chunk.numel():
            self._chunk, self._used = _huge_chunk(max(self.chunk_bytes, nbytes)), 0
        piece = self._chunk[self._used:self._used + nbytes]
        self._used += -(-nbytes // ALIGN) * ALIGN
        return piece.view(dtype).view(shape)


def _huge_chunk(nbytes: int) -> torch.Tensor:
    """`nbytes` of fresh zeroed memory starting on a 2 MiB boundary, advised into huge pages."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    pages = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        pages.madvise(mmap.MADV_HUGEPAGE)
    flat = torch.frombuffer(pages, dtype=torch.uint8)  # holds the map alive
    start = -flat.data_ptr() % HUGE_PAGE
    return flat[start:start + size]


@contextmanager
def active(arena: WeightArena) -> Iterator[WeightArena]:
    token = _current.set(arena)
    try:
        yield arena
    finally:
        _current.reset(token)


def relocate(module: torch.nn.Module) -> None:
    """Move `module`'s CPU parameters into a fresh arena, one at a time (values, sharing and
    Parameter objects kept): for weights loaded elsewhere that the kernels then read every step
    (the fp32 path's decode stack). Call it before anything takes pointers to them."""
    arena = WeightArena()
    for param in module.parameters():  # each shared parameter once
        if param.device.type == "cpu" and param.numel():
            moved = arena.empty(tuple(param.shape), param.dtype)
            moved.copy_(param.data)
            param.data = moved
    trim_heap()


def trim_heap() -> None:
    """Hand the heap's freed memory back to the OS (glibc keeps it otherwise: the copies a load
    dropped would stay resident)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised memory for a weight: from the active arena, else `torch.empty`."""
    arena = _current.get()
    return torch.empty(shape, dtype=dtype) if arena is None else arena.empty(shape, dtype)
