"""Weight-only quantized linears on the CPU: our native kernels, else torch's packed-weight ones.

Batch-1 decode reads every weight once per token, so bytes per weight set its speed. Two layers:

- `Int4Linear`: 4-bit codes with a scale and a minimum per group of 32 input features, i.e.
  GGUF's Q4_1 block (w = d * q + m, q in 0..15). Where the native kernels build (`native.py`) it
  runs our own 4-bit kernel (`q4.q4_matmul`: the exact fp16 scale/minimum, integer dot
  products on 8-bit activations, ~5e-3 relative error as llama.cpp's Q8 ones, or 16-bit ones,
  ~2e-5 and about 1.3x the time: `activation_bits`) for every batch size.
  Elsewhere it runs `aten._weight_int4pack_mm_for_cpu`, whose weights are (q - 8) * scale + zero,
  so zero = m + 8 * d; that kernel takes bf16 activations and bf16 scale/zero (its fp32/fp16 paths
  are unvectorized and ~30x slower), ~4e-3 relative error; the result is cast back to the input dtype.
- `Int8Linear`: 8-bit codes: natively in GGUF's Q8_0 layout (an fp16 scale per 32 weights, exact
  for a GGUF's Q8_0 head; `q8.py`), else one scale per output row for `aten._weight_int8pack_mm`
  (bf16 activations). The LM head of a GGUF model and the int8 option for fp checkpoints.

torch's kernels read few bytes but compute slowly, so they win only for a few rows; where they
serve (no native kernels, or no AVX512-VNNI for the tiled 8-bit head), prefill and large decode
batches run a dense GEMM on the same dequantized weights, in bf16 where the CPU has native bf16
and fp32 elsewhere (`dense_dtype_for_large_batches`).

`q4_1_codes` derives Q4_1 codes from dequantized weights. llama.cpp's Q4_1 quantizer sets
m = block min and d = (max - min) / 15 (rounded to fp16), so a weight dequantized from Q4_1 is
re-derived exactly; `exact` reports whether the round trip reproduced every weight bit for bit
(the int4 mode's `lossless`: on a Q4_1 file's dequantized weights the codes are the file's own).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from . import cpu_isa, ggml, head_screen, native, ops, q4, q8, settings
from .q4 import GROUP_SIZE
KERNEL_DTYPE = torch.bfloat16  # activation / scale dtype of torch's vectorized CPU int4/int8 kernels
# Up to this many rows the low-bit kernels beat a dense GEMM in a real forward, where the dense
# copy streams from memory (measured on a 2-core AVX-512 EPYC, SmolLM2 decode step at a 300-token
# context, int4 vs bf16 dense: 85 vs 124 ms at batch 8, about even at 12-16, 248 vs 227 at 32;
# prefill of 1024 tokens 2580 vs 1712 ms). With the weight in cache the crossover is ~8 rows
# (`SMALL_BATCH_ROWS`, below).
SMALL_BATCH_ROWS = 16
# The native low-bit kernels take every row's activations as integers per group of 32 of one width
# for the whole model, whatever the row count, so a row's result never depends on its batch-mates:
# 8 bits by default (llama.cpp's Q8_0/Q8_1 idea, ~5e-3; as fast as 16 bits for one row and faster
# for more), or 16 (every product within ~2e-5 of fp32: the greedy tokens equal the fp32 reference's
# on the same weights, BENCHMARKS.md). LM heads of GGUF models always take 16 bits: they pick the tokens.
HEAD_ACTIVATION_BITS = 16


def activation_bits() -> int:
    """Activation integers of the native low-bit linears: the kernel settings' (8 unless
    `EngineConfig.activation_bits` says 16), for every row count."""
    return settings.current().activation_bits


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


def gated_activation(linear: nn.Module, x: torch.Tensor, half: int, activation: str) -> torch.Tensor | None:
    """act(gate) * up of a gate-then-up `linear` on x [..., K] -> [..., half] in one native pass
    (q4.q4_glu: the matmul's and the activation kernel's bits, without writing the 2 * half products
    out), or None where that pass does not apply: weights off the native low-bit kernel, a bias kept
    outside the packed weight, inputs other than fp32 on the CPU."""
    weight = getattr(linear, "native_q4", None)
    if weight is None or getattr(linear, "bias", None) is not None or not native.supports(x):
        return None
    bits = getattr(linear, "fixed_activation_bits", None) or activation_bits()
    act = q4.q4_glu(x.reshape(-1, x.shape[-1]), weight, half, activation, threads=settings.matmul_threads(),
                    activation_bits=bits)
    return None if act is None else act.view(*x.shape[:-1], half)


class _LowBitLinear(nn.Module):
    """y = x @ W^T (+ bias). Small batches (<= small_batch_rows rows) run the packed low-bit
    kernel, which is bound by weight bytes; larger ones, where that kernel is compute bound and
    2-3x slower than the CPU's GEMM, run a dense matmul on the same weights dequantized once into
    `dense_dtype` (None: always the low-bit kernel, and no dense copy is kept)."""

    small_batch_rows: int
    # True: return the dense GEMM's output in its own dtype (bf16) instead of casting it to the
    # input's, for a caller that feeds it to another dense linear (the MLP's gate_up -> down)
    keep_dense_dtype: bool = False

    def __init__(self, shape: torch.Size, bias: torch.Tensor | None, dense_weight: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = shape
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.register_buffer("dense_weight", None if dense_weight is None else dense_weight.contiguous())

    @property
    def runs_natively(self) -> bool:
        """Whether our native kernel serves every row (a row's result independent of the batch)."""
        raise NotImplementedError

    def _low_bit(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] in the caller's dtype -> [M, N] (any float dtype)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.dense_weight is not None and flat.shape[0] > self.small_batch_rows:
            out = ops.linear(flat.to(self.dense_weight.dtype), self.dense_weight)
            if not self.keep_dense_dtype:
                out = out.to(x.dtype)
        else:
            out = self._low_bit(flat).to(x.dtype)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class Int4Linear(_LowBitLinear):
    """Weights held as packed 4-bit codes with a scale and a minimum (or zero) per group of 32: in
    the native kernel's layout where it builds (`native_q4`), which serves every batch size (see
    `activation_bits`; no dense copy is kept), else in torch's int4pack one, with a dense copy for
    large batches."""

    small_batch_rows = SMALL_BATCH_ROWS

    def __init__(self, q: Int4Codes, bias: torch.Tensor | None = None, dense_dtype: torch.dtype | None = None,
                 use_native: bool = True) -> None:
        native_ok = use_native and native.available() and q4.can_pack(q.codes, q.scale, q.minimum)
        dense = None if dense_dtype is None or native_ok else q.dequantize().to(dense_dtype)
        super().__init__(q.codes.shape, bias, dense)
        self.native_q4 = None
        if native_ok:
            self.native_q4 = q4.pack_q4(q.codes, q.scale, q.minimum)
            self.register_buffer("native_codes", self.native_q4.codes)  # counted in the model's buffers
            self.register_buffer("native_params", self.native_q4.params)
            return
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.codes, 1))
        zero = q.minimum + 8 * q.scale  # the kernel dequantizes (q - 8) * scale + zero
        scales_and_zeros = torch.stack([q.scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/32, N, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(KERNEL_DTYPE))

    @property
    def runs_natively(self) -> bool:
        return self.native_q4 is not None

    def _low_bit(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_q4 is not None:
            return q4.q4_matmul(x, self.native_q4, threads=settings.matmul_threads(),
                                          activation_bits=activation_bits())
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(KERNEL_DTYPE), self.packed, GROUP_SIZE,
                                                          self.scales_and_zeros)

    def extra_repr(self) -> str:
        kernel = "native" if self.native_q4 is not None else "torch int4pack"
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 g{GROUP_SIZE} ({kernel})"


class Int8Linear(_LowBitLinear):
    """Weights held as int8 codes: natively in GGUF's Q8_0 layout (an fp16 scale per 32 weights of a
    row, `q8.py`) where the native kernels build, else with one bf16 scale per row for torch's kernel.
    With AVX512-VNNI the native codes are also tiled for many rows (`q8.tile`), which serves every
    batch size on 16-bit activations (the LM head decides the tokens, so it stays exact) and needs
    no dense copy."""

    # torch's int8 kernel slows down faster with rows than the int4 one (SmolLM2's 49152x576 head:
    # 2.9 ms at 1 row, 5.6 at 8, 25 at 32, against ~9 ms for the bf16 dense copy at 32)
    small_batch_rows = 4

    def __init__(self, weight: torch.Tensor | q8.PackedQ8, bias: torch.Tensor | None = None,
                 dense_dtype: torch.dtype | None = None, use_native: bool = True) -> None:
        """`weight`: fp weights [N, K], or Q8_0 codes already exact (a GGUF tensor's, `ggml.q8_codes`)."""
        packed = tiled = None
        native_ok = use_native and native.available()
        if isinstance(weight, q8.PackedQ8) and not native_ok:
            weight = weight.dequantize()
        if native_ok and (isinstance(weight, q8.PackedQ8) or weight.shape[1] % q8.GROUP_SIZE == 0):
            packed = weight if isinstance(weight, q8.PackedQ8) else q8.q8_0_codes(weight)
            tiled = q8.tile(packed)
            codes, scale = packed.codes, packed.scales
            # a dense copy for large batches would pick the format by row count: not when invariant
            keeps_dense = dense_dtype is not None and tiled is None and not settings.current().batch_invariant
            dense = packed.dequantize().to(dense_dtype) if keeps_dense else None
        else:
            codes, row_scale = int8_rows(weight)
            scale = row_scale.to(KERNEL_DTYPE)
            dense = None if dense_dtype is None else (codes.float() * row_scale[:, None]).to(dense_dtype)
        super().__init__(codes.shape, bias, dense)
        # only the layout the kernel reads is kept: the row codes are the tiles' size again (28 MB
        # for SmolLM2's head)
        self.native_q8, self.native_q8_tiled = (None, tiled) if tiled is not None else (packed, None)
        if tiled is None:
            self.register_buffer("codes", codes)
            self.register_buffer("scale", scale)
        else:
            self.register_buffer("tiled_codes", tiled.codes)
            self.register_buffer("tiled_scales", tiled.scales)
            self.register_buffer("tiled_offsets", tiled.offsets)

    @property
    def runs_natively(self) -> bool:
        return self.native_q8 is not None or self.native_q8_tiled is not None

    def _low_bit(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_q8_tiled is not None:
            return q8.q8_tiled_matmul(x, self.native_q8_tiled, threads=settings.matmul_threads())
        if self.native_q8 is not None:
            return q8.q8_matmul(x, self.native_q8, threads=settings.matmul_threads())
        return torch.ops.aten._weight_int8pack_mm(x.to(KERNEL_DTYPE), self.codes, self.scale)

    def extra_repr(self) -> str:
        layout = ("Q8_0 g32 (native, tiled)" if self.native_q8_tiled is not None
                  else "Q8_0 g32 (native)" if self.native_q8 is not None else "per-row (torch)")
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 {layout}"


@functools.lru_cache(maxsize=1)
def dense_dtype_for_large_batches() -> torch.dtype:
    """bf16 where the CPU has native bf16 arithmetic, else fp32 (elsewhere torch's bf16 GEMM is
    emulated, ~40x slower). Read from the CPU's features, never timed: a busy machine must not
    change the precision."""
    return torch.bfloat16 if has_native_bf16() else torch.float32


NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # CPU flags of native bf16 arithmetic


def has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX-BF16 among its flags, as the
    targeted instruction set sees them: cpu_isa.py); `cpuinfo`: the text of a /proc/cpuinfo, else
    this machine's."""
    flags = _cpu_flags() if cpuinfo is None else _flags_of(cpuinfo)
    return bool(cpu_isa.visible_flags(flags) & NATIVE_BF16_FLAGS)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as handle:
            return _flags_of(handle.read())
    except OSError:
        return set()


def _flags_of(cpuinfo: str) -> set[str]:
    """The flags of a /proc/cpuinfo text (its first "flags" line)."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


class GGUFLinear(nn.Module):
    """y = x @ W^T (+ bias) for one or more weights of the same input (q, k, v; gate, up), each
    kept in its GGUF type and its outputs side by side. Low-bit types (4/5/6/8-bit) run the native
    low-bit kernel, chained into one call when every part fits its 16-row blocks (`native_q4`,
    which the decode stack also takes; a Q8_0 tensor the build cannot multiply exactly,
    `ggml.multiplies_exactly`, runs the native 8-bit kernel, `Int8Linear`, instead); float
    tensors, and every type where the native kernels do not build, run as fp32 (`kernels` says
    which ran where)."""

    def __init__(self, parts: list[ggml.RawTensor], biases: list[torch.Tensor | None] | None = None,
                 fixed_activation_bits: int | None = None) -> None:
        """`fixed_activation_bits`: this layer's activation format (the LM head's 16), else the
        model-wide `activation_bits()`."""
        super().__init__()
        biases = biases or [None] * len(parts)
        self.fixed_activation_bits = fixed_activation_bits
        self.in_features = parts[0].cols
        self.out_sizes = [p.rows for p in parts]
        self.out_features = sum(self.out_sizes)
        self.bias = None  # biases live with their parts
        self.kernels: list[tuple[str, str]] = []  # (ggml type, kernel) per part
        self.native_q4: q4.PackedQ4 | None = None
        self.runners: list = []
        native_ok = native.available()
        # a lone Q8_0 weight at 16-bit activations (the LM head) chains with nothing; on AVX2 without
        # VNNI the 8-bit kernel's int16 products serve it faster (SmolLM2's head, one row: 0.71 vs
        # 1.06 ms), elsewhere the low-bit layout does (0.46 vs 0.57 ms with AVX-512 VNNI)
        q8_head_on_8bit_kernel = (len(parts) == 1 and fixed_activation_bits == 16 and native_ok
                                  and native.library().rb_q4_smallest_8bit_code() == 1)
        packed: list[q4.PackedQ4] = []
        for i, (raw, bias) in enumerate(zip(parts, biases)):
            kind = ggml.type_name(raw.ggml_type)
            low_bit = (native_ok and raw.ggml_type in ggml.LOW_BIT_TYPES
                       and not (q8_head_on_8bit_kernel and raw.ggml_type == ggml.Q8_0))
            if low_bit and ggml.multiplies_exactly(raw):
                weight = ggml.pack(raw, bias=_pad(bias, -raw.rows % q4.Q4_ROWS))
                self._keep(f"part{i}", weight)
                packed.append(weight)
                self.runners.append(weight)
                self.kernels.append((kind, "native low-bit"))
            elif native_ok and raw.ggml_type == ggml.Q8_0:
                layer = Int8Linear(ggml.q8_codes(raw), bias)
                self.add_module(f"part{i}", layer)
                self.runners.append(layer)
                self.kernels.append((kind, "native 8-bit (tiled)" if layer.native_q8_tiled is not None else "native 8-bit"))
            else:
                self.register_buffer(f"part{i}_weight", ggml.dequantize(raw).contiguous())
                self.register_buffer(f"part{i}_bias", None if bias is None else bias.detach().float())
                self.runners.append((getattr(self, f"part{i}_weight"), getattr(self, f"part{i}_bias")))
                self.kernels.append((kind, "fp32 (dequantized)" if raw.ggml_type not in ggml.FLOAT_TYPES else "fp32"))
        if len(packed) == len(parts) and all(p.out_features == n for p, n in zip(packed, self.out_sizes)):
            self.native_q4 = q4.chain(packed) if len(packed) > 1 else packed[0]
        # an exact head (16-bit activations) of one packed weight screens argmax-only rows; its bound
        # table is built now, not on the first greedy request (2 threads: 33-52 ms for SmolLM2's head, 72 ms
        # for a 0.54B file's)
        self.screen = (head_screen.ScreenedHead(packed[0], self.out_features)
                       if len(packed) == 1 == len(parts) and fixed_activation_bits == 16 else None)
        if self.screen is not None:
            self.screen.table(torch.get_num_threads())

    def _keep(self, name: str, weight: q4.PackedQ4) -> None:
        """Register the packed tensors as buffers (counted in the model's size and fingerprint)."""
        for attr in ("codes", "params", "high", "super", "bias"):
            self.register_buffer(f"{name}_{attr}", getattr(weight, attr))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        bits = self.fixed_activation_bits or activation_bits()
        threads = settings.matmul_threads()
        if self.native_q4 is not None:
            out = q4.q4_matmul(flat, self.native_q4, threads=threads, activation_bits=bits)
        else:
            outs = []
            for runner, n in zip(self.runners, self.out_sizes):
                if isinstance(runner, q4.PackedQ4):
                    outs.append(q4.q4_matmul(flat, runner, threads=threads, activation_bits=bits)[:, :n])
                elif isinstance(runner, nn.Module):
                    outs.append(runner(flat.float()))
                else:
                    weight, bias = runner
                    outs.append(ops.linear(flat.float(), weight, bias))
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    @property
    def screens(self) -> bool:
        """Whether `screened_rows` may screen now (kernels built, settings allow)."""
        return self.screen is not None and settings.current().screened_head and native.available()

    def screened_rows(self, x: torch.Tensor, argmax_rows: list[int]) -> torch.Tensor:
        """The head's fp32 outputs for x [M, K], where rows `argmax_rows` are screened
        (`head_screen`: only their argmax is exact); the other rows as `forward` gives them."""
        threads = settings.matmul_threads()
        flat = x.reshape(-1, self.in_features)
        if len(argmax_rows) == flat.shape[0]:
            return self.screen(flat, threads)
        screened = torch.zeros(flat.shape[0], dtype=torch.bool)
        screened[argmax_rows] = True
        out = torch.empty(flat.shape[0], self.out_features)
        out[~screened] = self(flat[~screened]).float()  # each row's outputs are its own (batch invariance)
        out[screened] = self.screen(flat[screened], threads)
        return out

    def extra_repr(self) -> str:
        parts = ", ".join(f"{kind} ({kernel})" for kind, kernel in self.kernels)
        return f"in_features={self.in_features}, out_features={self.out_features}, {parts}"


def low_bit_linears_run_natively(model: nn.Module) -> bool:
    """Whether every weight-only quantized linear of `model` runs our native kernels for every row
    count (GGUF linears always do where they were built natively; fp parts go through `ops.linear`)."""
    return all(m.runs_natively for m in model.modules() if isinstance(m, _LowBitLinear))


def _pad(bias: torch.Tensor | None, extra: int) -> torch.Tensor | None:
    if bias is None or not extra:
        return bias
    return torch.cat([bias.detach().float(), bias.new_zeros(extra, dtype=torch.float32)])


class GGUFEmbedding(nn.Module):
    """Token embeddings read from the GGUF tensor in its own type: a lookup dequantizes only the
    rows it reads (exactly as gguf's dequantizer), so the table costs no memory beyond the file.
    Q8_0 and float tables are read by one native call (csrc/ggml_rows.c: a decode step's lookup
    took ~10 numpy operations), the other types by `ggml.dequantize`."""

    def __init__(self, raw: ggml.RawTensor) -> None:
        super().__init__()
        self.raw = raw
        self.num_embeddings, self.embedding_dim = raw.rows, raw.cols
        rows_apart = raw.data.strides[0] if raw.data.ndim == 2 and raw.data.strides[1] == 1 else None
        self._native_rows = (raw.data.ctypes.data, rows_apart) if raw.ggml_type in ggml.NATIVE_ROW_TYPES and rows_apart else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._native_rows is not None and ids.device.type == "cpu" and native.available():
            return self._read_natively(ids).view(*ids.shape, self.embedding_dim)
        flat = ids.reshape(-1).cpu().numpy()
        return ggml.dequantize(self.raw, flat).to(ids.device).view(*ids.shape, self.embedding_dim)

    def _read_natively(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), self.embedding_dim)
        data, rows_apart = self._native_rows
        rc = native.library().rb_ggml_rows(self.raw.ggml_type, data, self.num_embeddings, self.embedding_dim,
                                           rows_apart, flat.data_ptr(), flat.numel(), out.data_ptr())
        if rc == -2:
            raise IndexError(f"a token id outside the {self.num_embeddings} rows of {self.raw.name}")
        if rc != 0:
            raise native.NativeKernelError(f"the native row reader does not take {self.raw.name}'s type")
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {ggml.type_name(self.raw.ggml_type)} (rows dequantized on lookup)"
