"""GGUF files run in their own tensor types: read in place, checked before any weight is touched,
every supported type on the native kernels, results tracking the fp32 reference (the same file
dequantized, which itself reproduces HF transformers), cached == uncached."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_files import ModelSpec, requantize_smollm2, write_model
from radix_backend import Engine, SamplingParams
from radix_backend.errors import ModelLoadError
from radix_backend.kernels import native, ops
from radix_backend.model_executor.loader import resolve_checkpoint

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built here")

K_QUANTS = {"token_embd": "Q6_K", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K",
            "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K"}
SPECS = {
    "llama-kquants": ModelSpec(types=K_QUANTS),
    "qwen2-legacy": ModelSpec(arch="qwen2", bias=True, tied=True, hidden=128, ff=256, heads=2, kv_heads=1,
                              types={"token_embd": "Q8_0", "attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "Q4_0",
                                     "attn_output": "Q4_1", "ffn_gate": "Q5_0", "ffn_up": "Q4_0", "ffn_down": "Q8_0"}),
    "qwen3-floats": ModelSpec(arch="qwen3", qk_norm=True, hidden=128, ff=256, heads=4, kv_heads=2,
                              types={"token_embd": "F16", "output": "Q8_0", "attn_q": "F16", "attn_k": "F32",
                                     "attn_v": "Q4_1", "attn_output": "Q8_0", "ffn_gate": "Q5_1", "ffn_up": "Q4_K",
                                     "ffn_down": "Q5_0"}),
    "phi3-fused": ModelSpec(arch="phi3", hidden=256, ff=512, heads=4, kv_heads=2,
                            types={"attn_qkv": "Q4_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K", "attn_output": "Q8_0"},
                            metadata={"attention.sliding_window": 0, "rope.scaling.original_context_length": 2048}),
}
PROMPTS = ["Hello there", "What is a cat?", "One two three four five six"]


@pytest.fixture(scope="module", params=list(SPECS))
def model_file(request, tmp_path_factory) -> Path:
    spec = SPECS[request.param]
    if request.param == "qwen3-floats":  # K-quant rows need 256 input features
        spec = dataclasses.replace(spec, hidden=256, ff=512)
    return write_model(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", spec)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def test_a_gguf_runs_in_its_own_types_and_tracks_the_fp32_reference(model_file):
    with Engine(str(model_file), kv_cache_tokens=1024, quantization="auto") as eng, \
            Engine(str(model_file), kv_cache_tokens=1024, quantization="none") as ref:
        report = eng.runner.quantization
        assert report.mode == "gguf" and report.lossless
        kernels = {kernel for per_type in report.kernels.values() for kernel in per_type}
        assert all(k.startswith("native") for name, per_type in report.kernels.items() for k in per_type
                   if name not in ("F16", "F32", "BF16")), report.kernels
        assert "fp32 (dequantized)" not in kernels
        # no fp32 copy of a quantized weight matrix: the only fp32 matrices are the file's float tensors
        matrices = [t for t in [*eng.runner.model.parameters(), *eng.runner.model.buffers()]
                    if t.dtype == torch.float32 and t.dim() == 2 and t is not eng.runner.model.cos_sin_cache]
        float_tensors = sum(n for per_type in report.kernels.values() for k, n in per_type.items() if k == "fp32")
        assert len(matrices) == float_tensors
        ids = [eng.encode(p) for p in PROMPTS]
        for prompt in ids:  # 8-bit activations for the prompt rows: the products within ~5e-3
            assert relative_error(eng.next_token_logits(prompt), ref.next_token_logits(prompt)) < 5e-2
        params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
        cold = [o.token_ids for o in eng.generate(input_ids=ids, params=params)]
        warm = [o.token_ids for o in eng.generate(input_ids=ids, params=params)]
        assert eng.cache_stats().cached_tokens > 0 and cold == warm
        # 16-bit activations everywhere and fp32 attention products: the file's own weights at fp32
        # accuracy, fp32's tokens
    with Engine(str(model_file), kv_cache_tokens=1024, quantization="auto", activation_bits=16,
                attention_dtype="fp32") as exact, \
            Engine(str(model_file), kv_cache_tokens=1024, quantization="none") as ref:
        for prompt in ids:
            assert relative_error(exact.next_token_logits(prompt), ref.next_token_logits(prompt)) < 1e-3
        assert [o.token_ids for o in exact.generate(input_ids=ids, params=params)] == \
            [o.token_ids for o in ref.generate(input_ids=ids, params=params)]


def test_the_fp32_reference_of_a_gguf_reproduces_transformers(model_file):
    """Config from the metadata, q/k rows un-permuted, biases and q/k norms: the dequantized model
    gives HF transformers' logits on the same file."""
    transformers = pytest.importorskip("transformers")
    # transformers' GGUF reader leaves qwen3's head size at its default (it skips key_length): it
    # gets the config we read, the tensors it reads itself
    config = resolve_checkpoint(model_file).config.to_transformers()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_file.parent), gguf_file=model_file.name,
                                                           config=config, dtype=torch.float32).eval()
    with Engine(str(model_file), kv_cache_tokens=1024, quantization="none") as ref:
        for prompt in PROMPTS:
            ids = ref.encode(prompt)
            with torch.no_grad():
                want = hf(torch.tensor([ids])).logits[0, -1]
            assert relative_error(ref.next_token_logits(ids), want) < 1e-4


