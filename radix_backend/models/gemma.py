"""Gemma, Gemma 2 and Gemma 3 (text) decoders over the engine's paged KV pool.

What sets them apart from the Llama family (`llama.py`, whose attention, projections, weight
loading and logits tail they reuse):
- RMSNorm scales by (1 + weight) (HF stores the offset from 1; we add the 1 once at load);
- the MLP is GeGLU with tanh-approximated GELU;
- the embedding is scaled by sqrt(hidden_size), rounded to the model's dtype as HF does;
- Gemma 2/3 wrap both attention and MLP in a norm before and after ("sandwich" norms);
- attention scale from `query_pre_attn_scalar`; Gemma 2 soft-caps the scores
  (`attn_logit_softcapping`) and the final logits (`final_logit_softcapping`); Gemma 3 norms q
  and k per head;
- local (sliding-window) layers interleaved with global ones (`layer_types`), and in Gemma 3
  each kind with its own RoPE base (`rope_parameters` per layer type; linear scaling allowed).
Which config fields are honoured and the refusal of the rest live in `config_check.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from radix_backend.kernels import ops
from radix_backend.kernels.attention_base import ScoreMask

from .config_check import layer_windows, rope_by_layer_type, rope_kind, rope_parameters
from .llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, RMSNorm

ARCHITECTURES = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")


class GemmaRMSNorm(RMSNorm):
    """HF's Gemma norm, x_normed * (1 + w): `weight` holds 1 + w once `GemmaForCausalLM.load_weights`
    has run, so the fused kernels apply it as a plain RMSNorm weight."""


def gemma_rope_table(params: dict, head_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] cos|sin table of one layer type's RoPE settings (default or linear)."""
    theta = float(params.get("rope_theta", 10000.0))
    factor = float(params.get("factor", 1.0)) if rope_kind(params) == "linear" else 1.0
    return ops.build_cos_sin_cache(ops.default_inv_freq(head_dim, theta) / factor, max_positions, 1.0)


def layer_rope(config, layer_type: str) -> dict:
    """The RoPE settings of layers of `layer_type` (Gemma 3 has one set per type)."""
    params = rope_parameters(config)
    per_type = rope_by_layer_type(params)
    return per_type[layer_type] if per_type else params


class GemmaAttention(Attention):
    def __init__(self, config, layer_id: int, tp_size: int = 1,
                 all_reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        super().__init__(config, layer_id, tp_size, all_reduce)
        scalar = getattr(config, "query_pre_attn_scalar", None)  # Gemma 1: none, the head size
        self.scale = float(scalar if scalar is not None else self.head_dim) ** -0.5
        self.qk_norm = config.model_type == "gemma3_text"
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.mask = ScoreMask(window=layer_windows(config)[layer_id],
                              softcap=getattr(config, "attn_logit_softcapping", None))
        self.layer_type = (getattr(config, "layer_types", None) or ["full_attention"] * (layer_id + 1))[layer_id]


class GemmaMLP(MLP):
    activation_name = "gelu_tanh"

    def activate(self, gate_up: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return ops.gelu_tanh_and_mul(gate_up.to(x.dtype))


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_id: int, tp_size: int = 1,
                 all_reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        nn.Module.__init__(self)
        self.self_attn = GemmaAttention(config, layer_id, tp_size, all_reduce)
        self.mlp = GemmaMLP(config, tp_size, all_reduce)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.sandwich = config.model_type != "gemma"  # Gemma 2/3: norms after attention and MLP too
        if self.sandwich:
            self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, hidden, residual, positions, cos_sin, kv, backend, meta):
        if not self.sandwich:
            return super().forward(hidden, residual, positions, cos_sin, kv, backend, meta)
        hidden, residual = self.attend(hidden, residual, positions, cos_sin, kv, backend, meta)
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 1/2/3 text decoders; `forward` as LlamaForCausalLM's."""

    architectures = ARCHITECTURES

    def __init__(self, config, tp=None) -> None:
        super().__init__(config, tp)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        head_dim = self.layers[0].self_attn.head_dim
        self.register_buffer("local_cos_sin_cache", self._rope_table("sliding_attention", head_dim), persistent=False)

    @staticmethod
    def make_layer(config, layer_id: int, tp_size: int, all_reduce) -> nn.Module:
        return GemmaDecoderLayer(config, layer_id, tp_size, all_reduce)

    @staticmethod
    def make_norm(dim: int, eps: float) -> nn.Module:
        return GemmaRMSNorm(dim, eps)

    def _rope_table(self, layer_type: str, head_dim: int) -> torch.Tensor:
        return gemma_rope_table(layer_rope(self.config, layer_type), head_dim, self.config.max_position_embeddings)

    def reset_rope_tables(self, device: torch.device) -> None:
        head_dim = self.layers[0].self_attn.head_dim
        self.cos_sin_cache = self._rope_table("full_attention", head_dim).to(device)
        self.local_cos_sin_cache = self._rope_table("sliding_attention", head_dim).to(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        return hidden * torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden.dtype)

    def layer_cos_sin(self, layer_id: int) -> torch.Tensor:
        local = self.layers[layer_id].self_attn.layer_type == "sliding_attention"
        return self.local_cos_sin_cache if local else self.cos_sin_cache

    def _lm_head(self, hidden: torch.Tensor, argmax_rows: Sequence[int] = ()) -> torch.Tensor:
        # tanh may round two different logits to one value: the argmax is kept exact only by the full head
        logits = super()._lm_head(hidden, () if self.final_softcap is not None else argmax_rows)
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        self.add_one_to_norms()
        return loaded

    def add_one_to_norms(self) -> None:
        """HF stores Gemma's norm weights as offsets from 1 (llama.cpp's GGUF files store 1 + w)."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, GemmaRMSNorm):
                    module.weight.add_(1.0)
