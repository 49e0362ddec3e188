"""Native model implementations written against the paged KV pool."""

from .llama import LlamaForCausalLM, SUPPORTED_ARCHITECTURES, build_model

__all__ = ["LlamaForCausalLM", "SUPPORTED_ARCHITECTURES", "build_model"]