def test_the_decode_stack_takes_a_chained_qkv_of_mixed_types(tmp_path):
    path = write_model(tmp_path / "mixed.gguf", SPECS["llama-kquants"])
    with Engine(str(path), kv_cache_tokens=1024, quantization="auto") as eng:
        qkv = eng.runner.model.layers[0].self_attn.qkv_proj
        assert [kind for kind, _ in qkv.kernels] == ["Q4_K", "Q5_K", "Q6_K"] and qkv.native_q4.next is not None
        assert eng.runner.quantization.decode_stack and eng.runner.model.decode_stack is not None


def test_q8_0_parts_join_the_chain_and_the_decode_stack(tmp_path):
    """llama.cpp's Q4_K_M files keep some attn_v / ffn_down tensors in Q8_0: they join the low-bit
    chain, so the one-call decode stack serves the model, with the per-layer path's greedy tokens
    and logprobs."""
    types = {**K_QUANTS, "attn_k": "Q4_K", "attn_v": "Q8_0", "ffn_down": "Q8_0", "output": "Q8_0"}
    path = write_model(tmp_path / "q4_k_m.gguf", dataclasses.replace(SPECS["llama-kquants"], types=types))
    params = SamplingParams(max_new_tokens=10, temperature=0, logprobs=True)
    with Engine(str(path), kv_cache_tokens=1024, quantization="auto") as eng:
        qkv = eng.runner.model.layers[0].self_attn.qkv_proj
        assert [kind for kind, _ in qkv.kernels] == ["Q4_K", "Q4_K", "Q8_0"]
        assert qkv.native_q4.next.next.high_bits == 4 and eng.runner.model.decode_stack is not None
        assert eng.runner.quantization.kernels["Q8_0"] == {"native low-bit": 4 + 1}  # 2 layers x 2, the head
        stacked = [eng.generate(p, params) for p in PROMPTS]
        eng.runner.model.decode_stack = None
        eng.flush_cache()
        layered = [eng.generate(p, params) for p in PROMPTS]
    for got, want in zip(stacked, layered):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in got.logprobs]),
                                   torch.tensor([lp.logprob for lp in want.logprobs]), atol=1e-4, rtol=1e-4)


def test_rope_freqs_divide_the_rotary_frequencies(tmp_path):
    """Llama 3 files carry their rope scaling as rope_freqs.weight: it is applied, not dropped."""
    factors = np.linspace(1.0, 8.0, 32)
    plain = resolve_checkpoint(write_model(tmp_path / "plain.gguf", ModelSpec()))
    scaled = resolve_checkpoint(write_model(tmp_path / "scaled.gguf", ModelSpec(rope_freqs=factors)))
    assert scaled.config.rope_freq_factors == pytest.approx(list(factors))
    from radix_backend.models.llama import rope_cos_sin_cache

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    want = ops.build_cos_sin_cache(inv_freq / torch.tensor(factors, dtype=torch.float32), 2048, 1.0)
    torch.testing.assert_close(rope_cos_sin_cache(scaled.config, 64, 2048), want)
    assert not torch.allclose(rope_cos_sin_cache(plain.config, 64, 2048), want)


@pytest.mark.parametrize("metadata,match", [
    ({"attention.sliding_window": 64}, "llama.attention.sliding_window"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, "rope.scaling.type='yarn'"),
    ({"expert_count": 8}, "llama.expert_count"),
])
def test_fields_we_would_ignore_are_refused_by_name(tmp_path, metadata, match):
    path = write_model(tmp_path / "m.gguf", ModelSpec(layers=1, metadata=metadata))
    with pytest.raises(ModelLoadError, match=match):
        resolve_checkpoint(path)


