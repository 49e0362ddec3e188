"""A GGUF model file read in place: its config from the metadata, its tensors in their own types.

The file is memory-mapped (`gguf.GGUFReader`); nothing is dequantized here. Before any tensor is
touched, the architecture and every metadata field the model would act on are checked: a field
we would otherwise ignore (rope scaling we do not apply, a sliding window, experts, an activation
we do not implement) is a `ModelLoadError` naming it, never a silent approximation. Llama 3's
`rope_freqs.weight` is applied (it divides the rotary frequencies, as in llama.cpp); a Phi-3 file's
fused q|k|v and gate|up tensors, rotated head part, sliding window and LongRoPE factor pair are read
as llama.cpp's converter writes them.

Tensor names become the HF ones the model loads (`hf_name`); llama.cpp's converter permutes the
rows of a Llama model's q/k weights for its interleaved RoPE, which is undone here (rows only, so
on the raw blocks) because the model applies HF's half-split RoPE.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from radix_backend.kernels import ggml

from ..errors import ModelLoadError
from .gguf_config import GGUFConfig, with_rope_parameters

if TYPE_CHECKING:
    import torch

# GGUF architecture -> (transformers config class name, HF architecture, model_type)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "phi3"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", "gemma"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "gemma3_text"),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3_moe"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", "olmo2"),
}
# llama.cpp stores every Gemma norm weight as 1 + w
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
# a llama file with experts is a Mixtral
_MIXTRAL = ("MixtralConfig", "MixtralForCausalLM", "mixtral")
# experts: how many, how many each token uses, their width (and Qwen2-MoE's shared expert's)
_MOE_KEYS = {"expert_count", "expert_used_count", "expert_feed_forward_length",
             "expert_shared_feed_forward_length"}
# Gemma 2/3's local layers, as llama.cpp reads them: a window (Gemma 2: 4096 unless given), which
# layers slide (`sliding_window_pattern`, else every layer but each n-th), and their RoPE base.
_GEMMA_SWA_KEYS = {"attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa",
                   "final_logit_softcapping"}
_GEMMA_DEFAULT_PATTERN = {"gemma2": 2, "gemma3": 6}
# llama.cpp's layer counts of the 27B Gemmas, whose attention scale is 1/sqrt(hidden / heads), not
# 1/sqrt(head size) (llama.cpp derives it so; the converter writes no `query_pre_attn_scalar`)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# per-architecture metadata keys (after "<arch>.") that the model honours
HONOURED = {"context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
            "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.freq_base",
            "rope.dimension_count", "attention.key_length", "attention.value_length", "vocab_size",
            "rope.scaling.type", "rope.scaling.factor"}
# keys honoured for one architecture only (elsewhere, e.g. a llama file's sliding window, refused)
ARCH_HONOURED = {"phi3": {"rope.scaling.original_context_length", "attention.sliding_window",
                          "rope.scaling.attn_factor"},
                 "gemma2": _GEMMA_SWA_KEYS | {"attn_logit_softcapping"}, "gemma3": _GEMMA_SWA_KEYS,
                 "llama": _MOE_KEYS, "qwen2moe": _MOE_KEYS, "qwen3moe": _MOE_KEYS}
# other key families that do not change the math
HARMLESS_PREFIXES = ("general.", "tokenizer.", "quantize.", "GGUF.")
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
}
# Phi-3 files keep HF's fused projections: q|k|v in attn_qkv, gate|up in ffn_up
_PHI3_LAYER_TENSORS = {**_LAYER_TENSORS, "attn_qkv.weight": "self_attn.qkv_proj.weight",
                       "ffn_up.weight": "mlp.gate_up_proj.weight"}
# Gemma 2/3: a norm after attention, before and after the MLP (llama.cpp's ffn_norm is the one before)
_GEMMA_LAYER_TENSORS = {**_LAYER_TENSORS, "post_attention_norm.weight": "post_attention_layernorm.weight",
                        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                        "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# OLMo 2: no norm before attention or MLP, one after each; q/k norms over the whole projection
_OLMO2_LAYER_TENSORS = {**{k: v for k, v in _LAYER_TENSORS.items() if k not in ("attn_norm.weight", "ffn_norm.weight")},
                        "post_attention_norm.weight": "post_attention_layernorm.weight",
                        "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# mixtures of experts: the router, every expert stacked in one tensor ([E * I, H] rows; the model
# slices them per expert), Qwen2-MoE's shared expert and its sigmoid gate
_MOE_LAYER_TENSORS = {**_LAYER_TENSORS, "ffn_gate_inp.weight": "mlp.gate.weight",
                      "ffn_gate_exps.weight": "mlp.experts.gate_exps", "ffn_up_exps.weight": "mlp.experts.up_exps",
                      "ffn_down_exps.weight": "mlp.experts.down_exps",
                      "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                      "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                      "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
                      "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"}
_GLOBAL_TENSORS = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                   "output.weight": "lm_head.weight"}
# per-frequency RoPE factors, read into the config: Llama 3's divisors, Phi-3's LongRoPE pair
_ROPE_FACTOR_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass
class GGUFModel:
    """A checked GGUF model file: `config` for the model, `tensors` by HF name (raw blocks)."""

    path: Path
    arch: str
    config: GGUFConfig
    tensors: dict[str, ggml.RawTensor]

    def dequantized_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor dequantized to fp32, one at a time, in HF's conventions (the fp32 reference
        path loads these): Gemma's norms as offsets from 1, experts one tensor each, vectors of one
        row (Qwen2-MoE's shared-expert gate) as the [1, H] matrix HF holds."""
        import torch

        for name, raw in self.tensors.items():
            tensor = ggml.dequantize(raw)
            if name.startswith("layers.") and ".mlp.experts." in name:
                layer, part = name.split(".mlp.experts.")
                per_expert = tensor.reshape(self._expert_count, -1, raw.cols)
                proj = {"gate_exps": "gate_proj", "up_exps": "up_proj", "down_exps": "down_proj"}[part]
                for e in range(per_expert.shape[0]):
                    yield f"{layer}.mlp.experts.{e}.{proj}.weight", per_expert[e]
                continue
            if raw.rows == 1 and not name.endswith("shared_expert_gate.weight"):
                tensor = tensor.reshape(-1)
            if self.arch in _GEMMA_ARCHS and name.endswith("norm.weight"):
                tensor = tensor - 1.0  # llama.cpp stores Gemma's norms as 1 + w
            yield name, tensor.to(torch.float32)

    @property
    def _expert_count(self) -> int:
        return int(getattr(self.config, "num_experts", None) or self.config.num_local_experts)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# arrays longer than this are skipped, not decoded (the tokenizer's vocabulary and merges: the
