"""Which fields of a model config the Llama-family decoder honours, checked before any weight is read.

Every field of a supported family's config is either honoured by `models/llama.py`, harmless at
inference (metadata, token ids, dropout, init scales), or refused here by name: a checkpoint whose
config asks for math this decoder does not do (a GELU MLP, dynamic or long-context RoPE, a
quantization scheme, an unknown switch that is on) fails to load instead of running silently wrong.

A sliding window is honoured per layer (`layer_windows`; the attention backends apply it, see
kernels/masked_attention.py). LongRoPE is honoured by limiting the context: HF rotates with its
short factors up to `original_max_position_embeddings` and switches to the long ones beyond, so
the context is capped there. Longer requests get the usual context-length error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radix_backend.errors import ModelLoadError

# Read by the decoder (llama.py) or, for the rope fields, by its RoPE table.
HONOURED = frozenset({
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "hidden_act", "rope_parameters", "rope_theta", "rope_scaling",
    "rope_freq_factors", "sliding_window", "layer_types", "use_sliding_window", "max_window_layers",
    "architectures", "model_type", "partial_rotary_factor", "original_max_position_embeddings",
    "embedding_multiplier", "logits_scaling", "residual_multiplier", "attention_multiplier",
})
# No effect on inference: identity and bookkeeping, token ids, dropout (training only), init scales.
HARMLESS = frozenset({
    "_name_or_path", "_model_name_or_path", "transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "attention_dropout", "initializer_range", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "chunk_size_feed_forward", "id2label", "label2id",
    "is_encoder_decoder", "problem_type", "tokenizer_class", "pretraining_tp", "transformers.js_config",
    "is_llama_config", "tf_legacy_loss", "use_bfloat16", "torchscript", "residual_dropout",
    "embedding_dropout", "hidden_dropout", "mlp_dropout", "decoder_start_token_id", "sep_token_id",
    "task_specific_params", "finetuning_task", "prefix", "cross_attention_hidden_size",
    "add_cross_attention", "tie_encoder_decoder", "pruned_heads", "embd_pdrop", "resid_pdrop",
    "cache_implementation",  # HF's choice of generation cache class
})
# Gemma's fields (models/gemma.py): its GeGLU activation, attention scale, soft-capping of scores and
# logits, and the older integer form of `layer_types`.
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3_text")
GEMMA_HONOURED = frozenset({"hidden_activation", "query_pre_attn_scalar", "final_logit_softcapping",
                            "attn_logit_softcapping", "use_bidirectional_attention", "_sliding_window_pattern",
                            "sliding_window_pattern"})
# Mixture-of-experts fields (models/moe.py); the router's training-time losses and noise are harmless.
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")
MOE_HONOURED = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                          "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                          "mlp_only_layers", "qkv_bias", "output_router_logits", "router_aux_loss_coef",
                          "router_jitter_noise"})
SILU = ("silu", "swish")
GELU_TANH = ("gelu_pytorch_tanh",)
# RoPE kinds Gemma's per-layer-type tables are built for (models/gemma.py).
GEMMA_ROPE = ("default", "linear")
# RoPE kinds whose frequencies do not depend on the sequence length (HF's table is built once), and
# LongRoPE, whose short factors HF uses up to `original_max_position_embeddings` (the context is
# capped there, see `model_limits`).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
SHORT_CONTEXT_ROPE = ("longrope",)
# Weights that are not plain floats: this decoder loads fp16/bf16/fp32 tensors (and GGUF blocks).
REFUSED = {"quantization_config": "a quantized checkpoint (GPTQ, AWQ, bitsandbytes, ...) is not supported; "
                                  "use the fp16/bf16 checkpoint or a GGUF file"}


# The layer kinds of HF's `layer_types` the decoder implements.
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelLimits:
    """What the config means for serving: the longest sequence, and what capped it (if anything)."""

    context_length: int
    capped_by: str | None = None  # "longrope short factors"


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as HF's modeling code reads the config:
    per `layer_types` where the config has them (Qwen2/Qwen3's `use_sliding_window` and
    `max_window_layers` become those, Gemma's interleaving too), else one window on every layer
    (Mistral, Phi-3, Mixtral, Qwen3-MoE)."""
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * layers
    types = getattr(config, "layer_types", None)
    if types:
        return [int(window) if kind == "sliding_attention" else None for kind in types]
    if config.model_type in ("mistral", "phi3", "mixtral", "qwen3_moe"):
        return [int(window)] * layers
    return [None] * layers


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE settings (transformers 5 `rope_parameters`, or the older `rope_scaling` plus
    top-level `rope_theta` / `partial_rotary_factor`)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return params
    legacy = dict(getattr(config, "rope_scaling", None) or {})
    legacy.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    legacy.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return legacy


