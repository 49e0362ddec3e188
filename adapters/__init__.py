"""Framework adapters: LangChain, LlamaIndex, Guidance, DSPy, pydantic-ai, smolagents and Haystack on the
radix engine (the OpenAI SDK in process, for instructor and other OpenAI-client libraries, is
`radix_backend.server.openai_client`).

Importing this package imports no framework; each class is loaded on first access, so a
missing extra only fails (with a MissingDependencyError naming the pip command) when used.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "RadixChatModel": "langchain",
    "RadixLLM": "langchain",
    "RadixLlamaIndexLLM": "llama_index",
    "MiniLMEmbedding": "llama_index_embeddings",
    "RadixGuidance": "guidance",
    "RadixGuidanceEngine": "guidance",
    "RadixLM": "dspy",
    "RadixModel": "pydantic_ai",
    "RadixSmolModel": "smolagents",
    "RadixChatGenerator": "haystack",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
