"""Weight-only quantized linears for CPU decode, on torch's maintained packed-weight kernels.

Batch-1 decode reads every weight once per token, so bytes per weight set its speed. Two layers:

- `Int4Linear`: 4-bit codes with a scale and a minimum per group of 32 input features, i.e.
  GGUF's Q4_1 block (w = d * q + m, q in 0..15). It runs `aten._weight_int4pack_mm_for_cpu`, whose
  weights are (q - 8) * scale + zero, so zero = m + 8 * d. The kernel takes bf16 activations and
  bf16 scale/zero (its fp32/fp16 paths are unvectorized and ~30x slower), so it computes with the
  codes exactly and with scale/zero rounded to bf16; the result is cast back to the input dtype.
- `Int8Linear`: 8-bit codes with one scale per output row (`aten._weight_int8pack_mm`, bf16
  activations): the LM head of a GGUF model (stored as Q8_0) and the int8 option for fp checkpoints.

`q4_1_codes` derives Q4_1 codes from dequantized weights. llama.cpp's Q4_1 quantizer sets
m = block min and d = (max - min) / 15 (rounded to fp16), so a weight dequantized from Q4_1 is
re-derived exactly; `exact` reports whether the round trip reproduced every weight bit for bit,
which is how the loader knows it may run a GGUF model in its own precision.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
from torch import nn

GROUP_SIZE = 32
KERNEL_DTYPE = torch.bfloat16  # activation / scale dtype of torch's vectorized CPU int4/int8 kernels


@dataclass
class Int4Codes:
    """Q4_1-style weights: w[n, k] = scale[n, k // 32] * codes[n, k] + minimum[n, k // 32]."""

    codes: torch.Tensor  # [N, K] int32 in 0..15
    scale: torch.Tensor  # [N, K // 32] fp32 (fp16-representable)
    minimum: torch.Tensor  # [N, K // 32] fp32 (fp16-representable)
    exact: bool  # dequantize() reproduces the source weights bit for bit

    def dequantize(self) -> torch.Tensor:
        return dequantize_int4(self.codes, self.scale, self.minimum)


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """fp32 weights from group codes, computed as GGUF's dequantizer does (d * q + m in fp32)."""
    n, k = codes.shape
    groups = codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float()
    return (scale[..., None] * groups + minimum[..., None]).view(n, k)


def q4_1_codes(weight: torch.Tensor) -> Int4Codes:
    """Quantize [N, K] weights to 4-bit groups of 32 with llama.cpp's Q4_1 rule (min/max per
    group, d and m rounded to fp16). Exact for weights that were dequantized from Q4_1."""
    if weight.dim() != 2 or weight.shape[1] % GROUP_SIZE:
        raise ValueError(f"int4 weights need [N, K] with K a multiple of {GROUP_SIZE}, got {tuple(weight.shape)}")
    w = weight.detach().float()
    n, k = w.shape
    groups = w.view(n, k // GROUP_SIZE, GROUP_SIZE)
    lo, hi = groups.amin(-1), groups.amax(-1)
    minimum = lo.half().float()
    scale = ((hi - minimum) / 15).half().float()
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = torch.round((groups - minimum[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.int32).view(n, k)
    exact = bool(torch.equal(dequantize_int4(codes, scale, minimum), w))
    return Int4Codes(codes, scale, minimum, exact)


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (codes [N, K] int8, scale [N] fp32) with w ~= codes * scale."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


class Int4Linear(nn.Module):
    """y = x @ W^T (+ bias) with W held as packed 4-bit codes, group scale and zero (bf16)."""

    def __init__(self, q: Int4Codes, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.codes.shape
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.codes, 1))
        zero = q.minimum + 8 * q.scale  # the kernel dequantizes (q - 8) * scale + zero
        scales_and_zeros = torch.stack([q.scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/32, N, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(KERNEL_DTYPE))
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP_SIZE, self.scales_and_zeros)
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 g{GROUP_SIZE}"


class Int8Linear(nn.Module):
    """y = x @ W^T (+ bias) with W held as int8 codes and one scale per output row."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        codes, scale = int8_rows(weight)
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale.to(KERNEL_DTYPE))
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scale)
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row"


@functools.lru_cache(maxsize=1)
def int4_kernel_speedup(rows: int = 1536, cols: int = 576) -> float:
    """How much faster the int4 kernel runs a batch-1 matmul than fp32 on this CPU (timed once, a
    few ms). Capability flags alone mislead: the same kernel is fast on AVX-512 and may not be on
    other CPUs, so the choice is measured on the machine that runs it. 0.0 if the kernel is missing."""
    try:
        weight = torch.randn(rows, cols)
        layer = Int4Linear(q4_1_codes(weight))
        x = torch.randn(1, cols)
        layer(x)
    except (RuntimeError, AttributeError, NotImplementedError):
        return 0.0

    def best_of(fn, repeats: int = 5, inner: int = 20) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append(time.perf_counter() - start)
        return min(times)

    dense = best_of(lambda: torch.matmul(x, weight.t()))
    quant = best_of(lambda: layer(x))
    return dense / quant
