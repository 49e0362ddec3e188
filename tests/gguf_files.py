"""Make GGUF model files for tests: tiny random Llama/Qwen2/Qwen3/Phi-3 models, or the embedded SmolLM2
re-quantized, in any of the supported tensor types.

gguf's own numpy quantizers cover Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the float types; the K-quants
(Q4_K, Q5_K, Q6_K) get simple round-to-nearest quantizers here that write ggml's block layouts
(checked against gguf's dequantizer in the tests). The tokenizer is a cut-down SmolLM2 one (its
first 1024 tokens) unless the vocabulary is SmolLM2's own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

QK = 256


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and minimums per block -> ggml's 12 packed bytes (get_scale_min_k4's inverse)."""
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.uint8)
    for j in range(4):
        out[..., j] = (sc[..., j] & 63) | ((sc[..., j + 4] >> 4) << 6)
        out[..., j + 4] = (mn[..., j] & 63) | ((mn[..., j + 4] >> 4) << 6)
        out[..., 8 + j] = (sc[..., j + 4] & 15) | ((mn[..., j + 4] & 15) << 4)
    return out


def quantize_k_minmax(w: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits=4) or Q5_K (bits=5) blocks of w [N, K], K % 256 == 0."""
    n = w.shape[0]
    sub = w.reshape(n, -1, 8, 32).astype(np.float32)
    top = (1 << bits) - 1
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / top
    offset = -lo
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (offset.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[..., None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(offset / np.where(dmin > 0, dmin, 1)[..., None]), 0, 63).astype(np.uint8)
    step = d[..., None] * sc
    q = np.round((sub + (dmin[..., None] * mn)[..., None]) / np.where(step > 0, step, 1)[..., None])
    q = np.clip(q, 0, top).astype(np.uint8).reshape(n, -1, 4, 2, 32)  # chunks of 64: two halves of 32
    qs = ((q[..., 0, :] & 15) | ((q[..., 1, :] & 15) << 4)).reshape(n, -1, 128)
    parts = [_f16(d), _f16(dmin), _k_scale_bytes(sc, mn)]
    if bits == 5:
        upper = (q.reshape(n, -1, 8, 32) >> 4) & 1  # bit j of byte i: element 32j + i
        qh = np.zeros((n, q.shape[1], 32), dtype=np.uint8)
        for j in range(8):
            qh |= (upper[:, :, j] << j).astype(np.uint8)
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K blocks of w [N, K], K % 256 == 0."""
    n = w.shape[0]
    sub = w.reshape(n, -1, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[..., None]), -127, 127).astype(np.int8)
    step = d[..., None] * sc
    q = np.clip(np.round(sub / np.where(step != 0, step, 1)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, -1, 2, 128)
    ql = ((q[..., :64] & 15) | ((q[..., 64:] & 15) << 4)).reshape(n, -1, 128)
    upper = (q >> 4).reshape(n, -1, 2, 4, 32)
    qh = np.zeros((n, q.shape[1], 2, 32), dtype=np.uint8)
    for s in range(4):
        qh |= (upper[..., s, :] << (2 * s)).astype(np.uint8)
    return np.concatenate([ql, qh.reshape(n, -1, 64), sc.view(np.uint8), _f16(d)], axis=-1).reshape(n, -1)


def quantize(w: np.ndarray, type_name: str) -> tuple[np.ndarray, object]:
    """(data, raw_dtype) for GGUFWriter.add_tensor."""
    import gguf

    kind = gguf.GGMLQuantizationType[type_name]
    if type_name == "F32":
        return w.astype(np.float32), None
    if type_name == "F16":
        return w.astype(np.float16), None
    if type_name in ("Q4_K", "Q5_K"):
        return quantize_k_minmax(w, 4 if type_name == "Q4_K" else 5), kind
    if type_name == "Q6_K":
        return quantize_q6_k(w), kind
    return gguf.quants.quantize(w.astype(np.float32), kind), kind


@dataclass
class ModelSpec:
    arch: str = "llama"
    hidden: int = 256
    ff: int = 512
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    vocab: int = 1024
    tied: bool = False
    bias: bool = False  # q/k/v biases (qwen2 has them)
    qk_norm: bool = False  # qwen3
    types: dict[str, str] = field(default_factory=dict)  # tensor suffix ("attn_q") -> type; default "Q8_0"
    metadata: dict[str, object] = field(default_factory=dict)  # extra "<arch>.<key>" values
    rope_freqs: np.ndarray | None = None
    rotary: int | None = None  # rotated dims per head (default: all); phi3 may rotate a part
    longrope: tuple[np.ndarray, np.ndarray] | None = None  # phi3 (long, short) factors


@functools.cache
def _embedded_tokenizer_fields() -> dict[str, tuple[object, list]]:
    """The embedded SmolLM2's tokenizer.* fields (contents, types), read once per test run: the
    gguf reader parses a 49k-token vocabulary field by field, seconds per file."""
    import gguf

    from radix_backend.model_executor.loader import embedded_gguf_path

    reader = gguf.GGUFReader(str(embedded_gguf_path()))
    return {key: (f.contents(), list(f.types)) for key, f in reader.fields.items() if key.startswith("tokenizer.")}


@functools.cache
def _tokenizer_subset(vocab: int) -> dict[str, object]:
    """The vocabulary fields cut to the first `vocab` tokens (merges of kept tokens only)."""
    fields = _embedded_tokenizer_fields()
    all_tokens = fields["tokenizer.ggml.tokens"][0]
    tokens = all_tokens[:vocab]
    kept = set(tokens)
    merges = fields["tokenizer.ggml.merges"][0]
    return {"tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": fields["tokenizer.ggml.token_type"][0][:vocab],
            "tokenizer.ggml.merges": merges if vocab >= len(all_tokens) else
            [m for m in merges if m.replace(" ", "", 1) in kept and set(m.split(" ", 1)) <= kept]}


def _copy_tokenizer(writer, vocab: int) -> None:
    """The embedded SmolLM2 tokenizer (cut to its first `vocab` tokens) with its chat template."""
    subsets = _tokenizer_subset(vocab)
    for key, (contents, types) in _embedded_tokenizer_fields().items():
        writer.add_key_value(key, subsets.get(key, contents), types[0], types[1] if len(types) > 1 else None)


def write_model(path: Path, spec: ModelSpec, seed: int = 0) -> Path:
    """A random model of `spec` as a GGUF file (weights ~ N(0, 0.05), norms ~ 1)."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), spec.arch)
    _copy_tokenizer(writer, spec.vocab)
    head_dim = spec.hidden // spec.heads
    writer.add_block_count(spec.layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.ff)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(spec.rotary or head_dim)
    writer.add_key_length(head_dim)  # as llama.cpp's converter writes it (transformers needs it for qwen3)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(spec.vocab)
    for key, value in spec.metadata.items():
        if isinstance(value, str):
            writer.add_string(f"{spec.arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{spec.arch}.{key}", value)
        else:
            writer.add_uint32(f"{spec.arch}.{key}", int(value))

    def matrix(name: str, rows: int, cols: int, suffix: str) -> None:
        data, raw = quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), spec.types.get(suffix, "Q8_0"))
        writer.add_tensor(name, data, raw_dtype=raw)

    def vector(name: str, size: int, center: float = 1.0) -> None:
        writer.add_tensor(name, (center + 0.1 * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", spec.vocab, spec.hidden, "token_embd")
    vector("output_norm.weight", spec.hidden)
    if not spec.tied:
        matrix("output.weight", spec.vocab, spec.hidden, "output")
    if spec.rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", spec.rope_freqs.astype(np.float32))
    if spec.longrope is not None:  # as llama.cpp's converter writes a Phi-3 LongRoPE model
        writer.add_tensor("rope_factors_long.weight", spec.longrope[0].astype(np.float32))
        writer.add_tensor("rope_factors_short.weight", spec.longrope[1].astype(np.float32))
    fused = spec.arch == "phi3"  # q|k|v in attn_qkv, gate|up in ffn_up
    kv = spec.kv_heads * head_dim
    for i in range(spec.layers):
        vector(f"blk.{i}.attn_norm.weight", spec.hidden)
        vector(f"blk.{i}.ffn_norm.weight", spec.hidden)
        if fused:
            matrix(f"blk.{i}.attn_qkv.weight", spec.hidden + 2 * kv, spec.hidden, "attn_qkv")
        for part, rows in () if fused else (("attn_q", spec.hidden), ("attn_k", kv), ("attn_v", kv)):
            matrix(f"blk.{i}.{part}.weight", rows, spec.hidden, part)
            if spec.bias:
                vector(f"blk.{i}.{part}.bias", rows, center=0.0)
        if spec.qk_norm:
            vector(f"blk.{i}.attn_q_norm.weight", head_dim)
            vector(f"blk.{i}.attn_k_norm.weight", head_dim)
        matrix(f"blk.{i}.attn_output.weight", spec.hidden, spec.hidden, "attn_output")
        if not fused:
            matrix(f"blk.{i}.ffn_gate.weight", spec.ff, spec.hidden, "ffn_gate")
        matrix(f"blk.{i}.ffn_up.weight", spec.ff * (2 if fused else 1), spec.hidden, "ffn_up")
        matrix(f"blk.{i}.ffn_down.weight", spec.hidden, spec.ff, "ffn_down")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def requantize_smollm2(path: Path, types: dict[str, str]) -> Path:
    """The embedded SmolLM2 with its weights re-quantized: `types` maps a tensor-name part
    ("ffn_down", "attn_v", "token_embd", ...) to a type; other matrices keep Q8_0."""
    import gguf

    from radix_backend.model_executor.loader import embedded_gguf_path

    reader = gguf.GGUFReader(str(embedded_gguf_path()))
    writer = gguf.GGUFWriter(str(path), "llama")
    skip = ("GGUF.", "general.architecture", "general.alignment")
    for key, f in reader.fields.items():
        if not key.startswith(skip):
            writer.add_key_value(key, f.contents(), f.types[0], f.types[1] if len(f.types) > 1 else None)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        if len(t.shape) == 1:
            writer.add_tensor(t.name, values.astype(np.float32))
            continue
        part = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.split(".")[0]
        data, raw = quantize(values, types.get(part, "Q8_0"))
        writer.add_tensor(t.name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# HF layer tensor (after "model.layers.N.") -> llama.cpp's name (after "blk.N."), as its converter writes them
_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_HF_TO_GGUF_GEMMA2 = {**_HF_TO_GGUF, "post_attention_layernorm.weight": "post_attention_norm.weight",
                      "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                      "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
_HF_TO_GGUF_OLMO2 = {**_HF_TO_GGUF, "post_attention_layernorm.weight": "post_attention_norm.weight",
                     "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
_GGUF_ARCH = {"gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3", "qwen2_moe": "qwen2moe",
              "qwen3_moe": "qwen3moe", "mixtral": "llama", "olmo2": "olmo2"}
_EXPERT_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def hf_to_gguf(model_dir: Path, path: Path, matrix_type: str = "F32") -> Path:
    """A tiny HF Gemma, OLMo 2 or MoE checkpoint as llama.cpp's converter writes it: its tensor names, Gemma's
    norm weights stored as 1 + w, the metadata llama.cpp reads (with the sliding layers as a
    per-layer flag array, which llama.cpp honours, so a checkpoint's own `layer_types` survive),
    experts stacked per layer, a llama (Mixtral) file's q/k rows permuted for llama.cpp's RoPE;
    matrices in `matrix_type`, vectors and routers in F32."""
    import json

    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    arch = _GGUF_ARCH[cfg["model_type"]]
    writer = gguf.GGUFWriter(str(path), arch)
    _copy_tokenizer(writer, cfg["vocab_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = cfg.get("rope_parameters") or {}
    if arch == "gemma3":
        full = rope.get("full_attention", {})
        writer.add_rope_freq_base(full.get("rope_theta", 1_000_000.0))
        writer.add_float32(f"{arch}.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
    else:
        writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(cfg["sliding_window"])
        writer.add_array(f"{arch}.attention.sliding_window_pattern",
                         [kind == "sliding_attention" for kind in cfg["layer_types"]])
        if cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    names = _HF_TO_GGUF_GEMMA2 if arch in ("gemma2", "gemma3") else _HF_TO_GGUF_OLMO2 if arch == "olmo2" else _HF_TO_GGUF
    tensors = load_file(str(model_dir / "model.safetensors"))
    stacked: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, value in list(tensors.items()):
        parts = name.replace(".block_sparse_moe.", ".mlp.").split(".")
        if "experts" in parts:  # model.layers.L.mlp.experts.E.proj.weight
            layer, expert, proj = parts[2], int(parts[5]), _EXPERT_PARTS[parts[6]]
            stacked.setdefault((layer, proj), {})[expert] = value
            del tensors[name]
        elif ".block_sparse_moe." in name:
            tensors[name.replace(".block_sparse_moe.", ".mlp.")] = tensors.pop(name)
    for (layer, proj), by_expert in stacked.items():
        whole = np.stack([by_expert[e] for e in range(len(by_expert))]).astype(np.float32)
        data, raw = quantize(whole.reshape(-1, whole.shape[-1]), matrix_type)
        writer.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", data.reshape(*whole.shape[:2], -1), raw_dtype=raw)
    for name, value in tensors.items():
        value = value.astype(np.float32)
        if name.endswith("norm.weight") and arch.startswith("gemma"):
            value = value + 1.0  # Gemma's (1 + w)
        if arch == "llama" and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
            heads = cfg["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            value = value.reshape(heads, 2, value.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(value.shape)
        if name.endswith("shared_expert_gate.weight") or name.endswith("mlp.gate.weight"):
            writer.add_tensor(f"blk.{name.split('.')[2]}.{names[name.split('.', 3)[3]]}",
                              value.reshape(-1) if value.shape[0] == 1 else value)
            continue
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.get("tie_word_embeddings", True):
                continue
            out = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            out = f"blk.{layer}.{names[rest]}"
        if value.ndim == 1:
            writer.add_tensor(out, value)
        else:
            data, raw = quantize(value, matrix_type)
            writer.add_tensor(out, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
