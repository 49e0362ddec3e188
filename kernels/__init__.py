"""Attention backends and fused kernels (imports as radix_backend.kernels).

Depends on torch only; nothing here imports radix_backend's engine modules.
"""

from .attention_base import AttentionBackend, AttentionMetadata
from .registry import create_attention_backend, available_backends

__all__ = ["AttentionBackend", "AttentionMetadata", "create_attention_backend", "available_backends"]
