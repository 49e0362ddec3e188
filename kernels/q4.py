"""Low-bit weights in the kernel's layout (`csrc/q4.h`, `csrc/q4_matmul.c`) and their matmul.

One layout serves GGUF's 4-, 5-, 6- and 8-bit types: per group of 32 input features a weight is
`scale * code + minimum` (Q4_1, Q5_1, Q4_K, Q5_K) or `scale * (code - offset)` (Q4_0, Q5_0, Q8_0
with its codes + 128; Q6_K with a scale per 16 features). Codes keep their low 4 bits as nibbles
in blocks of 16 output rows (one int32 lane each in a 512-bit vector) and, for 5-, 6- and 8-bit
codes, their upper bits in 1, 2 or 4 bit planes. Scales and minimums stay as the file stores
them: fp16 per block of 32 (Q4_0 .. Q5_1, Q8_0), or for the K-quants the int8 sub-block scales
(and minimums) with one fp16 factor pair per super-block of 256, multiplied in the kernel (the
products are exact in fp32, as gguf computes them); fp32 parameters serve anything else.
`kernels/ggml.py` turns a GGUF tensor's blocks into `GroupCodes`; `pack` puts them in this layout.

Weights that share an input (q, k and v of mixed types) can be chained (`chain`): one call, their
outputs side by side.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import native, settings, weight_arena

Q4_ROWS = 16  # output rows per block of the packed layout (csrc/q4.h)
GROUP_SIZE = 32  # input features per scale/minimum

# how a group's parameters give its weights (csrc/q4.h)
SCALE_MIN = 0  # w = scale * code + minimum
SCALE_OFFSET = 1  # w = scale * (code - offset)
SCALE16_OFFSET = 2  # w = scale * (code - offset), a scale per 16 features


class Q4WeightStruct(ctypes.Structure):
    pass


Q4WeightStruct._fields_ = [
    ("codes", ctypes.c_void_p), ("params", ctypes.c_void_p), ("bias", ctypes.c_void_p),
    ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64), ("high", ctypes.c_void_p),
    ("super", ctypes.c_void_p), ("high_bits", ctypes.c_int32), ("layout", ctypes.c_int32),
    ("params_kind", ctypes.c_int32), ("offset", ctypes.c_float), ("next", ctypes.POINTER(Q4WeightStruct)),
    ("dense", ctypes.c_void_p)]
# parameter storage (csrc/q4.h): fp16, fp32, or the K-quants' int8 sub-scales times fp16 factors
PARAMS_KIND = {torch.float16: 0, torch.float32: 1, torch.int8: 2}
SUPER_GROUPS = 8  # groups of 32 per K-quant super-block of 256


@dataclass
class GroupCodes:
    """Weights [N, K] as integer codes with parameters per group of 32 features, before packing:
    `first` is the scale (of features 0..15 for SCALE16_OFFSET), `second` the minimum (SCALE_MIN),
    the scale of features 16..31 (SCALE16_OFFSET) or None (SCALE_OFFSET)."""

    codes: torch.Tensor | None  # [N, K] uint8, < 2 ** (4 + high_bits); None: `pack`'s fill_codes makes them
    first: torch.Tensor  # [N, K / 32] fp32
    second: torch.Tensor | None
    layout: int
    high_bits: int = 0
    offset: float = 0.0
    params_f32: bool = False  # without `factors`: fp32 parameters (else fp16 holds them exactly)
    # K-quants, as stored: first = sub_first * factors[..., 0], second = sub_second * factors[..., 1]
    sub_first: torch.Tensor | None = None  # [N, K / 32] int8
    sub_second: torch.Tensor | None = None  # [N, K / 32] int8
    factors: torch.Tensor | None = None  # [N, K / 256, 2] fp16

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K], computed as GGUF's dequantizers do (one rounding per weight)."""
        n, k = self.codes.shape
        groups = self.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float()
        if self.layout == SCALE_MIN:
            return (self.first[..., None] * groups + self.second[..., None]).view(n, k)
        scale = self.first[..., None].expand(n, k // GROUP_SIZE, GROUP_SIZE)
        if self.layout == SCALE16_OFFSET:
            scale = torch.cat([self.first[..., None].expand(-1, -1, 16), self.second[..., None].expand(-1, -1, 16)], -1)
        return (scale * (groups - self.offset)).view(n, k)


@dataclass
class PackedQ4:
    """[N, K] weights in the kernel's layout (csrc/q4.h): codes [N/16, K/32, 4, 16, 4] uint8 (low
    nibble: feature 4j+k of quad j, high nibble: feature 16+4j+k), high [N/16, K/32, high_bits, 64]
    uint8 or None, params [N/16, K/32, S, 16] fp16, fp32 or (K-quants, with `super`) int8. `next`:
    a chained weight of the same input whose outputs follow this one's."""

    codes: torch.Tensor
    params: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    out_features: int
    high: torch.Tensor | None = None
    high_bits: int = 0
    layout: int = SCALE_MIN
    offset: float = 0.0
    super: torch.Tensor | None = None  # K-quants: [N/16, K/256, 2, 16] fp16 factors of the int8 params
    next: PackedQ4 | None = None
    _struct: Q4WeightStruct | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def total_out(self) -> int:
        return self.out_features + (self.next.total_out if self.next is not None else 0)

    def as_struct(self) -> Q4WeightStruct:
        """The C view of this weight and its chain (kept alive by the objects)."""
        if self._struct is None:
            nxt = ctypes.pointer(self.next.as_struct()) if self.next is not None else None
            self._struct = Q4WeightStruct(
                self.codes.data_ptr(), self.params.data_ptr(), None if self.bias is None else self.bias.data_ptr(),
                self.in_features, self.out_features, None if self.high is None else self.high.data_ptr(),
                None if self.super is None else self.super.data_ptr(), self.high_bits, self.layout,
                PARAMS_KIND[self.params.dtype], self.offset, nxt)
        return self._struct


@dataclass
class DenseWeight:
    """fp32 weights [N, K] as they are, for the native linears (the fp32 reference path's decode
    stack; csrc/f32_matmul.c): same call as the low-bit kinds, no activation rounding."""

    weight: torch.Tensor  # [N, K] fp32, contiguous
    bias: torch.Tensor | None
    _struct: Q4WeightStruct | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.weight.dtype != torch.float32 or self.weight.dim() != 2 or self.weight.device.type != "cpu":
            raise ValueError("a dense native weight is a CPU fp32 matrix [out, in]")
        self.weight = self.weight.detach().contiguous()
        self.bias = None if self.bias is None else self.bias.detach().float().contiguous()

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    total_out = out_features

    def as_struct(self) -> Q4WeightStruct:
        if self._struct is None:
            self._struct = Q4WeightStruct(in_features=self.in_features, out_features=self.out_features,
                                          bias=None if self.bias is None else self.bias.data_ptr(),
                                          dense=self.weight.data_ptr())
        return self._struct


def can_pack(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> bool:
    """Whether `pack_q4` keeps Q4_1-style weights exactly: N % 16 == 0, K % 32 == 0, and
    fp16-representable scales and minimums (as GGUF stores them and `quant.q4_1_codes` derives them)."""
    n, k = codes.shape
    return (n % Q4_ROWS == 0 and k % GROUP_SIZE == 0 and torch.equal(scale.half().float(), scale.float())
            and torch.equal(minimum.half().float(), minimum.float()))


def pack_q4(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
            bias: torch.Tensor | None = None) -> PackedQ4:
    """Pack 4-bit codes [N, K] (0..15) with per-group scale/minimum [N, K/32]; see `can_pack`."""
    if not can_pack(codes, scale, minimum):
        raise ValueError(f"4-bit packing needs N % {Q4_ROWS} == 0, K % {GROUP_SIZE} == 0 and fp16-representable "
                         f"scales and minimums; got {tuple(codes.shape)}")
    return pack(GroupCodes(codes, scale, minimum, SCALE_MIN), bias)


def pack(weights: GroupCodes, bias: torch.Tensor | None = None,
         fill_codes: Callable[[torch.Tensor, torch.Tensor | None, int], None] | None = None) -> PackedQ4:
    """`weights` in the kernel's layout; N must be a multiple of 16 (see `pad_rows`). `fill_codes`
    (nibbles, high planes, N) writes the packed codes where `weights` has none (`ggml.pack`)."""
    n, k = weights.first.shape[0], weights.first.shape[1] * GROUP_SIZE
    if n % Q4_ROWS or k % GROUP_SIZE:
        raise ValueError(f"packing needs N % {Q4_ROWS} == 0 and K % {GROUP_SIZE} == 0; got {(n, k)}")
    if weights.high_bits not in (0, 1, 2, 4):
        raise ValueError(f"codes of 4, 5, 6 or 8 bits only; got high_bits={weights.high_bits}")
    groups = k // GROUP_SIZE
    packed = weight_arena.empty((n // Q4_ROWS, groups, 4, Q4_ROWS, 4), torch.uint8)  # every byte written below
    high = weight_arena.empty((n // Q4_ROWS, groups, weights.high_bits, Q4_ROWS * 4), torch.uint8) if weights.high_bits else None
    if weights.codes is None:
        if fill_codes is None:
            raise ValueError("weights without codes need fill_codes")
        fill_codes(packed, high, n)
    else:
        codes = weights.codes.to(torch.uint8).contiguous()
        native.library().rb_q4_pack_codes(codes.data_ptr(), n, k, weights.high_bits, packed.data_ptr(),
                                          None if high is None else high.data_ptr(), settings.matmul_threads())

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [N/16, G, 16]
        return t.view(n // Q4_ROWS, Q4_ROWS, groups).permute(0, 2, 1)

    superblocks = None
    if weights.factors is not None:  # the file's own int8 sub-scales and fp16 factors
        params = torch.stack([per_block(weights.sub_first), per_block(weights.sub_second)], dim=2).contiguous()
        supers = groups // SUPER_GROUPS
        superblocks = weights.factors.to(torch.float16).view(n // Q4_ROWS, Q4_ROWS, supers, 2)
        superblocks = superblocks.permute(0, 2, 3, 1).contiguous()
    else:
        dtype = torch.float32 if weights.params_f32 else torch.float16
        parts = [weights.first] if weights.second is None else [weights.first, weights.second]
        params = torch.stack([per_block(p.float()) for p in parts], dim=2).to(dtype).contiguous()
    return PackedQ4(packed, params, None if bias is None else bias.detach().float().contiguous(), k, n, high,
                    weights.high_bits, weights.layout, float(weights.offset), superblocks)


def pad_rows(weights: GroupCodes) -> GroupCodes:
    """`weights` with zero rows appended up to a multiple of 16 output rows (their outputs are 0)."""
    n = weights.first.shape[0]
    extra = -n % Q4_ROWS
    if not extra:
        return weights

    def pad(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])

    return GroupCodes(pad(weights.codes), pad(weights.first), pad(weights.second), weights.layout,
                      weights.high_bits, weights.offset, weights.params_f32, pad(weights.sub_first),
                      pad(weights.sub_second), pad(weights.factors))


def chain(parts: list[PackedQ4]) -> PackedQ4:
    """Link weights of one input so one call computes them all, outputs side by side."""
    if any(p.in_features != parts[0].in_features for p in parts):
        raise ValueError("chained weights must share their input size")
    for a, b in zip(parts, parts[1:]):
        a.next, a._struct = b, None
    return parts[0]


def q4_matmul(x: torch.Tensor, weight: PackedQ4 | DenseWeight, threads: int = 1, activation_bits: int = 16) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] fp32 over the chain, the output rows split over `threads`
    threads; the activations enter as 16-bit (~2e-5 relative error) or 8-bit (~5e-3, half the work)
    integers."""
    native.check_activation_bits(activation_bits)
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"x must be [M, {weight.in_features}], got {tuple(x.shape)}")
    x = x.float().contiguous()
    out = torch.empty(x.shape[0], weight.total_out)
    if native.library().rb_q4_matmul(ctypes.byref(weight.as_struct()), x.data_ptr(), x.shape[0], out.data_ptr(),
                                     threads, activation_bits):
        raise native.NativeKernelError("4-bit matmul could not allocate its scratch memory")
    return out


GATED_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # decode_stack.c / q4_matmul.c: RB_SILU, RB_GELU_TANH


def q4_glu(x: torch.Tensor, weight: PackedQ4, half: int, activation: str, threads: int = 1,
           activation_bits: int = 16) -> torch.Tensor | None:
    """act(x @ gate^T) * (x @ up^T) -> [M, half] fp32 for a gate-then-up chain of 2 * half outputs, in
    one pass that never writes the gate and up products out (q4_matmul.c: rb_q4_glu): the same bits as
    `q4_matmul` followed by the activation kernel. None where the weight does not split at a block
    boundary into the two halves (the caller then runs those two)."""
    native.check_activation_bits(activation_bits)
    if not isinstance(weight, PackedQ4) or weight.total_out != 2 * half or half % Q4_ROWS:
        return None
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"x must be [M, {weight.in_features}], got {tuple(x.shape)}")
    x = x.float().contiguous()
    out = torch.empty(x.shape[0], half)
    rc = native.library().rb_q4_glu(ctypes.byref(weight.as_struct()), x.data_ptr(), x.shape[0], out.data_ptr(),
                                    threads, activation_bits, GATED_ACTIVATIONS[activation])
    if rc == -1:
        raise native.NativeKernelError("4-bit matmul could not allocate its scratch memory")
    return out if rc == 0 else None
