"""The model config of a GGUF file, without importing transformers' config classes.

A GGUF load builds the config from the file's metadata (`gguf_file.open_gguf`). Importing the
matching transformers class (`LlamaConfig`, `Gemma3TextConfig`, ...) pulls in its validators,
activations, hub kernels and `torch.distributed.tensor`: about a second of every load, a third of
it. `GGUFConfig` holds the same values the class would hold for those arguments, in transformers
5's form (RoPE settings as `rope_parameters`); every field the models read is checked against the
class itself in the tests (`tests/core/test_gguf_config.py`). Fields the class would add with
their defaults (dropouts, init scales, a disabled sliding window) are left out: the models read
them with the same defaults.
"""

from __future__ import annotations

from typing import Any


class GGUFConfig:
    """Attribute access to a model config's fields, like a transformers config."""

    def __init__(self, model_type: str, **fields: Any) -> None:
        self.model_type = model_type
        for name, value in fields.items():
            setattr(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def to_transformers(self) -> Any:
        """transformers' own config class for these values (imports it: for handing the model to
        transformers, e.g. `AutoModelForCausalLM.from_pretrained(..., config=...)`)."""
        from transformers import AutoConfig

        return AutoConfig.for_model(**self.to_dict())

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in sorted(vars(self).items()) if k != "model_type")
        return f"GGUFConfig(model_type={self.model_type!r}, {fields})"


def with_rope_parameters(fields: dict[str, Any]) -> dict[str, Any]:
    """`rope_theta` and `rope_scaling` (None: plain RoPE) folded into transformers 5's
    `rope_parameters`, with the partial rotary factor where the family has one and, for LongRoPE,
    the original context (Phi-3), as its config classes fold them."""
    if "rope_parameters" in fields:
        return fields
    out = dict(fields)
    scaling = out.pop("rope_scaling", None) or {"rope_type": "default"}
    params = {**scaling, "rope_theta": out.pop("rope_theta")}
    if "partial_rotary_factor" in out:
        params["partial_rotary_factor"] = out["partial_rotary_factor"]
    if params["rope_type"] == "longrope" and "original_max_position_embeddings" in out:
        params["original_max_position_embeddings"] = out["original_max_position_embeddings"]
    out["rope_parameters"] = params
    return out
