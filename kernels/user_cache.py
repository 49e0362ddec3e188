"""Where radix-backend keeps files it derives once and reuses (GGUF files dequantized to safetensors,
the native CPU kernels' builds, disk KV blocks). In the kernels layer, the lowest, so that the
kernels' build cache and the core's files follow one rule; `radix_backend.paths` re-exports it."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "RADIX_BACKEND_CACHE"


def cache_dir(create: bool = True) -> Path:
    """The user cache dir: `$RADIX_BACKEND_CACHE`, else `$XDG_CACHE_HOME/radix-backend`, else
    `~/.cache/radix-backend`. Read from the environment on every call so tests can redirect it."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        path = Path(explicit).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
        path = base / "radix-backend"
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path
