"""Attention backends and fused kernels (imports as radix_backend.kernels).

Depends on torch only; nothing here imports radix_backend's engine modules.
"""

import importlib.metadata


def _kernels_distribution_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if __name__ == "kernels" and _kernels_distribution_installed():
    # This source folder was found as the top-level package `kernels` because a checkout's root is
    # on sys.path (e.g. `python -m pytest` run from it), but that name belongs to the installed
    # `kernels` distribution, which transformers (>= 5.25) imports: hand the importer that package.
    # (Without the distribution, transformers only probes the name, and this package answers.)
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _saved_path = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    del sys.modules["kernels"]
    try:
        sys.modules["kernels"] = importlib.import_module("kernels")
    finally:
        sys.path[:] = _saved_path
else:
    from .attention_base import AttentionBackend, AttentionMetadata
    from .registry import available_backends, create_attention_backend

    __all__ = ["AttentionBackend", "AttentionMetadata", "create_attention_backend", "available_backends"]