def rope_kind(params: dict[str, Any]) -> str:
    """HF's RoPE type of those settings ("type" in older configs)."""
    return str(params.get("rope_type", params.get("type", "default")))


def rope_by_layer_type(params: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """Gemma 3's RoPE settings per layer type ({"sliding_attention": ..., "full_attention": ...}), or
    None for one set shared by every layer."""
    if params and all(key in LAYER_TYPES for key in params):
        return params
    return None


def check_model_config(config: Any) -> ModelLimits:
    """Raise ModelLoadError naming every field whose value would change the math unimplemented."""
    fields = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    problems = [f"{name}: {why}" for name, why in REFUSED.items() if fields.get(name)]
    gemma = fields.get("model_type") in GEMMA_FAMILIES
    honoured = HONOURED | (GEMMA_HONOURED if gemma else frozenset()) | (
        MOE_HONOURED if fields.get("model_type") in MOE_FAMILIES else frozenset())
    act = fields.get("hidden_activation") or fields.get("hidden_act", "silu")
    if act not in (GELU_TANH if gemma else SILU):
        problems.append(f"hidden_act={act!r} (implemented: {', '.join(GELU_TANH if gemma else SILU)} for this family)")
    rope = rope_parameters(config)
    per_type = rope_by_layer_type(rope)
    kinds = {rope_kind(p) for p in per_type.values()} if per_type else {rope_kind(rope)}
    allowed = GEMMA_ROPE if gemma else STATIC_ROPE + SHORT_CONTEXT_ROPE
    for kind in sorted(kinds - set(allowed)):
        problems.append(f"rope_type={kind!r} (implemented: {', '.join(allowed)})")
    if gemma and fields.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention (an encoder's attention; only causal decoding is implemented)")
    if fields.get("mlp_bias") and fields.get("model_type") not in ("llama", "granite"):
        problems.append("mlp_bias (implemented for llama and granite only)")
    odd_layers = sorted(set(fields.get("layer_types") or []) - set(LAYER_TYPES))
    if odd_layers:
        problems.append(f"layer_types {odd_layers} (implemented: {', '.join(LAYER_TYPES)})")
    unknown = sorted(name for name, value in fields.items()
                     if name not in honoured and name not in HARMLESS and name not in REFUSED and value
                     not in (None, False, 0, "", [], {}))
    if unknown:
        problems.append(f"unknown fields that are set: {', '.join(unknown)} (not implemented; the model would "
                        "run without them)")
    if problems:
        raise ModelLoadError(f"this {fields.get('model_type', '?')} config asks for what the decoder does not "
                             "implement: " + "; ".join(problems))
    return model_limits(fields, rope)


def model_limits(fields: dict[str, Any], rope: dict[str, Any]) -> ModelLimits:
    """The context length, capped where the computation equals the model's own only up to a
    length: LongRoPE's short-factor range."""
    context = int(fields["max_position_embeddings"])
    limits = ModelLimits(context)
    if rope_kind(rope) in SHORT_CONTEXT_ROPE:
        original = int(rope.get("original_max_position_embeddings") or fields.get("original_max_position_embeddings")
                       or context)
        if original < limits.context_length:
            limits = ModelLimits(original, "longrope short factors")
    return limits
