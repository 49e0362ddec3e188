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
from contextlib import contextmanager
from dataclasses import dataclass, replace

ACTIVATION_BITS = (8, 16)


@dataclass(frozen=True)
class KernelSettings:
    native: bool = True  # our C kernels for CPU tensors (where a compiler builds them); off: torch ops
    triton_ops: bool = True  # Triton layer ops for CUDA tensors; off: torch ops
    large_batch_activation_bits: int = 8  # native low-bit linears above SMALL_BATCH_ROWS rows: 8 or 16

    def __post_init__(self) -> None:
        if self.large_batch_activation_bits not in ACTIVATION_BITS:
            raise ValueError(f"activation bits must be 8 or 16, got {self.large_batch_activation_bits!r}")


_current: contextvars.ContextVar[KernelSettings] = contextvars.ContextVar("kernel_settings",
                                                                          default=KernelSettings())


def current() -> KernelSettings:
    return _current.get()


@contextmanager
def active(settings: KernelSettings) -> Iterator[KernelSettings]:
    """Run the block's kernels with `settings` (on this thread or task only)."""
    token = _current.set(settings)
    try:
        yield settings
    finally:
        _current.reset(token)


def overridden(**changes: object):
    """The current settings with `changes`, for the duration of the block (tests, benchmarks)."""
    return active(replace(current(), **changes))  # type: ignore[arg-type]