# tokenizer is read by transformers, and decoding 100k strings would cost seconds per load)
_LARGE_ARRAY = 4096


@dataclass
class _TensorInfo:
    name: str
    shape: list[int]  # ggml order: ne[0] (columns) first
    ggml_type: int
    offset: int


class _Cursor:
    """Reads GGUF's little-endian header fields, refusing to run past the end of the file."""

    def __init__(self, buf, path: Path) -> None:
        self.buf, self.at, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.at + n > len(self.buf):
            raise ModelLoadError(f"{self.path} is truncated or not a GGUF file (header runs past its end)")
        view = memoryview(self.buf)[self.at:self.at + n]
        self.at += n
        return view

    def _format(self, kind: int) -> str:
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ModelLoadError(f"{self.path}: unknown GGUF value type {kind}")
        return fmt

    def scalar(self, kind: int):
        fmt = self._format(kind)
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.scalar(10))).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            return self.scalar(kind)
        item, count = self.scalar(4), self.scalar(10)
        if count > _LARGE_ARRAY:
            self.skip_items(item, count)
            return None
        return [self.value(item) for _ in range(count)]

    def skip_items(self, kind: int, count: int) -> None:
        """Step over `count` values of `kind` without decoding them."""
        if kind in _SCALARS:
            self.take(struct.calcsize(_SCALARS[kind]) * count)
        elif kind == _STRING:
            for _ in range(count):
                self.take(self.scalar(10))
        elif kind == _ARRAY:
            for _ in range(count):
                self.skip_items(self.scalar(4), self.scalar(10))
        else:
            self._format(kind)  # raises: unknown type


