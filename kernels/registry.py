"""Backend selection, the one place that picks the attention kernels: `auto` picks flashinfer (CUDA
and it imports), else triton on CUDA; triton first where batch invariance is asked for (its
invariant kernel; FlashInfer splits by the batch); on the CPU the native kernels where they run,
else torch."""

from __future__ import annotations

import functools
import importlib
import logging

import torch

from . import native
from .attention_base import AttentionBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "native", "torch", "triton", "flashinfer")


@functools.cache
def _imports(module: str) -> bool:
    """True if `module` imports. An installed but broken package (wrong CUDA or torch build) counts
    as missing, so `auto` falls back instead of failing on the first forward."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    except Exception as exc:  # e.g. a CUDA library that fails to load at import time
        logger.warning("%s is installed but does not import (%s: %s); not using it", module, type(exc).__name__, exc)
        return False
    return True


def available_backends(device: torch.device | str) -> list[str]:
    names = ["torch"]
    if torch.device(device).type == "cuda":
        names += [name for name in ("triton", "flashinfer") if _imports(name)]
    elif native.available():
        names.append("native")
    return names


def resolve_backend_name(name: str, device: torch.device | str, batch_invariant: bool = False) -> str:
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
    avail = available_backends(device)
    if name == "native" and name not in avail:
        raise ValueError("attention_backend 'native' runs on the CPU with the native kernels, which are not "
                         "available here (a CUDA device, no C compiler, or native_kernels off); use torch")
    if name != "auto":
        return name
    for pick in ("triton", "flashinfer", "native") if batch_invariant else ("flashinfer", "triton", "native"):
        if pick in avail:
            return pick
    return "torch"


def create_attention_backend(name: str, device: torch.device | str, *, page_size: int = 1,
                             batch_invariant: bool = False, **kwargs) -> AttentionBackend:
    """The backend `name` resolves to. `page_size` is the KV pool's: FlashInfer's paged kernels
    need it; torch and triton index token slots directly (any page size works). `batch_invariant`
    gives triton its invariant kernel (the native backend reads the kernel settings itself)."""
    name = resolve_backend_name(name, device, batch_invariant)
    if name == "torch":
        from .torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "native":
        from .native_backend import NativeCPUAttentionBackend
        return NativeCPUAttentionBackend()
    if name == "triton":
        from .triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(batch_invariant=batch_invariant, **kwargs)
    from .flashinfer_backend import FlashInferAttentionBackend
    return FlashInferAttentionBackend(device=device, page_size=page_size, **kwargs)
