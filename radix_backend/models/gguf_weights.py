"""Build the model from a GGUF file with every weight in the file's own type.

The model is laid out on the meta device, its linears, embedding and LM head are replaced by
modules that hold the GGUF tensors in the kernels' layouts (`kernels.quant.GGUFLinear`,
`GGUFEmbedding`), and only what is left (norms, the RoPE table) is allocated as fp32: no fp32
copy of a weight matrix is ever made.
"""

from __future__ import annotations

import mmap

import torch
from torch import nn

from radix_backend.kernels import ggml, quant, weight_arena

from .llama import LlamaForCausalLM


def build_gguf_model(config, tensors: dict[str, ggml.RawTensor]) -> LlamaForCausalLM:
    """The CPU model of a GGUF file (see the module docstring); `tensors` by HF name."""
    from . import model_class

    with torch.device("meta"):
        model = model_class(config)(config)
    used: set[str] = set()

    def raw(name: str) -> ggml.RawTensor:
        used.add(name)
        return tensors[name]

    def bias(name: str) -> torch.Tensor | None:
        return ggml.dequantize(raw(name)).reshape(-1) if name in tensors else None

    with weight_arena.active(weight_arena.WeightArena()):  # packed weights in huge pages
        for i, layer in enumerate(model.layers):
            p = f"layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [f"{p}self_attn.{n}_proj" for n in "qkv"]
            if f"{p}self_attn.qkv_proj.weight" in tensors:  # Phi-3 files store q|k|v (and gate|up) fused
                attn.qkv_proj = quant.GGUFLinear([raw(f"{p}self_attn.qkv_proj.weight")])
            else:
                attn.qkv_proj = quant.GGUFLinear([raw(f"{n}.weight") for n in qkv], [bias(f"{n}.bias") for n in qkv])
            attn.o_proj = quant.GGUFLinear([raw(f"{p}self_attn.o_proj.weight")])
            if hasattr(mlp, "experts"):
                _load_gguf_moe(mlp, f"{p}mlp.", tensors, raw)
            elif f"{p}mlp.gate_up_proj.weight" in tensors:
                mlp.gate_up_proj = quant.GGUFLinear([raw(f"{p}mlp.gate_up_proj.weight")])
            else:
                mlp.gate_up_proj = quant.GGUFLinear([raw(f"{p}mlp.gate_proj.weight"), raw(f"{p}mlp.up_proj.weight")])
            if not hasattr(mlp, "experts"):
                mlp.down_proj = quant.GGUFLinear([raw(f"{p}mlp.down_proj.weight")])
        model.embed_tokens = quant.GGUFEmbedding(raw("embed_tokens.weight"))
        head = "embed_tokens.weight" if model.tie_word_embeddings else "lm_head.weight"
        model.lm_head_quant = quant.GGUFLinear([raw(head)], fixed_activation_bits=quant.HEAD_ACTIVATION_BITS)
    if not model.tie_word_embeddings:
        del model.lm_head
    _materialize(model)
    for name, param in model.named_parameters():  # what is left: norms (and q/k norms)
        param.data.copy_(ggml.dequantize(raw(name)).reshape(param.shape))
    left = sorted(set(tensors) - used)
    if left:
        raise ValueError(f"GGUF tensors the model does not use: {left[:6]}")
    model.reset_rope_tables(torch.device("cpu"))
    release_load_memory(tensors)
    return model.eval()


def _load_gguf_moe(mlp: nn.Module, p: str, tensors: dict[str, ggml.RawTensor], raw) -> None:
    """A routed MoE block: its router, one native linear per expert, and a shared expert with its
    sigmoid gate (Qwen2-MoE)."""
    mlp.gate = quant.GGUFLinear([raw(f"{p}gate.weight")])
    _use_gguf_experts(mlp.experts, *(raw(f"{p}experts.{n}_exps") for n in ("gate", "up", "down")))
    if mlp.shared_expert is not None:
        mlp.shared_expert_gate = quant.GGUFLinear([raw(f"{p}shared_expert_gate.weight")])
        shared = mlp.shared_expert
        shared.gate_up_proj = quant.GGUFLinear([raw(f"{p}shared_expert.{n}_proj.weight") for n in ("gate", "up")])
        shared.down_proj = quant.GGUFLinear([raw(f"{p}shared_expert.down_proj.weight")])


def _use_gguf_experts(experts: nn.Module, gate: ggml.RawTensor, up: ggml.RawTensor, down: ggml.RawTensor) -> None:
    """Each expert's rows of the stacked tensors as its own native linears (gate|up chained)."""
    count = experts.count

    def part(t: ggml.RawTensor, e: int) -> ggml.RawTensor:
        rows = t.rows // count
        return ggml.RawTensor(f"{t.name}[{e}]", t.ggml_type, rows, t.cols, t.data[e * rows:(e + 1) * rows])

    experts.use_linears([quant.GGUFLinear([part(gate, e), part(up, e)]) for e in range(count)],
                        [quant.GGUFLinear([part(down, e)]) for e in range(count)])


def release_load_memory(tensors: dict[str, ggml.RawTensor]) -> None:
    """Give back what loading left resident: the file's pages, read once for packing (the mapping
    stays; the embedding's rows fault back in as they are looked up), and the heap the packing
    temporaries grew (glibc keeps freed memory otherwise)."""
    mapped = {id(base): base for t in tensors.values() if (base := _mapping(t.data)) is not None}
    for mm in mapped.values():
        try:
            mm.madvise(mmap.MADV_DONTNEED)
        except (AttributeError, OSError, ValueError):  # no madvise here: the pages stay cached
            pass
    weight_arena.trim_heap()


def _mapping(array) -> mmap.mmap | None:
    while array is not None and not isinstance(getattr(array, "_mmap", None), mmap.mmap):
        array = getattr(array, "base", None)
    return None if array is None else array._mmap


def _materialize(model: nn.Module) -> None:
    """Give every parameter and buffer still on the meta device real (uninitialised) CPU storage
    (`torch.empty`, not `empty_like`: on a meta tensor that runs torch's Python reference op, whose
    first use imports sympy, ~0.4 s)."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                module._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype), requires_grad=False)
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype)