def read_header(path: Path) -> tuple[dict[str, Any], list[_TensorInfo], np.memmap]:
    """(metadata, tensor infos, the file mapped read-only) of a GGUF file; tensor data is not read.
    Large arrays (the tokenizer's vocabulary) are skipped and given as None."""
    try:
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot map GGUF file {path}: {exc}") from exc
    cur = _Cursor(mapped, path)
    if bytes(cur.take(4)) != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic)")
    version = cur.scalar(4)
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar(4))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = cur.scalar(4)
        if dims > 4:
            raise ModelLoadError(f"{path}: tensor {name} has {dims} dimensions")
        shape = [cur.scalar(10) for _ in range(dims)]
        infos.append(_TensorInfo(name, shape, cur.scalar(4), cur.scalar(10)))
    alignment = int(metadata.get("general.alignment", 32) or 32)
    data_start = (cur.at + alignment - 1) // alignment * alignment
    for info in infos:
        info.offset += data_start
    return metadata, infos, mapped


def open_gguf(path: Path) -> GGUFModel:
    """Read and check `path` (see the module docstring); tensors stay in the mapped file."""
    meta, infos, mapped = read_header(path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path.name}: GGUF architecture {arch!r} is not supported; supported: "
                             f"{', '.join(ARCHITECTURES)}")
    if int(meta.get("split.count", 1) or 1) > 1:
        raise ModelLoadError(f"{path.name} is one part of a split GGUF; merge the parts first (llama-gguf-split --merge)")
    honoured = HONOURED | ARCH_HONOURED.get(arch, set())
    unknown = sorted(k for k in meta if not k.startswith(HARMLESS_PREFIXES) and not k.startswith("split.")
                     and not (k.startswith(arch + ".") and k[len(arch) + 1:] in honoured))
    if unknown:
        raise ModelLoadError(f"{path.name}: metadata field(s) {', '.join(unknown)} would change the model's math "
                             "and are not implemented; refusing to run it approximately")
    tensors, rope_factors = _tensors(path, arch, infos, mapped)
    _, model_type, fields = _config_fields(path, arch, meta, tensors, rope_factors)
    config = GGUFConfig(model_type, **with_rope_parameters(fields))
    _unpermute_qk(arch, config, tensors)
    return GGUFModel(path, arch, config, tensors)


def _require(meta: dict[str, Any], key: str, path: Path) -> Any:
    value = meta.get(key)
    if value is None:
        raise ModelLoadError(f"{path.name}: GGUF metadata lacks {key!r}")
    if isinstance(value, list):
        raise ModelLoadError(f"{path.name}: per-layer values for {key!r} are not supported")
    return value


