"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite, SmolLM) over the engine's paged KV pool.

Which config fields it honours, and the refusal of every other field that would change the math,
live in `config_check.py`.

One forward call takes a ragged batch: the new tokens of many requests, flattened, each
attending to its own cached prefix through the attention backend. Q/K/V and gate/up
projections are fused into single matmuls, and logits are computed only at the rows asked for.

Tensor parallelism (a `TPShard` given; the process groups live in radix_backend/model_executor/distributed.py,
which this file never imports): q/k/v and gate/up are
column-parallel (each rank holds its slice of heads / intermediate features), o_proj and
down_proj are row-parallel and all-reduce their partial sums. Embeddings, norms and lm_head are
replicated: the simplest correct choice, and for the small vocabularies here their memory is small.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from radix_backend.kernels import ops, quant, settings
from radix_backend.kernels.attention_base import PLAIN, AttentionBackend, AttentionMetadata, ScoreMask
from radix_backend.kernels.decode_stack import DecodeStack, LayerWeights
from radix_backend.kernels.moe_experts import NativeWeight
from radix_backend.kernels.q4 import DenseWeight

from .config_check import layer_windows, rope_kind, rope_parameters

# Decode steps of up to this many tokens run the whole stack in one native call when the model
# has one (`build_decode_stack`). With the native 4-bit matmul serving every batch size (8-bit
# activations above 16 rows), per step against the per-layer path (SmolLM2, 2-core EPYC, 100-token
# contexts, ms, two rounds): 32 tokens 59/46 vs 69/103, 64 tokens 90/76 vs 99/109. Larger steps
# keep the per-layer path, which also serves steps whose requests share a cached prefix.
DECODE_STACK_MAX_TOKENS = 64
# On dense fp32 weights without batch invariance the per-layer path multiplies with oneDNN, which
# passes the stack's fixed-order matmul as rows grow: per step, stack vs per-layer path (SmolLM2
# fp32, 2-core EPYC, ms): 1 row 17.5 vs 28.5, 4: 22 vs 36, 8: 33 vs 34, 16: 53 vs 41, 32: 88 vs 57.
# So such steps use the stack up to 8 tokens. With invariance (the default) both paths run the
# fixed-order kernel and the stack wins at every size (decode tok/s, 16 rows 330-342 vs 270-272,
# 32 rows 416-417 vs 324-351, AMD EPYC Zen 4, 2026-12-05), so the usual limit holds.
DENSE_DECODE_STACK_MAX_TOKENS = 8

LLAMA_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
    "GraniteForCausalLM",
)
# Projections the engine fuses and their parts (q|k|v, gate|up); Phi-3 checkpoints store them fused
_FUSED_PARTS = {"qkv_proj": 3, "gate_up_proj": 2}
# HF weight names split along the output dim (column-parallel) or the input dim (row-parallel)
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class TPShard:
    """This rank's place in a tensor-parallel group: all the model needs to know of it."""

    rank: int
    size: int
    all_reduce: Callable[[torch.Tensor], None]  # in-place sum over the ranks


def check_tp_divisible(config, tp_size: int) -> None:
    """Raise a ValueError naming the sizes when `tp_size` cannot shard this model evenly."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    sizes = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
             "intermediate_size": config.intermediate_size}
    bad = {name: n for name, n in sizes.items() if n % tp_size}
    if bad:
        divisors = [d for d in range(1, sizes["num_key_value_heads"] + 1)
                    if all(n % d == 0 for n in sizes.values())]
        raise ValueError(
            f"tp_size={tp_size} must divide " + ", ".join(f"{k} ({v})" for k, v in sizes.items())
            + f"; it does not divide {', '.join(f'{k} ({v})' for k, v in bad.items())}. "
            f"Valid tp_size values for this model: {divisors}")


def rope_cos_sin_cache(config, head_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, rotary_dim] = cos half then sin half, with HF's rope scaling applied, and a
    GGUF's per-frequency factors (`rope_freq_factors`, Llama 3's rope_freqs.weight: each
    frequency divided by its factor, as llama.cpp does). `rotary_dim` is the head's rotated part
    (`partial_rotary_factor` of it: Phi-4-mini rotates 3/4); the rest passes through unrotated.
    Always computed on the CPU (callers move it): for a model laid out on the meta device these
    ops would run torch's reference implementations, whose first use imports torch._dynamo (with
    triton and sympy: ~0.4 s and ~90 MB of every GGUF load)."""
    with torch.device("cpu"):
        return _rope_cos_sin_cache(config, head_dim, max_positions)


