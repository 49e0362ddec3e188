"""A decode step's whole decoder stack in one native call, on 4-bit weights (`csrc/decode_stack.c`).

Small CPU decode steps pay more for ~15 torch ops per layer (Python calls, allocations, the bf16
casts around torch's int4 kernel) than for streaming the weights. `DecodeStack` hands every
layer's norms, 4-bit linears, RoPE, K/V write and attention over the paged pool to C at once, on
fp32 activations and the GGUF's exact Q4_1 weights. It serves decode steps only (one new token per
request) of Llama-style layers without q/k norms; the caller keeps the torch path for the rest.
`pack_q4` / `q4_matmul` are the 4-bit layout and matmul (`csrc/q4_matmul.c`) it and `quant.Int4Linear`
share.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import native

Q4_ROWS = 16  # output rows per block of the packed layout (csrc/q4.h)
GROUP_SIZE = 32  # weights per scale/minimum: GGUF's Q4_1 block


class _Q4Weight(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("params", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", _Q4Weight),
                ("o", _Q4Weight), ("gate_up", _Q4Weight), ("down", _Q4Weight),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class _Dims(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("cos_sin", ctypes.c_void_p)]


@dataclass
class PackedQ4:
    """[N, K] weights w = scale * code + minimum (groups of 32 along K) in the kernel's layout
    (csrc/q4.h): codes [N/16, K/32, 4, 16, 4] uint8 (block, group, quad j, row, byte k: feature
    4j+k in the low nibble, 16+4j+k in the high one), params [N/16, K/32, 2, 16] fp16 (scales, then
    minimums: exact for GGUF, which stores them as fp16)."""

    codes: torch.Tensor
    params: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    out_features: int

    def as_struct(self) -> _Q4Weight:
        return _Q4Weight(self.codes.data_ptr(), self.params.data_ptr(),
                         None if self.bias is None else self.bias.data_ptr(), self.in_features, self.out_features)


def can_pack(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> bool:
    """Whether `pack_q4` keeps these weights exactly: N % 16 == 0, K % 32 == 0, and fp16-representable
    scales and minimums (as GGUF stores them and `quant.q4_1_codes` derives them)."""
    n, k = codes.shape
    return (n % Q4_ROWS == 0 and k % GROUP_SIZE == 0 and torch.equal(scale.half().float(), scale.float())
            and torch.equal(minimum.half().float(), minimum.float()))


def pack_q4(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
            bias: torch.Tensor | None = None) -> PackedQ4:
    """Pack codes [N, K] (0..15) with per-group scale/minimum [N, K/32]; see `can_pack`."""
    if not can_pack(codes, scale, minimum):
        raise ValueError(f"4-bit packing needs N % {Q4_ROWS} == 0, K % {GROUP_SIZE} == 0 and fp16-representable "
                         f"scales and minimums; got {tuple(codes.shape)}")
    n, k = codes.shape
    groups = k // GROUP_SIZE
    blocks = codes.to(torch.uint8).view(n // Q4_ROWS, Q4_ROWS, groups, 2, 4, 4)  # b, row, g, half, j, k
    quads = blocks.permute(0, 2, 3, 4, 1, 5)  # b, g, half, j, row, k
    packed = (quads[:, :, 0] | (quads[:, :, 1] << 4)).contiguous()

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [N/16, G, 16]
        return t.view(n // Q4_ROWS, Q4_ROWS, groups).permute(0, 2, 1)

    params = torch.stack([per_block(scale), per_block(minimum)], dim=2).half().contiguous()
    return PackedQ4(packed, params, None if bias is None else bias.detach().float().contiguous(), k, n)


def q4_matmul(x: torch.Tensor, weight: PackedQ4, threads: int = 1, activation_bits: int = 16) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] fp32, the output rows split over `threads` threads; the
    activations enter as 16-bit (~2e-5 relative error) or 8-bit (~5e-3, half the work) integers."""
    native.check_activation_bits(activation_bits)
    x = x.float().contiguous()
    out = torch.empty(x.shape[0], weight.out_features)
    if native.library().rb_q4_matmul(ctypes.byref(weight.as_struct()), x.data_ptr(), x.shape[0], out.data_ptr(),
                                     threads, activation_bits):
        raise native.NativeKernelError("4-bit matmul could not allocate its scratch memory")
    return out


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden] fp32
    post_norm: torch.Tensor
    qkv: PackedQ4  # q, k, v heads stacked
    o: PackedQ4
    gate_up: PackedQ4  # gate then up
    down: PackedQ4


class DecodeStack:
    """The decoder layers of one model for `run`; keeps the packed tensors alive for the C side."""

    def __init__(self, layers: list[LayerWeights], *, heads: int, kv_heads: int, head_dim: int, eps: float,
                 scale: float, cos_sin: torch.Tensor) -> None:
        if cos_sin.dtype != torch.float32 or cos_sin.shape[-1] != head_dim:
            raise ValueError("the RoPE table must be fp32 [positions, head_dim] (full rotary)")
        self.layers = layers
        self.cos_sin = cos_sin.contiguous()
        hidden = layers[0].input_norm.numel()
        self._dims = _Dims(hidden, heads, kv_heads, head_dim, layers[0].down.in_features, eps, scale,
                           self.cos_sin.data_ptr())
        self._structs = (_Layer * len(layers))()
        for s, w in zip(self._structs, layers):
            s.input_norm, s.post_norm = w.input_norm.data_ptr(), w.post_norm.data_ptr()
            s.qkv, s.o, s.gate_up, s.down = (w.qkv.as_struct(), w.o.as_struct(), w.gate_up.as_struct(),
                                             w.down.as_struct())
        self._bound: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Point the layers at this K/V pool; False (nothing bound) when the kernel cannot read it."""
        if self._bound is kv_caches:
            return True
        if len(kv_caches) != len(self.layers) or not all(
                c.dtype == torch.float32 and c.device.type == "cpu" and c.is_contiguous() for kv in kv_caches for c in kv):
            return False
        for s, (k, v) in zip(self._structs, kv_caches):
            s.k_cache, s.v_cache = k.data_ptr(), v.data_ptr()
        self._bound = kv_caches
        return True

    def run(self, embeddings: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor,
            kv_indices: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
            threads: int = 1, activation_bits: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per request (token t of request t): (last MLP output, residual stream), both
        [T, hidden], whose sum the model's final norm takes; the linears use `threads` threads and
        take their inputs as `activation_bits` integers (see `q4_matmul`). `bind` must have succeeded."""
        native.check_activation_bits(activation_bits)
        residual = embeddings.float().contiguous().clone()
        hidden = torch.empty_like(residual)
        args = [t.to(torch.int64).contiguous() for t in (positions, out_slots, kv_indices, starts, lens)]
        rc = native.library().rb_decode_stack(self._structs, len(self.layers), ctypes.byref(self._dims),
                                              residual.shape[0], *(a.data_ptr() for a in args),
                                              residual.data_ptr(), hidden.data_ptr(), threads, activation_bits)
        if rc:
            raise native.NativeKernelError("the decode step could not allocate its scratch memory")
        return hidden, residual
