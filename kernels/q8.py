"""8-bit weights in GGUF's Q8_0 layout (one fp16 scale per 32 weights of a row), run natively
(`csrc/q8_matmul.c`): the LM head of a GGUF model, read whole by every small decode step.

A GGUF's Q8_0 tensor, dequantized by the loader, is re-derived here bit for bit (`exact`), so the
head computes with the file's own weights; activations enter as 16-bit integers per group of 32
(~2e-5 relative error), where torch's int8 kernel takes bf16 (~4e-3).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import native

GROUP_SIZE = 32


class _Q8Weight(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("in_features", ctypes.c_int64),
                ("out_features", ctypes.c_int64)]


@dataclass
class PackedQ8:
    codes: torch.Tensor  # [N, K] int8 in -127..127
    scales: torch.Tensor  # [N, K/32] fp16
    exact: bool  # codes * scales reproduces the source weights bit for bit

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        groups = self.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float()
        return (groups * self.scales.float()[..., None]).view(n, k)

    def as_struct(self) -> _Q8Weight:
        n, k = self.codes.shape
        return _Q8Weight(self.codes.data_ptr(), self.scales.data_ptr(), k, n)


def q8_0_codes(weight: torch.Tensor) -> PackedQ8:
    """llama.cpp's Q8_0 rule per group of 32: scale = fp16(max|w| / 127), code = round(w / scale).
    Exact for weights dequantized from Q8_0 (their largest code is +-127)."""
    if weight.dim() != 2 or weight.shape[1] % GROUP_SIZE:
        raise ValueError(f"8-bit groups need [N, K] with K a multiple of {GROUP_SIZE}, got {tuple(weight.shape)}")
    w = weight.detach().float()
    n, k = w.shape
    groups = w.view(n, k // GROUP_SIZE, GROUP_SIZE)
    scales = (groups.abs().amax(-1) / 127).half()
    inv = torch.where(scales.float() > 0, 1.0 / scales.float(), torch.zeros(()))
    codes = torch.round(groups * inv[..., None]).clamp_(-127, 127).to(torch.int8).view(n, k).contiguous()
    packed = PackedQ8(codes, scales.contiguous(), exact=False)
    packed.exact = bool(torch.equal(packed.dequantize(), w))
    return packed


def q8_matmul(x: torch.Tensor, weight: PackedQ8, threads: int = 1) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] fp32, the output rows split over `threads` threads."""
    x = x.float().contiguous()
    out = torch.empty(x.shape[0], weight.codes.shape[0])
    if native.library().rb_q8_matmul(ctypes.byref(weight.as_struct()), x.data_ptr(), x.shape[0], out.data_ptr(),
                                     threads):
        raise native.NativeKernelError("8-bit matmul could not allocate its scratch memory")
    return out
