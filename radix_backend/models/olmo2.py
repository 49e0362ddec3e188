"""OLMo 2 over the engine's paged KV pool: Llama's blocks with norms after, not before, attention and
MLP, and q/k RMSNorms over the whole projection (all heads together, before the split into heads).

A layer computes x + norm(attn(x)), then y + norm(mlp(y)); the model's final norm follows. In the
decoder's convention (a layer returns its block output and the residual stream it is added to),
the stream is the previous layer's output plus its residual.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from radix_backend.kernels import ops
from radix_backend.kernels.attention_base import AttentionBackend, AttentionMetadata

from .llama import MLP, Attention, LlamaForCausalLM, RMSNorm, _norm_weight

ARCHITECTURES = ("Olmo2ForCausalLM",)


class Olmo2Attention(Attention):
    def __init__(self, config, layer_id: int, tp_size: int = 1,
                 all_reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        if tp_size != 1:
            raise ValueError("OLMo 2 runs with tp_size=1 (its q/k norms span every head)")
        super().__init__(config, layer_id, tp_size, all_reduce)
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.contiguous()).reshape(n, self.num_heads, self.head_dim)
        k = self.k_norm(k.contiguous()).reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        q, k = ops.apply_rotary(q, k, positions, cos_sin)
        out = backend.forward(q, k, v, kv[0], kv[1], meta, self.scale, self.mask)
        return self.o_proj(out.reshape(n, self.q_size))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, tp_size: int = 1,
                 all_reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer_id, tp_size, all_reduce)
        self.mlp = MLP(config, tp_size, all_reduce)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, positions, cos_sin, kv, backend, meta):
        stream = hidden if residual is None else hidden + residual
        stream = stream + self.post_attention_layernorm(self.self_attn(stream, positions, cos_sin, kv, backend, meta))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2; `forward` as LlamaForCausalLM's."""

    architectures = ARCHITECTURES

    @staticmethod
    def make_layer(config, layer_id: int, tp_size: int, all_reduce) -> nn.Module:
        return Olmo2DecoderLayer(config, layer_id, tp_size, all_reduce)

    @staticmethod
    def stack_norms(layer: nn.Module) -> dict:
        """No norms before attention or MLP: both outputs normed, q and k over the whole projection."""
        a = layer.self_attn
        return {"input_norm": None, "post_norm": None, "q_norm": _norm_weight(a.q_norm),
                "k_norm": _norm_weight(a.k_norm), "qk_norm_whole": True,
                "attn_out_norm": _norm_weight(layer.post_attention_layernorm),
                "mlp_out_norm": _norm_weight(layer.post_feedforward_layernorm)}
