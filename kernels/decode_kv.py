"""The running decode batch's keys and values in one padded buffer, extended by a column per step.

Decode attention on the CPU is bound by moving K/V, not by the product: gathering every request's
whole context from the paged pool through its slot table (`index_select`) cost more than the
attention itself (SmolLM2, batch 32 at 300 tokens: 2.0 of 3.7 ms per layer). Between two
consecutive decode steps of the same requests nothing in their contexts changes except one new
token each, so this buffer keeps last step's gathered keys/values per layer, laid out
[B, Hkv, L, D] for the attention matmuls, and writes only the new column. Any step that is not
such a continuation (other requests, a retraction, an extend forward in between, a full buffer)
rebuilds it with one gather, which is what every step cost before.

The buffer only ever holds copies of slots the batch still owns, checked slot by slot against
last step's table, so its contents equal a fresh gather.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

# Spare columns allocated past the longest context, so a rebuild happens every GROWTH steps at most.
GROWTH = 64
# The buffers of all layers together stay under this; layers past it gather every step.
MAX_BYTES = 1 << 30


@dataclass
class _LayerKV:
    """One layer's keys/values of the last step: the gather itself ([B, Hkv, L, D] views of a
    [B, L, Hkv, D] tensor) after a rebuild, or the appendable buffer once a step continued it."""

    cache: weakref.ref  # the pool tensor these are copies of (a new pool invalidates them)
    keys: torch.Tensor
    values: torch.Tensor
    in_buffer: bool  # keys/values are [B, Hkv, capacity, D] buffers

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


class DecodeKVBuffer:
    """Plan once per decode forward (`plan`), then each layer asks for its keys/values (`read`)."""

    def __init__(self, max_bytes: int = MAX_BYTES, growth: int = GROWTH) -> None:
        self.max_bytes = max_bytes
        self.growth = growth
        self._slots: torch.Tensor | None = None  # [B, L] slot table of this step (padding: any slot)
        self._lens: torch.Tensor | None = None  # [B] valid keys per row
        self._append = False  # this step only adds column lens-1 to last step's buffers
        self._capacity = 0  # columns of the buffers (allocated at a rebuild)
        self._layers: dict[int, _LayerKV] = {}
        self.rebuilds = 0  # forwards that gathered (observability and tests)

    def reset(self) -> None:
        """Forget everything: the next decode step gathers. Call on any non-decode forward."""
        self._slots = self._lens = None
        self._append = False
        self._layers.clear()

    def plan(self, slots: torch.Tensor, lens: torch.Tensor) -> None:
        """This step's padded slot table [B, L] and valid lengths [B]: a continuation of the last
        step (every row one token longer, the old part the same slots) appends, else rebuild."""
        prev_slots, prev_lens = self._slots, self._lens
        bsz, width = slots.shape
        self._append = (prev_slots is not None and prev_slots.shape[0] == bsz and width <= self._capacity
                        and torch.equal(lens, prev_lens + 1) and self._same_prefix(prev_slots, prev_lens, slots))
        if not self._append:
            self.rebuilds += 1
            self._capacity = width + self.growth
            self._layers.clear()
        self._slots, self._lens = slots, lens

    @staticmethod
    def _same_prefix(prev_slots: torch.Tensor, prev_lens: torch.Tensor, slots: torch.Tensor) -> bool:
        width = prev_slots.shape[1]
        if slots.shape[1] < width:
            return False
        valid = torch.arange(width, device=slots.device)[None, :] < prev_lens[:, None]
        return bool(((slots[:, :width] == prev_slots) | ~valid).all())

    def read(self, k_cache: torch.Tensor, v_cache: torch.Tensor, new_k: torch.Tensor,
             new_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, L, D] of this layer (cache dtype). new_k/new_v [B, Hkv, D]
        are the step's new tokens (already stored in the pool), one per row.

        A rebuild costs what a plain gather costs (its result is kept, not copied); the first step
        that continues it moves it into a buffer with spare columns, later ones write one column."""
        assert self._slots is not None, "plan() first"
        bsz, width = self._slots.shape
        key = id(k_cache)
        entry = self._layers.get(key)
        if self._append and entry is not None and entry.cache() is k_cache:
            if not entry.in_buffer:
                entry = self._into_buffer(key, entry)
            if entry is not None:
                rows, cols = torch.arange(bsz, device=new_k.device), self._lens - 1
                entry.keys[rows, :, cols] = new_k.to(entry.keys.dtype)
                entry.values[rows, :, cols] = new_v.to(entry.values.dtype)
                return entry.keys[:, :, :width], entry.values[:, :, :width]
        flat = self._slots.reshape(-1)
        keys = k_cache.index_select(0, flat).view(bsz, width, *k_cache.shape[1:]).transpose(1, 2)
        values = v_cache.index_select(0, flat).view(bsz, width, *v_cache.shape[1:]).transpose(1, 2)
        self._layers.pop(key, None)
        gathered = _LayerKV(weakref.ref(k_cache), keys, values, in_buffer=False)
        if self._used_bytes() + gathered.nbytes <= self.max_bytes:
            self._layers[key] = gathered
        return keys, values

    def _into_buffer(self, key: int, gathered: _LayerKV) -> _LayerKV | None:
        """Last step's gather copied into [B, Hkv, capacity, D] buffers (None: over the byte budget)."""
        bsz, heads, width, dim = gathered.keys.shape
        del self._layers[key]
        need = 2 * bsz * heads * self._capacity * dim * gathered.keys.element_size()
        if self._used_bytes() + need > self.max_bytes:
            return None
        buffers = []
        for old in (gathered.keys, gathered.values):
            buffer = torch.empty(bsz, heads, self._capacity, dim, dtype=old.dtype, device=old.device)
            buffer[:, :, :width].copy_(old)
            buffer[:, :, width:].zero_()  # padding columns of shorter rows are masked, but a mask cannot hide NaN
            buffers.append(buffer)
        entry = _LayerKV(gathered.cache, *buffers, in_buffer=True)
        self._layers[key] = entry
        return entry

    def _used_bytes(self) -> int:
        return sum(e.nbytes for e in self._layers.values())
