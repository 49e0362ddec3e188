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


class _Q8TiledWeight(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64)]


TILE_ROWS = 16  # output rows per block of the tiled layout


@dataclass
class TiledQ8:
    """The same Q8_0 weights in blocks of 16 output rows for many activation rows at once
    (`csrc/q8_matmul.c`, AVX512-VNNI): codes [N/16, K/32, 8, 16, 4] int8 (block, group, quad j,
    row, features 4j..4j+3), scales [N/16, K/32, 16] fp16, offsets [N/16, K/32, 16] int32
    (128 * each row's code sum over the group)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    in_features: int
    out_features: int

    def as_struct(self) -> _Q8TiledWeight:
        return _Q8TiledWeight(self.codes.data_ptr(), self.scales.data_ptr(), self.offsets.data_ptr(),
                              self.in_features, self.out_features)


def tiled_available() -> bool:
    """Whether the native kernels here have the tiled 8-bit matmul (built with AVX512-VNNI)."""
    return native.available() and bool(native.library().rb_q8_tiled_supported())


def tile(weight: PackedQ8) -> TiledQ8 | None:
    """`weight` in the tiled layout, or None where the kernel is missing or N is not a multiple of 16."""
    n, k = weight.codes.shape
    if n % TILE_ROWS or not tiled_available():
        return None
    groups = k // GROUP_SIZE
    blocks = weight.codes.view(n // TILE_ROWS, TILE_ROWS, groups, 8, 4)
    sums = weight.codes.view(n // TILE_ROWS, TILE_ROWS, groups, GROUP_SIZE).sum(-1, dtype=torch.int32)
    return TiledQ8(blocks.permute(0, 2, 3, 1, 4).contiguous(),
                   weight.scales.view(n // TILE_ROWS, TILE_ROWS, groups).permute(0, 2, 1).contiguous(),
                   (128 * sums).permute(0, 2, 1).contiguous(), k, n)


def q8_tiled_matmul(x: torch.Tensor, weight: TiledQ8, threads: int = 1, activation_bits: int = 16) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] fp32 with the activations as `activation_bits` integers per group
    of 32 (16: within ~2e-5 of fp32, as `q8_matmul`; 8: ~5e-3)."""
    native.check_activation_bits(activation_bits)
    _check_input(x, weight.in_features)
    x = x.float().contiguous()
    out = torch.empty(x.shape[0], weight.out_features)
    rc = native.library().rb_q8_tiled_matmul(ctypes.byref(weight.as_struct()), x.data_ptr(), x.shape[0],
                                            out.data_ptr(), threads, activation_bits)
    if rc:
        raise native.NativeKernelError(f"tiled 8-bit matmul failed ({rc})")
    return out


def q8_matmul(x: torch.Tensor, weight: PackedQ8, threads: int = 1) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] fp32, the output rows split over `threads` threads."""
    _check_input(x, weight.codes.shape[1])
    x = x.float().contiguous()
    out = torch.empty(x.shape[0], weight.codes.shape[0])
    if native.library().rb_q8_matmul(ctypes.byref(weight.as_struct()), x.data_ptr(), x.shape[0], out.data_ptr(),
                                     threads):
        raise native.NativeKernelError("8-bit matmul could not allocate its scratch memory")
    return out


def _check_input(x: torch.Tensor, width: int) -> None:
    if x.dim() != 2 or x.shape[1] != width or x.device.type != "cpu":
        raise ValueError(f"x must be a CPU [M, {width}] tensor, got {tuple(x.shape)} on {x.device}")