def test_unsupported_architecture_is_refused_before_any_weight_is_read(tmp_path):
    path = write_model(tmp_path / "g.gguf", ModelSpec(arch="mamba", layers=1))
    with pytest.raises(ModelLoadError, match="architecture 'mamba' is not supported; supported: llama, qwen2, qwen3"):
        resolve_checkpoint(path)


def test_unsupported_tensor_type_names_the_supported_ones(tmp_path):
    import gguf

    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 66), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="IQ2_XXS, which has no kernel here; supported GGUF tensor types: F32"):
        resolve_checkpoint(path)


def test_damaged_files_are_clear_errors(tmp_path):
    good = write_model(tmp_path / "good.gguf", ModelSpec(layers=1))
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match="runs past the end of the file"):
        resolve_checkpoint(cut)
    header = tmp_path / "header.gguf"
    header.write_bytes(data[:200])
    with pytest.raises(ModelLoadError, match="truncated"):
        resolve_checkpoint(header)
    version = tmp_path / "version.gguf"
    version.write_bytes(data[:4] + struct.pack("<I", 99) + data[8:])
    with pytest.raises(ModelLoadError, match="version 99"):
        resolve_checkpoint(version)


@pytest.mark.slow
def test_smollm2_requantized_like_q4_k_m(tmp_path):
    """SmolLM2 as llama.cpp's Q4_K_M makes it (576 features are not whole super-blocks, so most
    matrices fall back to Q5_0; ffn_down takes Q4_K/Q6_K, attn_v Q8_0): the engine runs it in
    those types, cached == uncached, and with 16-bit activations its greedy tokens are the fp32
    reference's."""
    path = requantize_smollm2(tmp_path / "smollm2-q4km.gguf", {
        "attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q5_0",
        "ffn_up": "Q5_0", "ffn_down": "Q6_K", "token_embd": "Q8_0"})
    prompts = [[{"role": "user", "content": p}] for p in ("What is the capital of France?",
                                                          "Write a haiku about the sea.")]
    params = SamplingParams(max_new_tokens=16, temperature=0)
    with Engine(str(path), kv_cache_tokens=4096, quantization="auto") as eng:
        assert set(eng.runner.quantization.kernels) == {"Q5_0", "Q6_K", "Q8_0"}
        cold = [o.token_ids for o in eng.generate(messages=prompts, params=params)]
        warm = [o.token_ids for o in eng.generate(messages=prompts, params=params)]
        assert cold == warm
    with Engine(str(path), kv_cache_tokens=4096, quantization="auto", activation_bits=16) as exact, \
            Engine(str(path), kv_cache_tokens=4096, quantization="none") as ref:
        assert [o.token_ids for o in exact.generate(messages=prompts, params=params)] == \
            [o.token_ids for o in ref.generate(messages=prompts, params=params)]


def test_phi4_mini_shape_partial_rotary_and_longrope(tmp_path):
    """What llama.cpp's converter writes for Phi-4-mini: 3/4 of each head rotated, LongRoPE as a
    long/short factor pair: read into the config, the context capped at the original length (where
    HF uses the short factors), the file's own types tracking the fp32 reference."""
    rotary = 48  # of 64 per head
    factors = (np.linspace(2.0, 8.0, rotary // 2), np.linspace(1.0, 1.5, rotary // 2))
    spec = ModelSpec(arch="phi3", hidden=256, ff=512, heads=4, kv_heads=2, tied=True, rotary=rotary, longrope=factors,
                     metadata={"attention.sliding_window": 0, "rope.scaling.original_context_length": 512,
                               "rope.scaling.attn_factor": 1.1})
    path = write_model(tmp_path / "phi4.gguf", spec)
    config = resolve_checkpoint(path).config
    assert config.rope_parameters["rope_type"] == "longrope"
    assert config.rope_parameters["short_factor"] == pytest.approx(list(factors[1]))
    with Engine(str(path), kv_cache_tokens=1024, quantization="auto") as eng, \
            Engine(str(path), kv_cache_tokens=1024, quantization="none") as ref:
        assert eng.context_length == 512 and eng.runner.model.cos_sin_cache.shape[-1] == rotary
        for prompt in PROMPTS:
            ids = eng.encode(prompt)
            assert relative_error(eng.next_token_logits(ids), ref.next_token_logits(ids)) < 5e-2
    with pytest.raises(ModelLoadError, match="attention.sliding_window"):
        resolve_checkpoint(write_model(tmp_path / "llama.gguf", ModelSpec(layers=1, metadata={
            "attention.sliding_window": 64})))
