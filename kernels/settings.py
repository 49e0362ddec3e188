"""Which kernel families may run: the one switchboard the kernels read.

Each engine's model runner makes its `KernelSettings` from its `EngineConfig` and runs its model
inside `active(settings)`: building it (which kernels its linears take) and every forward. The
settings live in a context variable, so two engines in one process (each forward runs on its own
scheduler thread) keep their own. Nothing under `kernels/` reads the environment;
`EngineConfig.from_env` does, once. Code that calls the kernels directly gets the defaults.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace

ACTIVATION_BITS = (8, 16)


@dataclass(frozen=True)
class KernelSettings:
    native: bool = True  # our C kernels for CPU tensors (where a compiler builds them); off: torch ops
    triton_ops: bool = True  # Triton layer ops for CUDA tensors; off: torch ops
    activation_bits: int = 8  # integers the native low-bit linears take their activations as: 8 or 16
    # every row's arithmetic fixed by the row itself (no split or format chosen by the batch): decode
    # rows take the extend kernel's sums, fp32 linears our fixed-order kernel, no shared-prefix pass
    batch_invariant: bool = True
    # the native attention kernels' products in bf16 pairs (head sizes that are multiples of 32), else fp32
    attention_bf16: bool = False
    # greedy rows' LM head screened: 8-bit products, exact 16-bit ones where a row's maximum may be
    # (same tokens; head_screen.py); off: the full exact head for every row
    screened_head: bool = True

    def __post_init__(self) -> None:
        if self.activation_bits not in ACTIVATION_BITS:
            raise ValueError(f"activation bits must be 8 or 16, got {self.activation_bits!r}")


_current: contextvars.ContextVar[KernelSettings] = contextvars.ContextVar("kernel_settings",
                                                                          default=KernelSettings())


def current() -> KernelSettings:
    return _current.get()


@contextmanager
def _bound(var: contextvars.ContextVar, value) -> Iterator:
    """`var` set to `value` for the block (on this thread or task only)."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def active(settings: KernelSettings) -> AbstractContextManager[KernelSettings]:
    """Run the block's kernels with `settings` (on this thread or task only)."""
    return _bound(_current, settings)


def overridden(**changes: object):
    """The current settings with `changes`, for the duration of the block (tests, benchmarks)."""
    return active(replace(current(), **changes))  # type: ignore[arg-type]


# Threads of our own native matmuls (their spin-then-sleep pool, csrc/thread_pool.c) for the step
# being run; 0: torch's intra-op count. A small CPU step runs torch's ops on one thread (OpenMP's
# hand-off costs more than a second thread gains there) but keeps every core for our matmuls.
_matmul_threads: contextvars.ContextVar[int] = contextvars.ContextVar("matmul_threads", default=0)


def matmul_threads() -> int:
    """How many threads the native matmuls of this step split their rows over."""
    import torch

    return _matmul_threads.get() or torch.get_num_threads()


def native_matmul_threads(threads: int) -> AbstractContextManager[int]:
    """Run the block's native matmuls on `threads` threads, whatever torch's intra-op count."""
    return _bound(_matmul_threads, threads)