def _rope_cos_sin_cache(config, head_dim: int, max_positions: int) -> torch.Tensor:
    params = rope_parameters(config)
    kind = rope_kind(params)
    rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    if kind in ("default", "linear"):  # HF's formula, without importing its modeling code (~1 s of start-up)
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        factor = float(params.get("factor", 1.0)) if kind == "linear" else 1.0
        inv_freq = ops.default_inv_freq(rotary_dim, theta) / factor
        attention_scaling = 1.0
    else:  # llama3, yarn, longrope: HF's own initialisation (longrope: its short factors, see config_check)
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf_config = config.to_transformers() if hasattr(config, "to_transformers") else config  # a GGUFConfig
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[kind](hf_config, None)
        attention_scaling = float(attention_scaling)
    if inv_freq.numel() * 2 != rotary_dim:
        raise ValueError(f"rope {kind!r} gave {inv_freq.numel() * 2} rotary dims, expected {rotary_dim}")
    factors = getattr(config, "rope_freq_factors", None)
    if factors is not None:
        inv_freq = inv_freq / torch.tensor(factors, dtype=inv_freq.dtype)
    return ops.build_cos_sin_cache(inv_freq, max_positions, attention_scaling)


def residual_multiplier(config) -> float:
    """Granite's scale of each attention / MLP output before its residual add (1 elsewhere)."""
    return float(getattr(config, "residual_multiplier", 1.0)) if config.model_type == "granite" else 1.0


