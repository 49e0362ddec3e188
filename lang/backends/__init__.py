"""DSL backends: the in-process engine (default) and an HTTP runtime endpoint."""

from .base import BaseBackend
from .engine_backend import RadixEngineBackend

__all__ = ["BaseBackend", "RadixEngineBackend", "RuntimeEndpoint"]


def __getattr__(name: str):  # RuntimeEndpoint needs httpx: import it only when asked for
    if name == "RuntimeEndpoint":
        from .runtime_endpoint import RuntimeEndpoint

        return RuntimeEndpoint
    raise AttributeError(name)