def _tensors(path: Path, arch: str, infos: list[_TensorInfo],
             mapped: np.memmap) -> tuple[dict[str, ggml.RawTensor], dict[str, np.ndarray]]:
    tensors: dict[str, ggml.RawTensor] = {}
    rope_factors: dict[str, np.ndarray] = {}
    for info in infos:
        kind = info.ggml_type
        ggml.check_supported(kind, f"{path.name}: tensor {info.name}")
        cols = int(info.shape[0]) if info.shape else 1
        rows = int(np.prod(info.shape[1:])) if len(info.shape) > 1 else 1
        per_block, nbytes = ggml.BLOCK[kind]
        if cols % per_block or cols <= 0 or rows <= 0:
            raise ModelLoadError(f"{path.name}: tensor {info.name} has {cols} columns, not whole "
                                 f"{ggml.type_name(kind)} blocks of {per_block}")
        size = rows * (cols // per_block) * nbytes
        if info.offset + size > mapped.shape[0]:
            raise ModelLoadError(f"{path.name}: tensor {info.name} runs past the end of the file (truncated?)")
        data = mapped[info.offset:info.offset + size].reshape(rows, -1)
        if info.name in _ROPE_FACTOR_TENSORS:
            raw = ggml.RawTensor(info.name, kind, rows, cols, data)
            rope_factors[info.name] = ggml.dequantize(raw).reshape(-1).numpy()
            continue
        name = _hf_name(path, arch, info.name)
        if name in tensors:
            raise ModelLoadError(f"{path.name}: tensor {info.name} appears twice")
        tensors[name] = ggml.RawTensor(info.name, kind, rows, cols, data)
    return tensors, rope_factors


def _hf_name(path: Path, arch: str, name: str) -> str:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    match = _LAYER_NAME.fullmatch(name)
    layer_names = {"phi3": _PHI3_LAYER_TENSORS, "gemma2": _GEMMA_LAYER_TENSORS, "gemma3": _GEMMA_LAYER_TENSORS,
                   "olmo2": _OLMO2_LAYER_TENSORS,
                   "qwen2moe": _MOE_LAYER_TENSORS, "qwen3moe": _MOE_LAYER_TENSORS,
                   "llama": _MOE_LAYER_TENSORS}.get(arch, _LAYER_TENSORS)
    if match and match.group(2) in layer_names:
        return f"layers.{match.group(1)}.{layer_names[match.group(2)]}"
    raise ModelLoadError(f"{path.name}: tensor {name!r} is not part of a model we implement (would be ignored)")


def config_fields(path: Path) -> tuple[str, str, dict[str, Any]]:
    """(transformers config class name, model_type, its arguments) for the GGUF file at `path`:
    what `open_gguf`'s config holds (the tests build the transformers class from these)."""
    meta, infos, mapped = read_header(path)
    arch = meta["general.architecture"]
    tensors, rope_factors = _tensors(path, arch, infos, mapped)
    return _config_fields(path, arch, meta, tensors, rope_factors)


def _config_fields(path: Path, arch: str, meta: dict[str, Any], tensors: dict[str, ggml.RawTensor],
                   rope_factors: dict[str, np.ndarray]) -> tuple[str, str, dict[str, Any]]:
    experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
    class_name, hf_arch, model_type = _MIXTRAL if arch == "llama" and experts else ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default) if default is not None else _require(meta, f"{arch}.{key}", path)

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(f"{path.name}: different key and value head sizes are not supported")
    rotary_dims = int(get("rope.dimension_count", head_dim))
    if rotary_dims != head_dim and arch != "phi3":
        raise ModelLoadError(f"{path.name}: partial rotary embeddings ({arch}.rope.dimension_count="
                             f"{rotary_dims}, head size {head_dim}) are not supported for {arch}")
    rope_scaling = None
    scaling = get("rope.scaling.type", "none")
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling != "none":
        raise ModelLoadError(f"{path.name}: {arch}.rope.scaling.type={scaling!r} is not implemented")
    embed = tensors.get("embed_tokens.weight")
    if embed is None:
        raise ModelLoadError(f"{path.name}: no token_embd.weight tensor")
    vocab = int(get("vocab_size", embed.rows))
    if vocab != embed.rows or embed.cols != hidden:
        raise ModelLoadError(f"{path.name}: token_embd.weight is {embed.rows}x{embed.cols}, metadata says "
                             f"{vocab}x{hidden}")
    bias = "layers.0.self_attn.q_proj.bias" in tensors
    if arch == "qwen2" and not bias:
        raise ModelLoadError(f"{path.name}: a qwen2 model without attention biases is not supported")
    if arch == "llama" and "layers.0.self_attn.q_norm.weight" in tensors:
        raise ModelLoadError(f"{path.name}: q/k norms in a llama model are not supported")
    if arch in ("gemma", "olmo2") and bias:
        raise ModelLoadError(f"{path.name}: attention biases in a {arch} model are not supported")
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")), num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")), rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling, tie_word_embeddings="lm_head.weight" not in tensors, hidden_act="silu",
        architectures=[hf_arch], torch_dtype="float32",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))
    if arch == "llama" and not experts:
        kwargs["attention_bias"] = bias
    if experts:
        kwargs.update(_moe_kwargs(path, arch, get, experts, tensors))
    elif arch in ("qwen2moe", "qwen3moe"):
        raise ModelLoadError(f"{path.name}: a {arch} file without {arch}.expert_count")
    if arch == "phi3":
        kwargs.update(_phi3_kwargs(path, get, rotary_dims, head_dim, rope_factors))
    elif arch == "gemma":  # Gemma 1: GeGLU, the head size's scale, every layer global
        kwargs["hidden_act"] = "gelu_pytorch_tanh"
    elif arch in ("gemma2", "gemma3"):
        kwargs.update(_gemma_kwargs(arch, get, kwargs))
    elif set(rope_factors) - {"rope_freqs.weight"}:
        raise ModelLoadError(f"{path.name}: LongRoPE factor tensors in a {arch} model are not supported")
    factors = rope_factors.get("rope_freqs.weight")
    if factors is not None:
        if factors.shape[0] != head_dim // 2:
            raise ModelLoadError(f"{path.name}: rope_freqs.weight has {factors.shape[0]} values for head size "
                                 f"{head_dim}")
        kwargs["rope_freq_factors"] = [float(v) for v in factors]  # read by the model's RoPE table
    return class_name, model_type, kwargs


