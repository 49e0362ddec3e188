"""Model configs: every field of a supported family's config is honoured or harmless, and a config
asking for math the decoder does not do is refused by name before any weight is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import (GemmaConfig, Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig, MistralConfig,
                          MixtralConfig, Olmo2Config, Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
                          Qwen3MoeConfig)

from radix_backend import Engine, SamplingParams
from radix_backend.errors import ModelLoadError
from radix_backend.models.config_check import (GEMMA_FAMILIES, GEMMA_HONOURED, HARMLESS, HONOURED, MOE_FAMILIES,
                                               MOE_HONOURED, ModelLimits, check_model_config, layer_windows)

from conftest import TINY_LONGROPE_ORIGINAL, TINY_WINDOW

FAMILIES = [LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Phi3Config, GraniteConfig, GemmaConfig, Gemma2Config,
            Gemma3TextConfig, Qwen2MoeConfig, Qwen3MoeConfig, MixtralConfig, Olmo2Config]


@pytest.mark.parametrize("config_class", FAMILIES, ids=lambda c: c.__name__)
def test_every_field_of_a_supported_family_is_classified(config_class):
    """A new transformers field shows up here first: decide whether the decoder honours it."""
    config = config_class()
    honoured = HONOURED | (GEMMA_HONOURED if config.model_type in GEMMA_FAMILIES else set()) | (
        MOE_HONOURED if config.model_type in MOE_FAMILIES else set())
    assert set(config.to_dict()) - honoured - HARMLESS == set()
    check_model_config(config_class())  # the defaults load


@pytest.mark.parametrize("change,named", [
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(hidden_act="gelu_pytorch_tanh"), "hidden_act"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_type='dynamic'"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 4}), "quantization_config"),
    (dict(rope_interleaved=True), "rope_interleaved"),
])
def test_math_changing_fields_are_refused_by_name(change, named):
    with pytest.raises(ModelLoadError, match=named.replace("(", r"\(")):
        check_model_config(LlamaConfig(**change))


def test_harmless_and_unset_unknown_fields_load():
    config = LlamaConfig(attention_dropout=0.1, initializer_range=0.5, pretraining_tp=2)
    config.rope_interleaved = False  # unknown but off: the plain computation
    config.custom_note = None
    assert check_model_config(config).capped_by is None


def test_sliding_windows_are_per_layer_and_longrope_caps_the_context():
    assert layer_windows(MistralConfig(sliding_window=4096, num_hidden_layers=2)) == [4096, 4096]
    assert check_model_config(MistralConfig(sliding_window=4096)).capped_by is None  # honoured, not capped
    assert layer_windows(MistralConfig(sliding_window=None, num_hidden_layers=2)) == [None, None]
    assert layer_windows(Phi3Config(sliding_window=2047, num_hidden_layers=1)) == [2047]
    qwen = Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=1, num_hidden_layers=3)
    assert layer_windows(qwen) == [None, 64, 64]  # HF: layers from max_window_layers on slide
    assert layer_windows(Qwen2Config(sliding_window=64, num_hidden_layers=2)) == [None, None]
    assert layer_windows(LlamaConfig(num_hidden_layers=2)) == [None, None]
    longrope = Phi3Config(max_position_embeddings=131072, original_max_position_embeddings=4096,
                          rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48})
    assert check_model_config(longrope) == ModelLimits(4096, "longrope short factors")


def test_unknown_layer_types_are_refused():
    config = Qwen2Config(num_hidden_layers=2, layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(ModelLoadError, match="chunked_attention"):
        check_model_config(config)


def test_engine_refuses_a_gelu_checkpoint_before_reading_weights(tiny_llama_dir, tmp_path):
    bad = tmp_path / "gelu"
    shutil.copytree(tiny_llama_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    for weights in bad.glob("*.safetensors"):
        weights.write_bytes(b"not read")  # a refusal must come before any weight is read
    with pytest.raises(ModelLoadError, match="hidden_act='gelu'"):
        Engine(str(bad), kv_cache_tokens=1024, device="cpu")


def test_sliding_window_model_serves_past_its_window_like_hf(tiny_mistral_window_dir: Path):
    """Prompts longer than the window: greedy tokens equal HF's; a cached prefix longer than the
    window, chunked prefill and the native kernels' window give the same tokens as a cold run."""
    from test_models import hf_greedy

    prompt = "one two three four five six seven eight nine ten " * 15
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    with Engine(str(tiny_mistral_window_dir), kv_cache_tokens=4096, device="cpu", dtype="float32") as engine:
        ids = engine.encode(prompt)
        assert len(ids) > 2 * TINY_WINDOW
        cold = engine.generate(prompt, params)
        assert cold.token_ids == hf_greedy(tiny_mistral_window_dir, ids, 12)
        warm = engine.generate(prompt + " eleven", params)  # extends a cached prefix > window
        assert warm.meta.cached_tokens > TINY_WINDOW
    with Engine(str(tiny_mistral_window_dir), kv_cache_tokens=4096, device="cpu", dtype="float32",
                chunked_prefill_tokens=48, attention_backend="torch") as chunked:
        assert chunked.generate(prompt, params).token_ids == cold.token_ids
        assert chunked.generate(prompt + " eleven", params).token_ids == warm.token_ids


def test_longrope_model_serves_its_short_factor_range(tiny_phi4_dir: Path):
    with Engine(str(tiny_phi4_dir), kv_cache_tokens=4096, device="cpu", dtype="float32") as engine:
        assert engine.context_length == TINY_LONGROPE_ORIGINAL
        assert engine.runner.model.cos_sin_cache.shape[-1] == 12  # 3/4 of the 16-dim heads rotate
        stack = engine.runner.model.decode_stack  # the native stack rotates the same 12 features
        assert stack is not None and stack.cos_sin.shape[-1] == 12


def test_the_embedded_models_hf_directory_passes_its_own_check(smollm2_hf_dir: str) -> None:
    """transformers writes the GGUF's name as `_model_name_or_path`: bookkeeping, not a refusal."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(smollm2_hf_dir)
    assert check_model_config(config).context_length == 8192
