"""Where radix-backend keeps files it derives once and reuses (see radix_backend.kernels.user_cache),
and how a model's path is shown to clients."""

import os

from radix_backend.kernels.user_cache import CACHE_ENV, cache_dir

__all__ = ["CACHE_ENV", "cache_dir", "public_model_name"]


def public_model_name(name: str) -> str:
    """A model name fit to show clients: an HF id as is, a local dir or file by its own name only
    (a response must not reveal the host's filesystem layout)."""
    text = str(name)
    if os.path.isabs(text) or os.path.exists(text) or text.startswith(("~", ".")):
        return os.path.basename(os.path.normpath(text)) or text
    return text
