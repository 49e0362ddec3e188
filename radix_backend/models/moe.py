"""Mixture-of-experts decoders (Qwen2-MoE, Qwen3-MoE, Mixtral): Llama-family layers whose MLP is a
routed set of SiLU experts.

Per token the router's softmax picks `num_experts_per_tok` experts (renormalised over the picked
ones for Mixtral and where `norm_topk_prob`), and the token's output is their weighted sum;
Qwen2-MoE adds a shared expert gated by a sigmoid. A step's rows are grouped by expert, so each
expert that any row picked runs one matmul over all its rows (never one per token), in expert
order as HF sums them. Layers listed in `mlp_only_layers` or off the `decoder_sparse_step` grid
keep a dense MLP.

Weights load from either layout: HF's per-expert tensors as published
(`mlp.experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1.weight`) or
transformers 5's stacked ones (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]), which is also how they are held here.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from radix_backend.kernels import moe_experts, native, ops, q4, quant, settings
from radix_backend.kernels.decode_stack import RoutedMLP
from radix_backend.kernels.moe_experts import NativeExperts, NativeWeight, SharedExpert
from radix_backend.kernels.q4 import DenseWeight

from .llama import MLP, DecoderLayer, Linear, LlamaForCausalLM

ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
# a published checkpoint's per-expert tensor: (layer prefix, expert, projection)
_PER_EXPERT = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
                         r"\.weight$")
_PART = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
         "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", None), "w2": ("down_proj", None)}


def num_experts(config) -> int:
    return int(getattr(config, "num_experts", None) or config.num_local_experts)


def is_sparse_layer(config, layer_id: int) -> bool:
    """HF's rule: Mixtral's layers are all sparse; Qwen's except `mlp_only_layers` and those off
    the `decoder_sparse_step` grid."""
    if config.model_type == "mixtral":
        return True
    return (layer_id not in (getattr(config, "mlp_only_layers", None) or []) and num_experts(config) > 0
            and (layer_id + 1) % int(getattr(config, "decoder_sparse_step", 1)) == 0)


class Experts(nn.Module):
    """Every expert's gate|up and down weights, stacked along a leading expert dim; or, from a GGUF
    file, one native linear per expert for each (`use_linears`)."""

    def __init__(self, count: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.count = count
        self.gate_up_proj = nn.Parameter(torch.empty(count, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(count, hidden, intermediate))
        self.gate_up_linears: nn.ModuleList | None = None
        self.down_linears: nn.ModuleList | None = None

    def use_linears(self, gate_up: list[nn.Module], down: list[nn.Module]) -> None:
        """Run expert e as gate_up[e] and down[e] (modules such as GGUF linears in the file's types)
        instead of the stacked fp weights, which are dropped."""
        if len(gate_up) != self.count or len(down) != self.count:
            raise ValueError(f"{len(gate_up)} gate|up and {len(down)} down linears for {self.count} experts")
        del self.gate_up_proj, self.down_proj
        self.gate_up_linears, self.down_linears = nn.ModuleList(gate_up), nn.ModuleList(down)

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_linears is not None:
            hidden = ops.silu_and_mul(self.gate_up_linears[expert](x).to(x.dtype))
            return self.down_linears[expert](hidden).to(x.dtype)
        return ops.linear(ops.silu_and_mul(ops.linear(x, self.gate_up_proj[expert])), self.down_proj[expert])

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; expert_ids, weights [T, k] -> sum over each row's k experts of weight * expert(x)."""
        if x.shape[0] == 1:
            return self._one_row(x, expert_ids[0].tolist(), weights[0].tolist())
        out = torch.zeros_like(x)
        k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (row, pick) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.count).tolist()
        rows_sorted, weights_sorted = order // k, weights.reshape(-1)[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = rows_sorted[start:start + count]
            hidden = self._expert(expert, x.index_select(0, rows)) * weights_sorted[start:start + count, None]
            out.index_add_(0, rows, hidden.to(out.dtype))
            start += count
        return out


    def _one_row(self, x: torch.Tensor, picks: list[int], weights: list[float]) -> torch.Tensor:
        """A batch-1 decode step: the row's experts in expert order, as the grouped path sums them,
        without its sorting, scatter and tensor-valued weights (their small ops took a third of a
        small MoE's decode step)."""
        out = None
        for expert, weight in sorted(zip(picks, weights)):
            term = self._expert(expert, x).mul_(weight).to(x.dtype)
            out = term if out is None else out.add_(term)
        return out


def _router_weight(gate: nn.Module) -> NativeWeight | None:
    """The router's native form: its packed low-bit weights, or its fp32 weights as they are (a
    GGUF's F32 router, or an fp32 `Linear`)."""
    packed = getattr(gate, "native_q4", None)
    if packed is not None:
        return packed
    runners = getattr(gate, "runners", None)
    if isinstance(gate, quant.GGUFLinear) and len(runners) == 1 and isinstance(runners[0], tuple):
        weight, bias = runners[0]
        return DenseWeight(weight, bias)
    if type(gate) is Linear and gate.weight.dtype == torch.float32 and gate.weight.device.type == "cpu":
        return DenseWeight(gate.weight, gate.bias)
    return None


