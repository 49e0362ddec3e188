"""Native model implementations written against the paged KV pool: one module per family, the
architecture names of each mapped to its class here."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import llama
from .gemma import GemmaForCausalLM
from .llama import LlamaForCausalLM, TPShard
from .moe import MoEForCausalLM
from .olmo2 import Olmo2ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    **{arch: LlamaForCausalLM for arch in LlamaForCausalLM.architectures},
    **{arch: GemmaForCausalLM for arch in GemmaForCausalLM.architectures},
    **{arch: MoEForCausalLM for arch in MoEForCausalLM.architectures},
    **{arch: Olmo2ForCausalLM for arch in Olmo2ForCausalLM.architectures},
}
SUPPORTED_ARCHITECTURES = tuple(MODEL_CLASSES)


def model_class(config) -> type[LlamaForCausalLM]:
    """The class of the config's architecture; a ValueError naming the supported ones otherwise."""
    arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
    if arch not in MODEL_CLASSES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return MODEL_CLASSES[arch]


def build_model(config, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device,
                tp: TPShard | None = None) -> LlamaForCausalLM:
    """The config's model with `weights` (HF names) loaded, in `dtype` on `device`."""
    return llama.build_model(config, weights, dtype, device, tp, model_class(config))


__all__ = ["GemmaForCausalLM", "LlamaForCausalLM", "MODEL_CLASSES", "MoEForCausalLM", "Olmo2ForCausalLM", "SUPPORTED_ARCHITECTURES", "build_model",
           "model_class"]
