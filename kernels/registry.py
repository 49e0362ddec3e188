"""Backend selection: `auto` picks flashinfer (CUDA + importable), else triton on CUDA, else torch."""

from __future__ import annotations

import importlib.util

import torch

from .attention_base import AttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton", "flashinfer")


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def available_backends(device: torch.device | str) -> list[str]:
    names = ["torch"]
    if torch.device(device).type == "cuda":
        if _has("triton"):
            names.append("triton")
        if _has("flashinfer"):
            names.append("flashinfer")
    return names


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name != "auto":
        return name
    avail = available_backends(device)
    for pick in ("flashinfer", "triton"):
        if pick in avail:
            return pick
    return "torch"


def create_attention_backend(name: str, device: torch.device | str, **kwargs) -> AttentionBackend:
    name = resolve_backend_name(name, device)
    if name == "torch":
        from .torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "triton":
        from .triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(**kwargs)
    from .flashinfer_backend import FlashInferAttentionBackend
    return FlashInferAttentionBackend(device=device, **kwargs)
