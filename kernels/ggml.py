"""GGUF tensors in their own ggml types: decode a tensor's blocks into what our kernels run.

Each quantized type becomes codes with parameters per group of 32 (`q4.GroupCodes`, run by the
low-bit kernel; Q8_0's signed codes as unsigned codes + 128 with an offset of 128, so a fused q/k/v
of mixed types stays one chained call), and Q8_0 also 8-bit codes with an fp16 scale per 32
(`q8.PackedQ8`, the 8-bit kernel); F32, F16 and BF16 tensors are plain floats. The bit layouts
follow ggml's block structs (as `gguf.quants` reads them); `dequantize` gives the same fp32 values
as `gguf.quants.dequantize`, bit for bit (tested per type).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import native, q4, q8, settings

# ggml type ids (ggml.h)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q4_K, Q5_K, Q6_K, BF16 = 12, 13, 14, 30
NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0",
         Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", BF16: "BF16"}
FLOAT_TYPES = (F32, F16, BF16)
LOW_BIT_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)  # run by the low-bit kernel (q4.py)
SUPPORTED = (*FLOAT_TYPES, *LOW_BIT_TYPES)
NATIVE_ROW_TYPES = (*FLOAT_TYPES, Q8_0)  # whose rows csrc/ggml_rows.c reads (embedding lookups)
# (weights per block, bytes per block)
BLOCK = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24),
         Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}


class UnsupportedTensorType(ValueError):
    """A tensor's ggml type has no kernel here."""


def type_name(ggml_type: int) -> str:
    return NAMES.get(ggml_type, f"type {ggml_type}")


def check_supported(ggml_type: int, what: str) -> None:
    if ggml_type not in SUPPORTED:
        try:
            from gguf import GGMLQuantizationType

            name = GGMLQuantizationType(ggml_type).name
        except (ImportError, ValueError):
            name = f"type {ggml_type}"
        raise UnsupportedTensorType(
            f"{what} is stored as {name}, which has no kernel here; supported GGUF tensor types: "
            f"{', '.join(NAMES[t] for t in SUPPORTED)} (re-quantize the file, e.g. to Q4_K_M, with llama-quantize)")