class Linear(nn.Linear):
    """nn.Linear through `ops.linear` (oneDNN for fp32 on the CPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config, layer_id: int, tp_size: int = 1,
                 all_reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads // tp_size  # this rank's heads
        self.num_kv_heads = config.num_key_value_heads // tp_size
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.all_reduce = all_reduce
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Llama / Qwen3 `attention_bias`: q, k, v and o; Qwen2: q, k and v always, never o
        # Qwen2-MoE: `qkv_bias`
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias or config.model_type == "qwen2" or bool(getattr(config, "qkv_bias", False))
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=attention_bias)
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        # Granite sets the attention scale itself and scales each block's output before the residual add
        self.scale = float(config.attention_multiplier) if config.model_type == "granite" else self.head_dim ** -0.5
        self.out_scale = residual_multiplier(config)
        window = layer_windows(config)[layer_id]
        self.mask = PLAIN if window is None else ScoreMask(window=window)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = ops.apply_rotary(q, k, positions, cos_sin)
        out = backend.forward(q, k, v, kv[0], kv[1], meta, self.scale, self.mask)
        out = self.o_proj(out.reshape(n, self.q_size))
        if self.out_scale != 1.0:
            out = out * self.out_scale
        if self.all_reduce is not None:
            self.all_reduce(out)  # row-parallel: sum the ranks' partial products
        return out


class MLP(nn.Module):
    def __init__(self, config, tp_size: int = 1, all_reduce: Callable[[torch.Tensor], None] | None = None,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        intermediate = (intermediate_size or config.intermediate_size) // tp_size
        bias = bool(getattr(config, "mlp_bias", False))  # Llama's gate, up and down biases
        self.intermediate = intermediate
        self.gate_up_proj = Linear(config.hidden_size, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, config.hidden_size, bias=bias)
        self.all_reduce = all_reduce
        self.out_scale = residual_multiplier(config)

    activation_name = "silu"  # what the decode stack runs (kernels/decode_stack.py)

    def activate(self, gate_up: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """act(gate) * up. A quantized gate_up may hand back its dense GEMM's bf16 (no cast to x's
        dtype and back): then SiLU is computed in fp32 and down_proj takes the bf16 directly."""
        return ops.silu_and_mul(gate_up, fp32_math=gate_up.dtype != x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = quant.gated_activation(self.gate_up_proj, x, self.intermediate, self.activation_name)
        if act is None:
            act = self.activate(self.gate_up_proj(x), x)
        out = self.down_proj(act).to(x.dtype)
        if self.out_scale != 1.0:
            out = out * self.out_scale
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, tp_size: int = 1,
                 all_reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_id, tp_size, all_reduce)
        self.mlp = MLP(config, tp_size, all_reduce)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, positions, cos_sin, kv, backend, meta):
        """(the MLP's output, the residual stream it is to be added to): the next layer's input
        norm adds them (fused with the norm)."""
        hidden, residual = self.attend(hidden, residual, positions, cos_sin, kv, backend, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def attend(self, hidden, residual, positions, cos_sin, kv, backend, meta):
        """The previous layer's output added to the stream, normed, through attention:
        (attention output, the stream)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return self.self_attn(hidden, positions, cos_sin, kv, backend, meta), residual


class LlamaForCausalLM(nn.Module):
    """The decoder stack; `forward` returns logits only for `logits_indices` rows. With `tp`, this
    rank's shard (see the module docstring); every rank must run every forward together."""

    architectures = LLAMA_ARCHITECTURES

    def __init__(self, config, tp: TPShard | None = None) -> None:
        super().__init__()
        arch = (getattr(config, "architectures", None) or [self.architectures[0]])[0]
        if arch not in self.architectures:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(self.architectures)}")
        self.tp_rank, self.tp_size = (tp.rank, tp.size) if tp is not None else (0, 1)
        check_tp_divisible(config, self.tp_size)
        all_reduce = tp.all_reduce if tp is not None and tp.size > 1 else None
        self.config = config
        self.vocab_size = config.vocab_size
        # no random init (every weight is loaded; a missing one is refused): on the meta device
        # nn.Embedding's normal_ runs torch's reference ops, whose first use imports torch._dynamo
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(self.make_layer(config, i, self.tp_size, all_reduce)
                                    for i in range(config.num_hidden_layers))
        self.norm = self.make_norm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        granite = config.model_type == "granite"  # its embedding and logit scales (1 elsewhere)
        self.embedding_multiplier = float(config.embedding_multiplier) if granite else 1.0
        self.logits_scaling = float(config.logits_scaling) if granite else 1.0
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        head_dim = self.layers[0].self_attn.head_dim
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(config, head_dim, config.max_position_embeddings),
                             persistent=False)
        self.lm_head_quant: nn.Module | None = None  # set by radix_backend.model_executor.quantize when the head is quantized
        # Intra-op threads for the LM head when the caller runs the rest of a small step on fewer
        # (0: as the caller set). The head is one large matmul, where more threads pay off.
        self.head_threads = 0
        self.decode_stack: DecodeStack | None = None  # set by `build_decode_stack` (native CPU weights)

    @staticmethod
    def make_layer(config, layer_id: int, tp_size: int, all_reduce: Callable[[torch.Tensor], None] | None) -> nn.Module:
        """One decoder layer of this family."""
        return DecoderLayer(config, layer_id, tp_size, all_reduce)

    @staticmethod
    def make_norm(dim: int, eps: float) -> nn.Module:
        return RMSNorm(dim, eps)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                backend: AttentionBackend, meta: AttentionMetadata, logits_indices: torch.Tensor,
                argmax_rows: Sequence[int] = ()) -> torch.Tensor:
        """Logits at the `logits_indices` rows; at `argmax_rows` (positions among them) only each row's
        argmax is exact (the head may screen them: kernels/head_screen.py)."""
        backend.begin_forward(meta)
        hidden = self.embed(input_ids)
        stack = self.decode_stack
        if (stack is not None and input_ids.shape[0] <= self.decode_stack_limit()
                and (slots := backend.native_decode_slots(meta)) is not None and stack.bind(kv_caches)):
            threads = self.head_threads or torch.get_num_threads()  # the step's thread budget
            hidden, residual = stack.run(hidden, positions, meta.out_slots, meta.kv_indices, *slots, threads=threads,
                                         activation_bits=quant.activation_bits(),
                                         invariant=settings.current().batch_invariant,
                                         attention_bf16=settings.current().attention_bf16)
            if stack.final_norm is not None:  # the stack took the final norm of every row
                # the rows asked for are in order and distinct: as many as the step's are all of them
                normed = hidden if logits_indices.numel() == hidden.shape[0] else hidden[logits_indices]
                return self.head_logits(normed, argmax_rows)
        else:
            residual = None
            for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
                hidden, residual = layer(hidden, residual, positions, self.layer_cos_sin(i), kv, backend, meta)
        return self.final_logits(hidden, residual, logits_indices, argmax_rows)

    def decode_stack_limit(self) -> int:
        """The largest step the decode stack takes now: a dense stack yields to oneDNN's per-layer
        linears past DENSE_DECODE_STACK_MAX_TOKENS rows unless the step is batch-invariant."""
        stack = self.decode_stack
        if stack.dense and not settings.current().batch_invariant:
            return min(stack.max_tokens, DENSE_DECODE_STACK_MAX_TOKENS)
        return stack.max_tokens

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings the first layer takes (Granite scales them)."""
        hidden = self.embed_tokens(input_ids)
        return hidden * self.embedding_multiplier if self.embedding_multiplier != 1.0 else hidden

    def layer_cos_sin(self, layer_id: int) -> torch.Tensor:
        """The RoPE table of a layer (one for every layer here)."""
        return self.cos_sin_cache

    def final_logits(self, hidden: torch.Tensor, residual: torch.Tensor, logits_indices: torch.Tensor,
                     argmax_rows: Sequence[int] = ()) -> torch.Tensor:
        """The last layer's output added to the residual stream, normed, through the LM head, at
        the rows asked for."""
        hidden = hidden[logits_indices]
        residual = residual[logits_indices]
        hidden, _ = self.norm(hidden, residual)
        return self.head_logits(hidden, argmax_rows)

    def head_logits(self, hidden: torch.Tensor, argmax_rows: Sequence[int] = ()) -> torch.Tensor:
        """The LM head on normed rows, on the step's whole thread budget."""
        threads = torch.get_num_threads()
        if self.head_threads <= threads:
            return self._lm_head(hidden, argmax_rows)
        torch.set_num_threads(self.head_threads)
        try:
            return self._lm_head(hidden, argmax_rows)
        finally:
            torch.set_num_threads(threads)

    def build_decode_stack(self) -> bool:
        """Let small decode steps run every layer in one native call (kernels/decode_stack.py):
        possible when every linear has a native form (natively packed low-bit weights, or fp32
        `nn.Linear`s on the CPU), the layers are Llama-like ones (pre- or sandwich norms, q/k norms
        per head or none, SiLU or GeGLU MLPs dense or routed, RoPE on all or part of each head,
        Granite's output multiplier) and one process runs them. Returns whether it was set up."""
        attn = self.layers[0].self_attn
        if self.tp_size != 1:
            return False  # one process
        weights = []
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            qkv, o, mlp = _native_weight(a.qkv_proj), _native_weight(a.o_proj), self.stack_mlp(layer)
            cos_sin = self.layer_cos_sin(i).float().contiguous()
            if (qkv is None or o is None or mlp is None or cos_sin.shape[-1] != self.cos_sin_cache.shape[-1]
                    or a.scale != attn.scale or (a.mask.softcap is not None and a.head_dim % 16)
                    or a.out_scale != attn.out_scale or getattr(layer.mlp, "out_scale", 1.0) != attn.out_scale):
                return False  # one rotary width, attention scale and output multiplier; capped scores: dims of 16
            own_table = cos_sin.data_ptr() != self.cos_sin_cache.data_ptr()
            weights.append(LayerWeights(qkv=qkv, o=o, **self.stack_norms(layer),
                                        cos_sin=cos_sin if own_table else None, window=a.mask.window,
                                        activation=getattr(layer.mlp, "activation_name", "silu"),
                                        softcap=a.mask.softcap, **mlp))
        self.decode_stack = DecodeStack(weights, heads=attn.num_heads, kv_heads=attn.num_kv_heads,
                                        head_dim=attn.head_dim, eps=self.config.rms_norm_eps,
                                        scale=attn.scale, cos_sin=self.cos_sin_cache.float(),
                                        max_tokens=DECODE_STACK_MAX_TOKENS, out_scale=attn.out_scale,
                                        final_norm=self._stack_final_norm())
        return True

    def _stack_final_norm(self) -> torch.Tensor | None:
        """The final norm's weight where the stack computes it as `final_logits` would (our RMSNorm
        on fp32 weights with the config's epsilon: the same native add-and-norm), else None."""
        norm = self.norm
        if (not isinstance(norm, RMSNorm) or norm.weight.dtype != torch.float32 or norm.weight.device.type != "cpu"
                or norm.eps != self.config.rms_norm_eps):
            return None
        return _norm_weight(norm)  # the parameter itself (fp32, contiguous): later in-place edits reach the stack

    @staticmethod
    def stack_norms(layer: nn.Module) -> dict:
        """A layer's norms as the decode stack's LayerWeights fields: before attention and MLP,
        Gemma 2/3's after them too (theirs before the MLP is `pre_feedforward_layernorm`), q/k norms per head."""
        a = layer.self_attn
        norms = {"q_norm": _norm_weight(a.q_norm), "k_norm": _norm_weight(a.k_norm)} if a.qk_norm else {}
        if getattr(layer, "sandwich", False):
            return norms | {"input_norm": _norm_weight(layer.input_layernorm),
                            "post_norm": _norm_weight(layer.pre_feedforward_layernorm),
                            "attn_out_norm": _norm_weight(layer.post_attention_layernorm),
                            "mlp_out_norm": _norm_weight(layer.post_feedforward_layernorm)}
        return norms | {"input_norm": _norm_weight(layer.input_layernorm),
                        "post_norm": _norm_weight(layer.post_attention_layernorm)}

    @staticmethod
    def stack_mlp(layer: nn.Module) -> dict | None:
        """A layer's MLP as the decode stack's LayerWeights fields, or None where it has no native form."""
        gate_up, down = _native_weight(layer.mlp.gate_up_proj), _native_weight(layer.mlp.down_proj)
        return None if gate_up is None or down is None else {"gate_up": gate_up, "down": down}

    def _lm_head(self, hidden: torch.Tensor, argmax_rows: Sequence[int] = ()) -> torch.Tensor:
        head = self.lm_head_quant
        if head is not None and argmax_rows and self.logits_scaling == 1.0 and getattr(head, "screens", False):
            return head.screened_rows(hidden, list(argmax_rows))
        if head is not None:
            logits = head(hidden).float()
        else:
            logits = ops.linear(hidden, self.lm_head_weight).float()
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling

    # ---- weights -------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors, fusing q/k/v and gate/up into the stacked projections; returns
        what was loaded (parameter names, #part where a part of one)."""
        params = dict(self.named_parameters())
        stacked = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                   "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            special = self.load_special_weight(name, tensor, params)
            if special:
                loaded.update(special)
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            fused = next((f for f in _FUSED_PARTS if f".{f}." in name), None)
            if fused is not None and self.tp_size > 1:
                raise ValueError(f"a checkpoint with fused {fused} weights cannot be sharded over tp_size="
                                 f"{self.tp_size} yet; run it with tp_size=1")
            tensor = self._tp_slice(name, tensor)
            if fused is not None and name in params:  # stored fused: every shard at once
                param = params[name]
                if param.shape != tensor.shape:
                    raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                                     f"model {tuple(param.shape)}")
                param.data.copy_(tensor)
                loaded.update(f"{name}#{i}" for i in range(_FUSED_PARTS[fused]))
                continue
            for src, (dst, shard) in stacked.items():
                if f".{src}." in name:
                    target = name.replace(f".{src}.", f".{dst}.")
                    self._load_shard(params[target], tensor, dst, shard)
                    loaded.add(f"{target}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint has an unexpected tensor {name!r}")
                param = params[name]
                if param.shape != tensor.shape:
                    raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}")
                param.data.copy_(tensor)
                loaded.add(name)
        expected = self._expected_loaded_names(params)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {missing[:6]}{' ...' if len(missing) > 6 else ''}")
        return loaded

    def load_special_weight(self, name: str, tensor: torch.Tensor, params: dict[str, torch.Tensor]) -> list[str]:
        """A family's own tensor layouts (MoE experts stored one per tensor): the names of `params`
        it filled (with #part suffixes where it filled a part), or [] to load `name` as usual."""
        return []

    def _tp_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor: rows of column-parallel weights (and their
        biases), columns of row-parallel weights; a row-parallel bias on rank 0 only (the ranks'
        partial products are summed, so each adding it would count it `tp_size` times); everything
        else whole."""
        if self.tp_size == 1:
            return tensor
        parts = name.split(".")
        if any(p in parts for p in _COLUMN_PARALLEL):
            dim = 0
        elif any(p in parts for p in _ROW_PARALLEL):
            if parts[-1] == "bias":
                return tensor if self.tp_rank == 0 else torch.zeros_like(tensor)
            dim = 1
        else:
            return tensor
        size = tensor.shape[dim] // self.tp_size
        return tensor.narrow(dim, self.tp_rank * size, size)

    def _load_shard(self, param: torch.Tensor, tensor: torch.Tensor, kind: str, shard: int) -> None:
        if kind == "gate_up_proj":
            size = param.shape[0] // 2
            param.data[shard * size:(shard + 1) * size].copy_(tensor)
            return
        attn = self.layers[0].self_attn
        sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        start = sum(sizes[:shard])
        param.data[start:start + sizes[shard]].copy_(tensor)

    @staticmethod
    def _expected_loaded_names(params: dict[str, torch.Tensor]) -> set[str]:
        out: set[str] = set()
        for name in params:
            fused = next((f for f in _FUSED_PARTS if f".{f}." in name), None)
            if fused is None:
                out.add(name)
            else:
                out.update(f"{name}#{i}" for i in range(_FUSED_PARTS[fused]))
        return out

    def reset_rope_tables(self, device: torch.device) -> None:
        """Rebuild the RoPE tables in fp32 on `device` (after a dtype cast: a bf16 round trip
        would lose precision)."""
        self.cos_sin_cache = rope_cos_sin_cache(self.config, self.layers[0].self_attn.head_dim,
                                                self.config.max_position_embeddings).to(device)


def _norm_weight(norm: nn.Module) -> torch.Tensor:
    return norm.weight.detach().float().contiguous()


def _native_weight(linear: nn.Module) -> NativeWeight | None:
    """The decode stack's form of a linear: its packed low-bit weights, its fp32 weights as they
    are (a plain CPU `Linear`), or None."""
    packed = getattr(linear, "native_q4", None)
    if packed is not None:
        bias = getattr(linear, "bias", None)
        return packed if bias is None else dataclasses.replace(packed, bias=bias.detach().float())
    if type(linear) is Linear and linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu":
        return DenseWeight(linear.weight, linear.bias)
    return None


def build_model(config, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device,
                tp: TPShard | None = None, model_class: type[LlamaForCausalLM] = LlamaForCausalLM) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = model_class(config, tp)
    model = model.to_empty(device=device)
    model.load_weights(weights)
    model = model.to(dtype)
    model.reset_rope_tables(device)
    return model.eval()