class SparseMoE(nn.Module):
    """The routed MLP of one layer (HF names: `mlp.gate`, `mlp.experts`, Qwen2-MoE's `mlp.shared_expert`
    and `mlp.shared_expert_gate`)."""

    def __init__(self, config, tp_size: int = 1) -> None:
        super().__init__()
        if tp_size != 1:
            raise ValueError("mixture-of-experts models run with tp_size=1 (experts are not sharded yet)")
        count = num_experts(config)
        intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        self.top_k = int(config.num_experts_per_tok)
        self.renormalise = config.model_type == "mixtral" or bool(getattr(config, "norm_topk_prob", False))
        self.gate = Linear(config.hidden_size, count, bias=False)
        self.experts = Experts(count, config.hidden_size, intermediate)
        shared = getattr(config, "shared_expert_intermediate_size", None) if config.model_type == "qwen2_moe" else None
        self.shared_expert = MLP(config, intermediate_size=shared) if shared else None
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False) if shared else None
        self._native: RoutedMLP | None | bool = False  # False: not looked at yet

    def native_block(self) -> RoutedMLP | None:
        """The router and experts on the native kernels (`kernels/moe_experts.py`), when the experts
        are natively packed low-bit linears (a GGUF's) and the router has a native form."""
        if self._native is False:
            self._native = None
            router, experts = _router_weight(self.gate), self.experts
            if router is not None and experts.gate_up_linears is not None and native.available():
                gate_up = [getattr(lin, "native_q4", None) for lin in experts.gate_up_linears]
                down = [getattr(lin, "native_q4", None) for lin in experts.down_linears]
                if all(w is not None for w in gate_up + down):
                    try:
                        self._native = RoutedMLP(router, NativeExperts(gate_up, down), self.top_k, self.renormalise,
                                                 self._native_shared())
                    except ValueError:  # padded rows: the per-expert linears run as they are
                        self._native = None
        return self._native

    def _native_shared(self) -> SharedExpert | None:
        """Qwen2-MoE's shared expert in native form: packed gate|up and down, and the one-row fp32
        gate (a GGUF keeps it F32), or None (then it runs as torch modules, outside the decode stack)."""
        if self.shared_expert is None:
            return None
        gate_up = getattr(self.shared_expert.gate_up_proj, "native_q4", None)
        down = getattr(self.shared_expert.down_proj, "native_q4", None)
        gate = _router_weight(self.shared_expert_gate)
        if gate_up is None or down is None or not isinstance(gate, DenseWeight):
            return None
        try:
            return SharedExpert(gate_up, down, gate)
        except ValueError:
            return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block = self.native_block() if native.supports(x) else None
        if block is not None:  # the decode stack's kernels, so both paths give the same bits
            threads, bits = settings.matmul_threads(), quant.activation_bits()
            flat = x.reshape(-1, x.shape[-1])
            logits = q4.q4_matmul(flat, block.router, threads=threads, activation_bits=bits)
            expert_ids, weights = moe_experts.route(logits, self.top_k, self.renormalise)
            out = block.experts(flat, expert_ids, weights, threads=threads, activation_bits=bits).view_as(x)
        else:
            probs = torch.softmax(self.gate(x).float(), dim=-1)
            weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
            if self.renormalise:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            out = self.experts(x, expert_ids, weights.to(x.dtype))
        if self.shared_expert is not None:
            if block is not None and block.shared is not None:  # the decode stack's kernels again
                out = block.shared(out.reshape(flat.shape), flat, threads, bits).view_as(x)
            else:
                out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoEDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_id: int, tp_size: int = 1,
                 all_reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        super().__init__(config, layer_id, tp_size, all_reduce)
        if is_sparse_layer(config, layer_id):
            self.mlp = SparseMoE(config, tp_size)


class MoEForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE, Qwen3-MoE and Mixtral; `forward` as LlamaForCausalLM's."""

    architectures = ARCHITECTURES

    @staticmethod
    def make_layer(config, layer_id: int, tp_size: int, all_reduce) -> nn.Module:
        return MoEDecoderLayer(config, layer_id, tp_size, all_reduce)

    @staticmethod
    def stack_mlp(layer: nn.Module) -> dict | None:
        """A routed layer joins the decode stack with its native router and experts (and shared expert)."""
        if not isinstance(layer.mlp, SparseMoE):
            return LlamaForCausalLM.stack_mlp(layer)
        block = layer.mlp.native_block()
        if block is None or (layer.mlp.shared_expert is not None and block.shared is None):
            return None
        return {"gate_up": None, "down": None, "moe": block}

    def load_special_weight(self, name: str, tensor: torch.Tensor, params: dict[str, torch.Tensor]) -> list[str]:
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's published name of the block
        match = _PER_EXPERT.match(name)
        if match is None:
            if name.endswith(".mlp.gate.weight") or ".mlp.experts." in name:  # the router, stacked experts
                target = params.get(name)
                if target is None or target.shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} does not fit this model")
                target.data.copy_(tensor)
                return [name]
            return []
        layer, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        stacked, half = _PART[proj]
        target = params[f"{layer}.mlp.experts.{stacked}"].data[expert]
        if half is not None:
            size = target.shape[0] // 2
            target = target[half * size:(half + 1) * size]
        if target.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} does not fit {tuple(target.shape)}")
        target.copy_(tensor)
        return [f"{layer}.mlp.experts.{stacked}#{expert}#{half}"]

    @staticmethod
    def _expected_loaded_names(params: dict[str, torch.Tensor]) -> set[str]:
        """Stacked experts count as loaded once whole (both layouts name them differently)."""
        return {name for name in LlamaForCausalLM._expected_loaded_names(params) if ".mlp.experts." not in name}

    def load_weights(self, weights) -> set[str]:
        loaded = super().load_weights(weights)
        self._check_experts_complete(loaded)
        return loaded

    def _check_experts_complete(self, loaded: set[str]) -> None:
        missing = []
        for name, param in self.named_parameters():
            if ".mlp.experts." not in name or name in loaded:
                continue
            halves = (0, 1) if name.endswith("gate_up_proj") else (None,)
            missing += [f"{name}[{e}]" for e in range(param.shape[0]) for h in halves
                        if f"{name}#{e}#{h}" not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing expert tensors: {missing[:6]}{' ...' if len(missing) > 6 else ''}")
