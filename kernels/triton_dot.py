"""How the Triton attention kernels feed tl.dot: operand dtype and input precision per input dtype.

On a GPU the operands keep the input dtype (bf16/fp16 tensor-core dots accumulating in fp32;
fp32 inputs use exact "ieee" dots so fp32 results match the torch reference to rounding).
Triton's CPU interpreter (TRITON_INTERPRET=1) computes bf16 dots on the raw bits, so there bf16
operands are widened to fp32 first. The widening is exact (bf16 values and their pairwise
products are exact in fp32), so the interpreter still computes what the tensor cores compute,
up to summation order, and bf16 attention is checked on CPU too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@dataclass(frozen=True)
class DotConfig:
    """Constexpr arguments of a kernel's tl.dot calls."""

    operand_dtype: tl.dtype
    precision: str  # tl.dot input_precision


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_config(dtype: torch.dtype, interpreter: bool | None = None) -> DotConfig:
    if dtype not in _TL_DTYPES:
        raise ValueError(f"attention kernels take float32, float16 or bfloat16 inputs, got {dtype}")
    if interpreter is None:
        interpreter = interpreting()
    operand = tl.float32 if interpreter and dtype == torch.bfloat16 else _TL_DTYPES[dtype]
    # "tf32" only matters for fp32 operands, which here are always meant exact.
    return DotConfig(operand, "ieee" if operand == tl.float32 else "tf32")
