"""A GGUF file's config (`GGUFConfig`) holds what transformers' own config class would hold for
the same values, for every field the models and the config check read, on a file of every
supported architecture; and building it imports none of those classes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gguf_files import ModelSpec, write_model
from radix_backend.model_executor.gguf_file import config_fields, open_gguf
from radix_backend.models import config_check, moe

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

SPECS = {
    "llama": ModelSpec(layers=1),
    "llama-rope-freqs": ModelSpec(layers=1, rope_freqs=np.linspace(1.0, 8.0, 32)),
    "llama-linear-rope": ModelSpec(layers=1, metadata={"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}),
    "qwen2": ModelSpec(arch="qwen2", layers=1, bias=True, tied=True),
    "qwen3": ModelSpec(arch="qwen3", layers=1, qk_norm=True),
    "phi3-longrope": ModelSpec(arch="phi3", layers=1, tied=True, rotary=48,
                               longrope=(np.linspace(2.0, 8.0, 24), np.linspace(1.0, 1.5, 24)),
                               metadata={"attention.sliding_window": 0, "rope.scaling.original_context_length": 512,
                                         "rope.scaling.attn_factor": 1.1}),
    "phi3-window": ModelSpec(arch="phi3", layers=1, metadata={"attention.sliding_window": 64}),
}
FAMILY_FIXTURES = ["tiny_gemma_dir", "tiny_gemma2_dir", "tiny_gemma3_dir", "tiny_qwen2_moe_dir",
                   "tiny_qwen3_moe_dir", "tiny_mixtral_dir", "tiny_olmo2_dir"]
READ = sorted(config_check.HONOURED | config_check.GEMMA_HONOURED | config_check.MOE_HONOURED
              | {"bos_token_id", "eos_token_id", "pad_token_id"})
# compared through the readers the models use (RoPE settings, each layer's window, the expert count)
# or reaching the models only through them (`max_window_layers` and the window pattern become
# `layer_types`); the router's loss weight is for training
BY_READER = {"rope_parameters", "rope_scaling", "rope_theta", "layer_types", "max_window_layers",
             "_sliding_window_pattern", "sliding_window_pattern", "num_local_experts", "num_experts",
             "router_aux_loss_coef"}


def assert_same_as_transformers(path: Path) -> None:
    class_name, model_type, fields = config_fields(path)
    want = getattr(transformers, class_name)(**fields)
    got = open_gguf(path).config
    assert got.model_type == want.model_type == model_type
    assert type(got.to_transformers()) is type(want) and got.to_transformers().to_dict() == want.to_dict()
    assert config_check.rope_parameters(got) == config_check.rope_parameters(want)
    assert config_check.layer_windows(got) == config_check.layer_windows(want)
    assert config_check.check_model_config(got) == config_check.check_model_config(want)
    if model_type in config_check.MOE_FAMILIES:
        assert moe.num_experts(got) == moe.num_experts(want)
    for name in READ:  # a field left out must be one the class leaves off (None, False, 0) too
        mine, theirs = getattr(got, name, None), getattr(want, name, None)
        if name in BY_READER:
            continue
        assert mine == theirs or (not mine and not theirs), f"{path.name}: {name}: {mine!r} != {theirs!r}"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_llama_qwen_phi_files(name, tmp_path):
    assert_same_as_transformers(write_model(tmp_path / f"{name}.gguf", SPECS[name]))


@pytest.mark.parametrize("fixture", FAMILY_FIXTURES)
def test_gemma_moe_olmo_files(fixture, request, tmp_path):
    from gguf_files import hf_to_gguf

    assert_same_as_transformers(hf_to_gguf(request.getfixturevalue(fixture), tmp_path / "m.gguf", "F32"))


def test_opening_a_gguf_imports_no_transformers_config_class(tmp_path):
    path = write_model(tmp_path / "m.gguf", ModelSpec(layers=1))
    code = ("import sys; from pathlib import Path; from radix_backend.model_executor.gguf_file import open_gguf; "
            f"open_gguf(Path({str(path)!r})); "
            "print(sorted(m for m in sys.modules if m.startswith('transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