def _phi3_kwargs(path: Path, get: Any, rotary_dims: int, head_dim: int,
                 rope_factors: dict[str, np.ndarray]) -> dict[str, Any]:
    """Phi-3's fields as llama.cpp's converter writes them: rotated part of each head, sliding
    window (0: none, Phi-4), LongRoPE as a long/short factor tensor pair and the original context."""
    window = int(get("attention.sliding_window", 0))
    out: dict[str, Any] = dict(partial_rotary_factor=rotary_dims / head_dim, sliding_window=window or None,
                               original_max_position_embeddings=int(get("rope.scaling.original_context_length",
                                                                        get("context_length"))))
    long, short = rope_factors.get("rope_factors_long.weight"), rope_factors.get("rope_factors_short.weight")
    if (long is None) != (short is None):
        raise ModelLoadError(f"{path.name}: LongRoPE needs both rope_factors_long and rope_factors_short")
    if long is not None:
        if long.shape[0] != rotary_dims // 2 or short.shape[0] != rotary_dims // 2:
            raise ModelLoadError(f"{path.name}: LongRoPE factors must have {rotary_dims // 2} values")
        out["rope_scaling"] = {"rope_type": "longrope", "long_factor": [float(v) for v in long],
                               "short_factor": [float(v) for v in short]}
        attn_factor = get("rope.scaling.attn_factor", 0.0)
        if attn_factor:
            out["rope_scaling"]["attention_factor"] = float(attn_factor)
    return out


