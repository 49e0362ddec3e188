"""A decode step's whole decoder stack in one native call (`csrc/decode_stack.c`).

Small CPU decode steps pay more for ~15 torch ops per layer (Python calls, allocations, OpenMP
hand-offs, the casts around torch's low-bit kernels) than for streaming the weights. `DecodeStack`
hands every layer's norms, linears, RoPE, K/V write and attention over the paged pool to C at once,
on fp32 activations and either the GGUF's own low-bit weights or the fp32 reference path's dense
ones. It serves decode steps only (one new token per request) of Llama-style layers, with q/k norms
per head (Qwen3) or not, and with a dense or a routed MLP (`moe_experts`); the caller keeps the
torch path for the rest. The weight layouts and matmuls it shares with
the torch path's linears live in `q4.py`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import native
from .moe_experts import MoEBlockStruct, NativeExperts, NativeWeight, SharedExpert
from .q4 import GATED_ACTIVATIONS, DenseWeight, Q4WeightStruct


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", Q4WeightStruct),
                ("o", Q4WeightStruct), ("gate_up", Q4WeightStruct), ("down", Q4WeightStruct),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qk_norm_whole", ctypes.c_int64), ("moe", ctypes.POINTER(MoEBlockStruct)), ("cos_sin", ctypes.c_void_p),
                ("window", ctypes.c_int64), ("attn_out_norm", ctypes.c_void_p), ("mlp_out_norm", ctypes.c_void_p),
                ("activation", ctypes.c_int64), ("softcap", ctypes.c_float)]


class _Dims(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("cos_sin", ctypes.c_void_p), ("rot", ctypes.c_int64),
                ("out_scale", ctypes.c_float), ("attention_bf16", ctypes.c_int64), ("final_norm", ctypes.c_void_p)]


@dataclass
class RoutedMLP:
    """A layer's mixture-of-experts MLP: its router [experts, hidden] and experts (and Qwen2-MoE's
    shared expert)."""

    router: NativeWeight
    experts: NativeExperts
    top_k: int
    renormalise: bool
    shared: SharedExpert | None = None


@dataclass
class LayerWeights:
    input_norm: torch.Tensor | None  # [hidden] fp32 norms before attention and MLP (None: OLMo 2's
    post_norm: torch.Tensor | None   # stream enters both unnormed; its norms are the out_norms below)
    qkv: NativeWeight  # q, k, v heads stacked (one weight, or a chain of three)
    o: NativeWeight
    gate_up: NativeWeight | None  # gate then up (None with `moe`)
    down: NativeWeight | None
    q_norm: torch.Tensor | None = None  # [head_dim] fp32, per head before RoPE (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    qk_norm_whole: bool = False  # OLMo 2: q_norm/k_norm span the whole projection, all heads at once
    moe: RoutedMLP | None = None
    cos_sin: torch.Tensor | None = None  # this layer's RoPE table (Gemma 3's local layers), else the model's
    window: int | None = None  # a sliding window of keys
    attn_out_norm: torch.Tensor | None = None  # Gemma 2/3's norms of the attention and MLP outputs
    mlp_out_norm: torch.Tensor | None = None
    activation: str = "silu"  # or "gelu_tanh" (Gemma's GeGLU)
    softcap: float | None = None  # Gemma 2: attention scores capped as softcap * tanh(s / softcap)


class DecodeStack:
    """The decoder layers of one model for `run`; keeps the packed tensors alive for the C side."""

    def __init__(self, layers: list[LayerWeights], *, heads: int, kv_heads: int, head_dim: int, eps: float,
                 scale: float, cos_sin: torch.Tensor, max_tokens: int = 64, out_scale: float = 1.0,
                 final_norm: torch.Tensor | None = None) -> None:
        """`cos_sin` [positions, rot]: rot <= head_dim features of each head rotate (partial rotary
        passes the rest through); `out_scale`: Granite's multiplier on attention and MLP outputs;
        `final_norm`: the model's final RMSNorm weight [hidden] fp32 (with `eps`), taken by `run`."""
        rot = cos_sin.shape[-1]
        if cos_sin.dtype != torch.float32 or rot > head_dim or rot % 2:
            raise ValueError("the RoPE table must be fp32 [positions, rot], rot even and at most the head size")
        self.layers = layers
        self.max_tokens = max_tokens  # the largest step the caller should hand over (where it pays)
        self.dense = any(isinstance(w, DenseWeight) for layer in layers  # the fp32 path's weights
                         for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
        self.cos_sin = cos_sin.contiguous()
        hidden = layers[0].qkv.in_features
        intermediate = max((w.down.in_features for w in layers if w.moe is None), default=0)
        if final_norm is not None and (final_norm.dtype != torch.float32 or final_norm.shape != (hidden,)
                                       or not final_norm.is_contiguous()):
            raise ValueError(f"the final norm weight must be contiguous fp32 [{hidden}]")
        self.final_norm = final_norm
        self._dims = _Dims(hidden, heads, kv_heads, head_dim, intermediate, eps, scale, self.cos_sin.data_ptr(), rot,
                           out_scale, 0, None if final_norm is None else final_norm.data_ptr())
        self._structs = (_Layer * len(layers))()
        self._blocks = [w.moe.experts.block(w.moe.router, w.moe.top_k, w.moe.renormalise, w.moe.shared) if w.moe else None
                        for w in layers]
        for s, w, block in zip(self._structs, layers, self._blocks):
            if (w.moe is None) == (w.gate_up is None or w.down is None):
                raise ValueError("a layer has either gate_up and down or a routed MLP")
            if (w.input_norm is None) != (w.post_norm is None):
                raise ValueError("a layer has both pre-norms or neither")
            if w.input_norm is not None:
                s.input_norm, s.post_norm = w.input_norm.data_ptr(), w.post_norm.data_ptr()
            s.qk_norm_whole = int(w.qk_norm_whole)
            s.qkv, s.o = w.qkv.as_struct(), w.o.as_struct()
            if block is None:
                s.gate_up, s.down = w.gate_up.as_struct(), w.down.as_struct()
            else:
                s.moe = ctypes.pointer(block)
            if (w.q_norm is None) != (w.k_norm is None):
                raise ValueError("q and k norms come together")
            if w.q_norm is not None:
                s.q_norm, s.k_norm = w.q_norm.data_ptr(), w.k_norm.data_ptr()
            if w.cos_sin is not None:
                if w.cos_sin.dtype != torch.float32 or w.cos_sin.shape[-1] != rot or not w.cos_sin.is_contiguous():
                    raise ValueError("a layer's RoPE table must be contiguous fp32 [positions, rot] as the model's")
                s.cos_sin = w.cos_sin.data_ptr()
            s.window = w.window or 0
            s.attn_out_norm = None if w.attn_out_norm is None else w.attn_out_norm.data_ptr()
            s.mlp_out_norm = None if w.mlp_out_norm is None else w.mlp_out_norm.data_ptr()
            s.activation = GATED_ACTIVATIONS[w.activation]
            native.check_softcap(w.softcap, head_dim)
            s.softcap = w.softcap or 0.0
        self._bound: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Point the layers at this K/V pool; False (nothing bound) when the kernel cannot read it."""
        if self._bound is kv_caches:
            return True
        dtypes = {c.dtype for kv in kv_caches for c in kv}
        if len(kv_caches) != len(self.layers) or len(dtypes) != 1 or not dtypes <= set(native.POOL_DTYPES) or not all(
                c.device.type == "cpu" and c.is_contiguous() for kv in kv_caches for c in kv):
            return False
        if dtypes == {torch.bfloat16} and not native.bf16_attention_dim_ok(self._dims.head_dim):
            return False
        for s, (k, v) in zip(self._structs, kv_caches):
            s.k_cache, s.v_cache = k.data_ptr(), v.data_ptr()
        self._bound = kv_caches
        return True

    def run(self, embeddings: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor,
            kv_indices: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
            sharing: native.KeySharing | None = None, threads: int = 1, activation_bits: int = 16,
            invariant: bool = True, attention_bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per request (token t of request t): (last MLP output, residual stream), both
        [T, hidden], whose sum the model's final norm takes (with `final_norm`: (that norm's output,
        the sum)); the linears use `threads` threads and
        take their inputs as `activation_bits` integers (see `q4_matmul`); `invariant`: attention gives
        each row the extend kernel's bits (`native.decode_attention`), reading the keys of `sharing`'s
        chunks once per chunk; `attention_bf16` (with `invariant`, or a bf16 pool, which needs it): its
        products in bf16 pairs.
        `bind` must have succeeded."""
        native.check_activation_bits(activation_bits)
        residual = embeddings.float().contiguous().clone()
        hidden = torch.empty_like(residual)
        args = [t.to(torch.int64).contiguous() for t in (positions, out_slots, kv_indices, starts, lens)]
        if sharing is not None:
            sharing.check(args[-1])
        kv16 = self._bound[0][0].dtype == torch.bfloat16
        if kv16 and not attention_bf16:
            raise ValueError("a bf16 KV pool is read with bf16 attention products only")
        # a bf16 pool: every row attends with the invariant kernel, which reads it
        self._dims.attention_bf16 = native.KV16_POOL if kv16 else int(attention_bf16 and invariant)
        rc = native.library().rb_decode_stack(self._structs, len(self.layers), ctypes.byref(self._dims),
                                              residual.shape[0], *(a.data_ptr() for a in args),
                                              ctypes.byref(sharing.struct) if sharing is not None else None,
                                              residual.data_ptr(), hidden.data_ptr(), threads, activation_bits,
                                              int(invariant))
        if rc:
            raise native.NativeKernelError("the decode step could not allocate its scratch memory")
        return hidden, residual
