"""Choose and apply the weights' precision for a loaded model (CPU decode is bound by weight bytes).

Modes (`Engine(quantization=...)`, `--quantization`):
- "auto" (default): a GGUF file runs in its own tensor types on the native kernels ("gguf", built
  by `models/gguf_weights.py`; `gguf_report` says per type which kernel runs how many tensors)
  wherever those run (CPU, fp32, one process); everything else is the fp reference ("none").
  Never decided by timing: a busy machine must not change a model's precision.
- "none": the fp32/bf16 reference path, which reproduces HF transformers' greedy tokens (a GGUF
  is dequantized in memory, as gguf's dequantizer does). On the CPU in fp32 its small decode steps
  run the whole stack in one native call on the same fp32 weights (only the summation order differs
  from torch's matmul).
- "int4": every attention and MLP linear as 4-bit groups of 32 (GGUF Q4_1 layout), LM head int8.
  On weights dequantized from Q4_1 the codes are the file's own, recovered exactly.
- "int8": every linear and the LM head as int8 with a scale per output row.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from radix_backend.kernels import native, quant, weight_arena

from ..config import QUANTIZATION_MODES

logger = logging.getLogger(__name__)

_LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


@dataclass
class QuantizationReport:
    """What was applied and why; `lossless` = every int4 layer reproduces the loaded weights exactly."""

    mode: str
    reason: str
    layers: int = 0
    lossless: bool = False
    weight_bytes: int = 0  # read by a small-batch decode step (the low-bit copies)
    dense_dtype: torch.dtype | None = None  # of the dense copy large batches run on (None: no quantization)
    decode_stack: bool = False  # small decode steps run every layer in one native call
    kernels: dict[str, dict[str, int]] | None = None  # "gguf": {ggml type: {kernel: tensors}}

    @property
    def low_bit(self) -> bool:
        """Whether any linear runs on low-bit weights (an all-float GGUF file runs none)."""
        if self.kernels is not None:
            return native_tensors(self.kernels) > 0
        return self.mode != "none"


def validate_mode(mode: str) -> str:
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}; got {mode!r}")
    return mode


def quantize_model(model: nn.Module, mode: str, *, from_gguf: bool, device: torch.device,
                   dtype: torch.dtype, tp_size: int = 1) -> QuantizationReport:
    """Replace the model's linears in place as `mode` says; returns what was done."""
    blocker = native_blocker(device, dtype, tp_size)
    report, codes = _decide(model, validate_mode(mode), from_gguf, blocker)
    if report.mode == "none" and blocker is None and native.available():
        weight_arena.relocate(model)  # the fp32 weights into huge pages: the decode stack reads them every step
        report.decode_stack = model.build_decode_stack()  # the fp32 weights as they are, in one call
    if report.mode != "none":
        report.dense_dtype = quant.dense_dtype_for_large_batches()
        linears = _linears(model)
        exact: list[bool] = []  # per int4 layer: its codes reproduce the loaded weights bit for bit
        for name, lin in linears:
            if report.mode == "int4":
                q = codes.get(name) or quant.q4_1_codes(lin.weight)
                exact.append(q.exact)
                layer = quant.Int4Linear(q, lin.bias, report.dense_dtype)
            else:
                layer = quant.Int8Linear(lin.weight, lin.bias, report.dense_dtype)
            layer.keep_dense_dtype = name.endswith("gate_up_proj")  # the MLP takes it to down_proj as is
            _replace(model, name, layer)
        report.layers = len(linears)
        report.lossless = bool(exact) and all(exact)
        if any(hasattr(layer.mlp, "experts") for layer in model.layers):
            report.reason += " (the MoE experts stay in the checkpoint's precision)"
        # the LM head as int8 rows (GGUF stores it as Q8_0); the fp embedding table stays for lookups
        model.lm_head_quant = quant.Int8Linear(model.lm_head_weight, dense_dtype=report.dense_dtype)
        report.decode_stack = model.build_decode_stack()
    report.weight_bytes = weight_bytes(model)
    return report


