"""Triton's CPU interpreter computes tl.dot with numpy's matmul, i.e. with the BLAS numpy ships
(OpenBLAS). Which kernel that BLAS picks depends on the CPU, and some of them (OpenBLAS's Haswell
kernels, which it takes on AVX2-only CPUs and on AVX-512 CPUs it does not recognise, e.g. AMD
Zen 5) round a row of the product differently by where it sits in the tile. A GPU's tl.dot does
not, and the batch-invariant kernels rely on that, so under the interpreter their invariance
tests would fail or pass by the CPU. `make_dots_row_invariant` swaps in a dot whose every output
element sums its products in one fixed order, whatever its row and the tile's shape."""

from __future__ import annotations

import numpy as np


def ordered_matmul(a: np.ndarray, b: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """a [..., M, K] @ b [..., K, N] in `dtype`: the products of each output element added in the
    order of k (numpy reduces a non-contiguous axis one slice at a time), independent of M and N."""
    products = a.astype(dtype)[..., :, :, None] * b.astype(dtype)[..., None, :, :]
    return products.sum(axis=-2, dtype=dtype)


def make_dots_row_invariant() -> None:
    """Patch the interpreter's tl.dot (call once, in the TRITON_INTERPRET=1 process only)."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):  # fp8: triton's own path
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        result = ordered_matmul(a.data, b.data, d.data.dtype) + d.data
        return interpreter.TensorHandle(result, d.dtype.scalar)

    builder.create_dot = create_dot
