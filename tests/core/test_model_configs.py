"""Model configs: every field of a supported family's config is honoured or harmless, and a config
asking for math the decoder does not do is refused by name before any weight is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import GraniteConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

from radix_backend import Engine, SamplingParams
from radix_backend.errors import InvalidRequestError, ModelLoadError
from radix_backend.models.config_check import HARMLESS, HONOURED, ModelLimits, check_model_config

from conftest import TINY_LONGROPE_ORIGINAL, TINY_WINDOW

FAMILIES = [LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Phi3Config, GraniteConfig]


@pytest.mark.parametrize("config_class", FAMILIES, ids=lambda c: c.__name__)
def test_every_field_of_a_supported_family_is_classified(config_class):
    """A new transformers field shows up here first: decide whether the decoder honours it."""
    fields = set(config_class().to_dict())
    assert fields - HONOURED - HARMLESS == set()
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


def test_sliding_window_and_longrope_cap_the_context_exactly_where_shorter():
    assert check_model_config(MistralConfig(sliding_window=4096)) == ModelLimits(4096, "sliding window")
    assert check_model_config(MistralConfig(sliding_window=None)).capped_by is None
    assert check_model_config(Phi3Config(sliding_window=2047)).context_length == 2047
    longrope = Phi3Config(max_position_embeddings=131072, original_max_position_embeddings=4096,
                          rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48})
    assert check_model_config(longrope) == ModelLimits(4096, "longrope short factors")
    qwen = Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=1, num_hidden_layers=2)
    assert check_model_config(qwen).context_length == 64
    assert check_model_config(Qwen2Config(sliding_window=64)).context_length == Qwen2Config().max_position_embeddings
    assert check_model_config(MistralConfig(sliding_window=10 ** 9)).capped_by is None  # longer than context


def test_engine_refuses_a_gelu_checkpoint_before_reading_weights(tiny_llama_dir, tmp_path):
    bad = tmp_path / "gelu"
    shutil.copytree(tiny_llama_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    for weights in bad.glob("*.safetensors"):
        weights.write_bytes(b"not read")  # a refusal must come before any weight is read
    with pytest.raises(ModelLoadError, match="hidden_act='gelu'"):
        Engine(str(bad), kv_cache_tokens=1024, device="cpu")


def test_sliding_window_model_serves_its_window_and_refuses_longer(tiny_mistral_window_dir: Path):
    with Engine(str(tiny_mistral_window_dir), kv_cache_tokens=4096, device="cpu", dtype="float32") as engine:
        assert engine.context_length == TINY_WINDOW
        long_prompt = "one two three four five six seven eight nine ten " * 8
        assert len(engine.encode(long_prompt)) > TINY_WINDOW
        with pytest.raises(InvalidRequestError, match=str(TINY_WINDOW)):
            engine.generate(long_prompt, SamplingParams(max_new_tokens=4))


def test_longrope_model_serves_its_short_factor_range(tiny_phi4_dir: Path):
    with Engine(str(tiny_phi4_dir), kv_cache_tokens=4096, device="cpu", dtype="float32") as engine:
        assert engine.context_length == TINY_LONGROPE_ORIGINAL
        assert engine.runner.model.cos_sin_cache.shape[-1] == 12  # 3/4 of the 16-dim heads rotate
        assert engine.runner.model.decode_stack is None  # the native stack rotates whole heads only


def test_the_embedded_models_hf_directory_passes_its_own_check(smollm2_hf_dir: str) -> None:
    """transformers writes the GGUF's name as `_model_name_or_path`: bookkeeping, not a refusal."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(smollm2_hf_dir)
    assert check_model_config(config).context_length == 8192
