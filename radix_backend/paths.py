"""Where radix-backend keeps files it derives once and reuses: see radix_backend.kernels.user_cache."""

from radix_backend.kernels.user_cache import CACHE_ENV, cache_dir

__all__ = ["CACHE_ENV", "cache_dir"]