def _moe_kwargs(path: Path, arch: str, get: Any, experts: int, tensors: dict[str, ggml.RawTensor]) -> dict[str, Any]:
    """The experts' fields, with the routing llama.cpp applies per architecture: Qwen3-MoE and
    Mixtral renormalise the picked experts' weights, Qwen2-MoE does not."""
    gate = tensors.get("layers.0.mlp.experts.gate_exps")
    if gate is None:
        raise ModelLoadError(f"{path.name}: {arch}.expert_count is set but blk.0.ffn_gate_exps.weight is missing")
    width = int(get("expert_feed_forward_length", gate.rows // experts))
    out: dict[str, Any] = {"num_experts_per_tok": int(get("expert_used_count"))}
    if arch == "llama":  # Mixtral: every expert as wide as feed_forward_length
        out["num_local_experts"] = experts
        if width != int(get("feed_forward_length")):
            raise ModelLoadError(f"{path.name}: experts {width} wide in a {get('feed_forward_length')}-wide llama")
        return out
    dense = [i for i in range(int(get("block_count"))) if f"layers.{i}.mlp.experts.gate_exps" not in tensors]
    out.update(num_experts=experts, moe_intermediate_size=width, norm_topk_prob=arch == "qwen3moe",
               decoder_sparse_step=1, mlp_only_layers=dense)
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length"))
        out["qkv_bias"] = "layers.0.self_attn.q_proj.bias" in tensors
    return out


def _gemma_kwargs(arch: str, get: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Gemma's fields as llama.cpp reads a file of it (its norm weights are stored as 1 + w, as the
    model holds them). The attention scale and which layers slide are derived as llama.cpp does."""
    layers, hidden, heads = kwargs["num_hidden_layers"], kwargs["hidden_size"], kwargs["num_attention_heads"]
    scalar = hidden // heads if layers == _GEMMA_27B_LAYERS.get(arch) else kwargs["head_dim"]
    kwargs.pop("hidden_act")
    out: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar}
    window = int(get("attention.sliding_window", 4096 if arch == "gemma2" else 0))
    pattern = get("attention.sliding_window_pattern", _GEMMA_DEFAULT_PATTERN[arch])
    if isinstance(pattern, list):  # one flag per layer
        sliding = [bool(v) for v in pattern][:layers]
    else:
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
    out["layer_types"] = ["sliding_attention" if window and s else "full_attention" for s in sliding]
    out["sliding_window"] = window or None
    final_cap = float(get("final_logit_softcapping", 30.0 if arch == "gemma2" else 0.0))
    out["final_logit_softcapping"] = final_cap or None
    theta = kwargs.pop("rope_theta")
    scaling = kwargs.pop("rope_scaling") or {"rope_type": "default"}
    if arch == "gemma2":  # one RoPE for every layer (llama.cpp: the local base defaults to the global one)
        if float(get("rope.freq_base_swa", theta)) != theta:
            raise ModelLoadError("gemma2.rope.freq_base_swa differs from gemma2.rope.freq_base: not implemented")
        out["attn_logit_softcapping"] = float(get("attn_logit_softcapping", 50.0))
        out["rope_parameters"] = {**scaling, "rope_theta": theta}
        return out
    # Gemma 3: local layers keep base 10000 and no scaling unless the file says
    out["rope_parameters"] = {"full_attention": {**scaling, "rope_theta": theta},
                              "sliding_attention": {"rope_type": "default",
                                                    "rope_theta": float(get("rope.freq_base_swa", 10000.0))}}
    return out


def _unpermute_qk(arch: str, config, tensors: dict[str, ggml.RawTensor]) -> None:
    """Undo llama.cpp's row permutation of a Llama model's q and k weights (HF's RoPE layout)."""
    if arch != "llama":
        return
    for i in range(config.num_hidden_layers):
        for proj, heads in (("q_proj", config.num_attention_heads), ("k_proj", config.num_key_value_heads)):
            for kind in ("weight", "bias"):
                t = tensors.get(f"layers.{i}.self_attn.{proj}.{kind}")
                if t is None:
                    continue
                n = t.rows if kind == "weight" else t.cols
                perm = np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(2, 1).reshape(-1)
                if kind == "weight":
                    t.data = np.ascontiguousarray(t.data[perm])
                else:
                    values = t.data.view(np.uint8).reshape(1, -1)
                    width = values.shape[1] // n
                    t.data = np.ascontiguousarray(values.reshape(n, width)[perm].reshape(1, -1))
