"""A mixture-of-experts MLP on the native kernels (`csrc/moe.c`): routing and the picked experts.

The per-layer path (`models/moe.py`) and the one-call decode stack (`decode_stack.py`) both run a
routed block through these kernels, so a token gets the same bits whichever path its step takes.
For one token the picked experts run as two calls (their gate|up weights chained on the shared
input, their down projections over each pick's own row); for more tokens the rows are grouped by
expert, so each expert any row picked reads its weights once per step.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import native
from .q4 import DenseWeight, PackedQ4, Q4WeightStruct, q4_matmul

NativeWeight = PackedQ4 | DenseWeight


class MoEBlockStruct(ctypes.Structure):
    _fields_ = [("router", ctypes.POINTER(Q4WeightStruct)), ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p),
                ("experts", ctypes.c_int64), ("top_k", ctypes.c_int64), ("renormalise", ctypes.c_int64),
                ("shared_gate_up", ctypes.POINTER(Q4WeightStruct)), ("shared_down", ctypes.POINTER(Q4WeightStruct)),
                ("shared_gate", ctypes.POINTER(Q4WeightStruct)), ("shared_intermediate", ctypes.c_int64)]


@dataclass
class SharedExpert:
    """Qwen2-MoE's shared expert in native form: a SiLU MLP (gate|up chained, down) added to the routed
    experts' sum times sigmoid(gate . x); `gate` is the fp32 [1, hidden] weight."""

    gate_up: NativeWeight
    down: NativeWeight
    gate: DenseWeight

    def __post_init__(self) -> None:
        if self.gate.out_features != 1 or self.gate_up.total_out != 2 * self.down.in_features:
            raise ValueError("a shared expert needs a one-row fp32 gate and gate|up twice down's input")

    def __call__(self, out: torch.Tensor, x: torch.Tensor, threads: int, activation_bits: int) -> torch.Tensor:
        """out + sigmoid(gate . x) * mlp(x), each step the kernel the decode stack runs."""
        hidden = native.silu_and_mul(q4_matmul(x, self.gate_up, threads=threads, activation_bits=activation_bits))
        shared = q4_matmul(hidden, self.down, threads=threads, activation_bits=activation_bits)
        logits = q4_matmul(x, self.gate, threads=threads, activation_bits=activation_bits)
        return native.sigmoid_gated_add(out, logits, shared)


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (expert ids [T, top_k] int64, weights [T, top_k] fp32): each row's top_k
    experts by softmax probability, largest first, the probabilities renormalised over the picks
    when asked (Mixtral; Qwen's `norm_topk_prob`)."""
    native.check_float32("router logits", logits, 2)
    tokens, experts = logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in 1..{experts}, got {top_k}")
    logits = logits.contiguous()
    ids = torch.empty(tokens, top_k, dtype=torch.int64)
    weights = torch.empty(tokens, top_k, dtype=torch.float32)
    native.library().rb_moe_route(logits.data_ptr(), tokens, experts, top_k, int(renormalise), ids.data_ptr(),
                                  weights.data_ptr())
    return ids, weights


class NativeExperts:
    """Every expert's gate|up weight (a chain: gate then up) and down weight, as the kernel takes
    them; keeps the weights alive for the C side."""

    def __init__(self, gate_up: list[NativeWeight], down: list[NativeWeight]) -> None:
        if not gate_up or len(gate_up) != len(down):
            raise ValueError(f"{len(gate_up)} gate|up and {len(down)} down weights")
        hidden, width, out = gate_up[0].in_features, gate_up[0].total_out, down[0].total_out
        for g, d in zip(gate_up, down):
            if g.in_features != hidden or g.total_out != width or d.in_features * 2 != width or d.total_out != out:
                raise ValueError("every expert needs gate|up [2I, H] and down [H, I] of the same shapes")
        if any(isinstance(w, PackedQ4) and w.next is not None for w in down):
            raise ValueError("a down weight is one tensor, not a chain")
        self.gate_up, self.down = gate_up, down
        self.count, self.hidden, self.out_features = len(gate_up), hidden, out
        self.gate_up_ptrs = (ctypes.c_void_p * self.count)(*(ctypes.addressof(w.as_struct()) for w in gate_up))
        self.down_ptrs = (ctypes.c_void_p * self.count)(*(ctypes.addressof(w.as_struct()) for w in down))

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, threads: int = 1,
                 activation_bits: int = 16) -> torch.Tensor:
        """x [T, H] fp32; ids [T, k] (each in 0..count-1), weights [T, k] -> [T, H]: per row the sum
        over its picks, in ascending expert order, of weight * expert(x)."""
        native.check_activation_bits(activation_bits)
        native.check_float32("x", x, 2)
        if x.shape[1] != self.hidden or ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
            raise ValueError(f"x [T, {self.hidden}] with ids and weights [T, k]; got {tuple(x.shape)}, "
                             f"{tuple(ids.shape)}, {tuple(weights.shape)}")
        x = x.contiguous()
        ids = ids.to(torch.int64).contiguous()
        weights = weights.float().contiguous()
        out = torch.empty(x.shape[0], self.out_features)
        rc = native.library().rb_moe_experts(self.gate_up_ptrs, self.down_ptrs, self.count, x.data_ptr(), x.shape[0],
                                             ids.data_ptr(), weights.data_ptr(), ids.shape[1], out.data_ptr(),
                                             threads, activation_bits)
        if rc == -3:
            raise ValueError(f"expert ids must be in 0..{self.count - 1}")
        if rc:
            raise native.NativeKernelError("the experts could not allocate their scratch memory")
        return out

    def block(self, router: NativeWeight, top_k: int, renormalise: bool,
              shared: SharedExpert | None = None) -> MoEBlockStruct:
        """The decode stack's view of this layer's routed block (and shared expert)."""
        block = MoEBlockStruct(ctypes.pointer(router.as_struct()), ctypes.addressof(self.gate_up_ptrs),
                               ctypes.addressof(self.down_ptrs), self.count, top_k, int(renormalise))
        if shared is not None:
            block.shared_gate_up = ctypes.pointer(shared.gate_up.as_struct())
            block.shared_down = ctypes.pointer(shared.down.as_struct())
            block.shared_gate = ctypes.pointer(shared.gate.as_struct())
            block.shared_intermediate = shared.down.in_features
        return block
