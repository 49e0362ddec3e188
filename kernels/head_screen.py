"""The LM head for greedy picks (`csrc/head_screen.c`): a row that only needs its argmax gets every
output from the 8-bit product, about half the work of the exact 16-bit one, and the exact 16-bit
value, computed as the full head computes it, wherever a proven bound says an output may be the
row's largest. The row's argmax is then the full head's, bit for bit: same token, same tie-break.
The other outputs hold their 8-bit values, all below that maximum, so the row is only fit for an
argmax (no logprobs, penalties, bias or masks)."""

from __future__ import annotations

import ctypes

import torch

from . import native
from .q4 import PackedQ4


class ScreenedHead:
    """The screened product of one natively packed head weight; its bound table (4 bytes per
    output and per 16 x 32 weights) is built by the first `table` or screened call."""

    def __init__(self, weight: PackedQ4, valid: int) -> None:
        """`valid`: the head's real outputs (the packing pads to blocks of 16; padding is never picked)."""
        if weight.next is not None or not 0 < valid <= weight.out_features:
            raise ValueError("a screened head is one unchained weight with 1..out_features real outputs")
        self.weight = weight
        self.valid = valid
        self._table: torch.Tensor | None = None

    def table(self, threads: int) -> torch.Tensor:
        """The bound table, built on `threads` threads the first time."""
        if self._table is None:
            groups = self.weight.in_features // 32
            table = torch.empty(self.weight.out_features // 16, 16 + groups)
            if native.library().rb_q4_screen_table(ctypes.byref(self.weight.as_struct()), table.data_ptr(), threads):
                raise native.NativeKernelError("the screened head takes one packed low-bit weight")
            self._table = table
        return self._table

    def __call__(self, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
        """[M, valid] fp32 for x [M, K]: each row's argmax (the first largest) equals the exact head's."""
        if x.dim() != 2 or x.shape[1] != self.weight.in_features:
            raise ValueError(f"x must be [M, {self.weight.in_features}], got {tuple(x.shape)}")
        x = x.float().contiguous()
        table = self.table(threads)
        out = torch.empty(x.shape[0], self.weight.out_features)
        code = native.library().rb_q4_screened(ctypes.byref(self.weight.as_struct()), table.data_ptr(), x.data_ptr(),
                                               x.shape[0], self.valid, out.data_ptr(), threads)
        if code:
            raise native.NativeKernelError("the screened head could not allocate its scratch memory" if code == -1
                                           else "the screened head takes one packed low-bit weight")
        return out[:, :self.valid]