def _decide(model: nn.Module, mode: str, from_gguf: bool,
            blocker: str | None) -> tuple[QuantizationReport, dict[str, quant.Int4Codes]]:
    """The mode to apply ("auto" reaches here only where the GGUF's own types cannot run)."""
    if mode == "none":
        return QuantizationReport("none", "quantization='none'"), {}
    if blocker:
        if mode == "auto":
            return QuantizationReport("none", f"auto: {blocker}"), {}
        raise ValueError(f"quantization={mode!r} is not available: {blocker}")
    if mode != "auto":
        return QuantizationReport(mode, f"quantization={mode!r}"), {}
    if from_gguf:
        return QuantizationReport("none", "auto: the GGUF's own types need the native CPU kernels, which are "
                                          "not available here (no C compiler, or native_kernels off)"), {}
    return QuantizationReport("none", "auto: fp checkpoint (pass quantization='int8' or 'int4' to quantize it)"), {}


def gguf_report(model: nn.Module) -> QuantizationReport:
    """What a model built from a GGUF in its own types runs where."""
    counts = kernel_counts(model)
    low = native_tensors(counts)
    total = sum(n for kernels in counts.values() for n in kernels.values())
    summary = ", ".join(f"{kind}: " + ", ".join(f"{n} {kernel}" for kernel, n in kernels.items())
                        for kind, kernels in counts.items())
    report = QuantizationReport("gguf", f"auto: the GGUF's own tensor types ({summary})", layers=total,
                                lossless=True, kernels=counts)
    report.decode_stack = model.build_decode_stack()
    report.weight_bytes = weight_bytes(model)
    if low < total:
        logger.info("GGUF tensors on fp32: %d of %d", total - low, total)
    return report


def native_tensors(counts: dict[str, dict[str, int]]) -> int:
    """How many GGUF tensors of `kernel_counts` run on our native low-bit kernels."""
    return sum(n for kernels in counts.values() for kernel, n in kernels.items() if kernel.startswith("native"))


def kernel_counts(model: nn.Module) -> dict[str, dict[str, int]]:
    """{ggml type: {kernel: tensors}} over the model's GGUF linears (the LM head included)."""
    counts: dict[str, Counter] = {}
    for module in model.modules():
        if isinstance(module, quant.GGUFLinear):
            for kind, kernel in module.kernels:
                counts.setdefault(kind, Counter())[kernel] += 1
    return {kind: dict(c) for kind, c in sorted(counts.items())}


def native_blocker(device: torch.device, dtype: torch.dtype, tp_size: int) -> str | None:
    """Why the native low-bit kernels cannot run this model here (None: they can)."""
    if device.type != "cpu":
        return f"the quantized kernels are CPU kernels (device is {device.type})"
    if dtype != torch.float32:
        return f"it runs on the fp32 model (dtype is {dtype})"
    if tp_size != 1:
        return "tensor parallelism shards fp weights"
    return None


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    out = []
    for i, layer in enumerate(model.layers):
        for parent, attr in _LINEARS:
            module = getattr(getattr(layer, parent), attr, None)  # a routed MoE block has none of the MLP's
            if isinstance(module, nn.Linear):
                out.append((f"layers.{i}.{parent}.{attr}", module))
    return out


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, attr = name.rsplit(".", 1)
    setattr(model.get_submodule(parent_name), attr, module)


def weight_bytes(model: nn.Module) -> int:
    """Bytes a small-batch decode step reads for weights (the embedding table and the dense copies
    that only large batches use are excluded: a lookup reads a few rows)."""
    quantized_head = getattr(model, "lm_head_quant", None) is not None
    embedding = getattr(model.embed_tokens, "weight", None)  # None: a GGUF table read in place
    skip = {id(embedding), id(model.cos_sin_cache)}
    skip.update(id(t) for name, t in model.named_buffers() if name.endswith("dense_weight"))
    if quantized_head and hasattr(model, "lm_head"):
        skip.add(id(model.lm_head.weight))  # kept for lm_head_weight readers; the forward reads the int8 copy
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if id(t) not in skip)
    if not quantized_head and model.tie_word_embeddings:
        total += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total