@dataclass
class RawTensor:
    """One tensor as the file stores it: `data` [rows, bytes per row] uint8 (a view of the
    memory-mapped file), logical shape [rows, cols] (ggml's ne[1], ne[0])."""

    name: str
    ggml_type: int
    rows: int
    cols: int
    data: np.ndarray

    def blocks(self, rows: slice | np.ndarray | None = None) -> np.ndarray:
        """[rows, blocks per row, bytes per block] uint8."""
        per_block, nbytes = BLOCK[self.ggml_type]
        data = self.data if rows is None else self.data[rows]
        return data.reshape(data.shape[0], self.cols // per_block, nbytes)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n] codes: the n low nibbles, then the n high ones (ggml's order)."""
    n = qs.shape[-1]
    codes = np.empty(qs.shape[:-1] + (2 * n,), dtype=np.uint8)
    np.bitwise_and(qs, 15, out=codes[..., :n])
    np.right_shift(qs, 4, out=codes[..., n:])
    return codes


def _bits(packed: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 8n] bits, bit j of byte i at 8i + j (a little-endian bit field)."""
    return np.unpackbits(packed, axis=-1, bitorder="little")


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit minimums (ggml's get_scale_min_k4)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def group_codes(t: RawTensor, rows: slice | np.ndarray | None = None, with_codes: bool = True) -> q4.GroupCodes:
    """A low-bit tensor's codes and parameters per group of 32 (`q4.GroupCodes`); without
    `with_codes` the parameters only (codes None: `pack` decodes them natively)."""
    b = t.blocks(rows)
    n = b.shape[0]
    kind = t.ggml_type
    if kind not in LOW_BIT_TYPES:
        raise UnsupportedTensorType(f"{t.name}: {type_name(kind)} is not a low-bit group type")

    def tensor(a: np.ndarray | None, dtype) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a.reshape(n, -1), dtype=dtype))

    p = _group_params(kind, b)
    sub_first, sub_second, factors = p.k_parts or (None, None, None)
    weights = q4.GroupCodes(tensor(_codes(kind, b), np.uint8) if with_codes else None, tensor(p.first, np.float32),
                            tensor(p.second, np.float32), p.layout, p.high_bits, p.offset, p.k_parts is not None,
                            tensor(sub_first, np.int8), tensor(sub_second, np.int8), tensor(factors, np.float16))
    if weights.factors is not None:
        weights.factors = weights.factors.view(n, -1, 2)
    return weights


def _codes(kind: int, b: np.ndarray) -> np.ndarray:
    """Blocks [n, nb, bytes] -> codes [n, nb, weights per block] (the reference decoder; the
    native one in csrc/q4_pack.c gives the same bytes)."""
    n, nb = b.shape[:2]
    if kind in (Q4_0, Q4_1):
        start = 2 if kind == Q4_0 else 4
        return _nibbles(b[..., start:start + 16])
    if kind in (Q5_0, Q5_1):
        start = 2 if kind == Q5_0 else 4
        upper = _bits(b[..., start:start + 4])  # bit i of the little-endian uint32: element i's 5th bit
        codes = _nibbles(b[..., start + 4:start + 20])
        codes |= np.left_shift(upper, 4, out=upper)
        return codes
    if kind == Q8_0:
        return b[..., 2:] ^ np.uint8(0x80)  # the int8 code + 128, as a byte
    if kind in (Q4_K, Q5_K):
        qs = b[..., -128:].reshape(n, nb, 4, 32)  # 4 chunks of 64 weights: low nibbles, then high
        codes = _nibbles(qs).reshape(n, nb, 8, 32)
        if kind == Q5_K:  # bit j of byte i: the 5th bit of element 32j + i
            qh = b[..., 16:48].reshape(n, nb, 1, 32)
            codes = codes | (((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
        return codes
    ql, qh = b[..., 0:128], b[..., 128:192]  # Q6_K
    low = _nibbles(ql.reshape(n, nb, 2, 64))  # 2 chunks of 128 weights
    upper = (qh.reshape(n, nb, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    return low | (upper.reshape(n, nb, 2, 128) << 4)


@dataclass
class _GroupParams:
    """`q4.GroupCodes`' fields but the codes, as numpy arrays [n, nb, ...]."""

    first: np.ndarray
    second: np.ndarray | None
    layout: int
    high_bits: int
    offset: float
    k_parts: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # int8 sub-scales, sub-minimums, fp16 factors


def _group_params(kind: int, b: np.ndarray) -> _GroupParams:
    """The parameters per group of 32 of low-bit blocks b [n, nb, bytes]."""
    n, nb = b.shape[:2]
    if kind in (Q4_0, Q4_1):
        d = _f16(b[..., 0:2])
        if kind == Q4_0:
            return _GroupParams(d, None, q4.SCALE_OFFSET, 0, 8.0)
        return _GroupParams(d, _f16(b[..., 2:4]), q4.SCALE_MIN, 0, 0.0)
    if kind in (Q5_0, Q5_1):
        d = _f16(b[..., 0:2])
        if kind == Q5_0:
            return _GroupParams(d, None, q4.SCALE_OFFSET, 1, 16.0)
        return _GroupParams(d, _f16(b[..., 2:4]), q4.SCALE_MIN, 1, 0.0)
    if kind == Q8_0:
        return _GroupParams(_f16(b[..., 0:2]), None, q4.SCALE_OFFSET, 4, 128.0)
    if kind in (Q4_K, Q5_K):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        scale = d[..., None] * sc  # [n, nb, 8]: exact in fp32, as gguf computes it
        minimum = -(dmin[..., None] * mn)
        factors = np.stack([d, -dmin], axis=-1).astype(np.float16)  # -dmin * m == -(dmin * m) exactly
        return _GroupParams(scale, minimum, q4.SCALE_MIN, int(kind == Q5_K), 0.0, (sc, mn, factors))
    scales, d = b[..., 192:208], _f16(b[..., 208:210])  # Q6_K
    sub = np.ascontiguousarray(scales).view(np.int8).reshape(n, nb, 8, 2)
    scale = d[..., None, None] * sub.astype(np.float32)
    factors = np.stack([d, d], axis=-1).astype(np.float16)
    return _GroupParams(scale[..., 0], scale[..., 1], q4.SCALE16_OFFSET, 2, 32.0, (sub[..., 0], sub[..., 1], factors))


def multiplies_exactly(t: RawTensor) -> bool:
    """Whether this CPU's build computes with the low-bit layout of `t` exactly: every tensor but a
    Q8_0 one holding a code of -128 (the byte 0x80, valid but never written by llama.cpp) on AVX2
    without VNNI, whose 8-bit products take the codes (+ 128) as signed bytes."""
    if t.ggml_type != Q8_0 or native.library().rb_q4_smallest_8bit_code() == 0:
        return True
    return not bool(np.any(t.blocks()[..., 2:] == 0x80))


def pack(t: RawTensor, bias: torch.Tensor | None = None) -> q4.PackedQ4:
    """A low-bit tensor in the kernel's layout (rows padded to 16), its codes decoded and packed
    straight from the file's blocks by the native packer (csrc/q4_pack.c): a load never holds a
    tensor's unpacked codes."""
    data = np.ascontiguousarray(t.data)
    per_block, nbytes = BLOCK[t.ggml_type]
    if data.dtype != np.uint8 or data.shape != (t.rows, t.cols // per_block * nbytes):  # the C code trusts it
        raise ValueError(f"{t.name}: blocks {data.shape} {data.dtype} do not hold {t.rows} x {t.cols} "
                         f"{type_name(t.ggml_type)} weights")
    params = q4.pad_rows(group_codes(t, with_codes=False))

    def fill(nibbles: torch.Tensor, high: torch.Tensor | None, n: int) -> None:
        if native.library().rb_ggml_pack(t.ggml_type, data.ctypes.data, t.rows, n, t.cols, data.shape[1],
                                         params.high_bits, nibbles.data_ptr(),
                                         None if high is None else high.data_ptr(), settings.matmul_threads()):
            raise UnsupportedTensorType(f"{t.name}: {type_name(t.ggml_type)} has no native packer")

    return q4.pack(params, bias, fill_codes=fill)


def q8_codes(t: RawTensor, rows: slice | np.ndarray | None = None) -> q8.PackedQ8:
    """A Q8_0 tensor's codes and fp16 scales (exact)."""
    b = t.blocks(rows)
    n = b.shape[0]
    scales = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
    codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, -1)
    return q8.PackedQ8(torch.from_numpy(codes.copy()), torch.from_numpy(scales.copy()), exact=True)


def dequantize(t: RawTensor, rows: slice | np.ndarray | None = None) -> torch.Tensor:
    """fp32 [rows, cols] of the whole tensor or the given rows, equal to gguf.quants.dequantize."""
    kind = t.ggml_type
    check_supported(kind, t.name)
    if kind in FLOAT_TYPES:
        data = t.data if rows is None else t.data[rows]
        dtype = {F32: np.float32, F16: np.float16, BF16: np.uint16}[kind]
        values = np.ascontiguousarray(data).view(dtype)
        if kind == BF16:
            return torch.from_numpy((values.astype(np.uint32) << 16).view(np.float32))
        return torch.from_numpy(values.astype(np.float32))
    if kind == Q8_0:
        return _q8_0_values(t.blocks(rows))
    return group_codes(t, rows).dequantize()


def _q8_0_values(b: np.ndarray) -> torch.Tensor:
    """Q8_0 blocks [n, nb, 34] as fp32 [n, nb * 32]: code * fp16 scale, gguf's arithmetic, straight
    from the blocks (an embedding lookup per decode step: ~2x faster than through `q8_codes`)."""
    scales = np.ascontiguousarray(b[..., :2]).view(np.float16).astype(np.float32)
    return torch.from_numpy((b[..., 2:].view(np.int8).astype(np.float32) * scales).reshape(b.shape[0], -1))
