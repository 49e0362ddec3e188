"""EngineConfig: one place for every engine knob, its default and its check; CLI flags from its fields."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from radix_backend.config import EngineConfig, add_cli_args, from_cli_args
from radix_backend.kernels import registry


def test_defaults_and_replace():
    cfg = EngineConfig()
    assert (cfg.page_size, cfg.schedule_policy, cfg.max_running_requests) == (1, "lpm", 64)
    changed = cfg.replace(page_size=16, disable_radix_cache=True)
    assert changed.page_size == 16 and changed.disable_radix_cache and cfg.page_size == 1
    with pytest.raises(TypeError, match="unknown engine option.*kv_cache_size.*known: device"):
        cfg.replace(kv_cache_size=100)


@pytest.mark.parametrize("bad, match", [
    ({"schedule_policy": "random"}, "schedule_policy must be one of lpm"),
    ({"quantization": "int3"}, "quantization must be one of"),
    ({"attention_backend": "xformers"}, "attention_backend must be one of"),
    ({"dtype": "float64"}, "dtype must be one of"),
    ({"page_size": 0}, "page_size must be a positive int"),
    ({"tp_size": True}, "tp_size must be a positive int"),
    ({"chunked_prefill_tokens": 0}, "chunked_prefill_tokens must be a positive int"),
    ({"kv_cache_tokens": 8}, "kv_cache_tokens must be an int >= 16"),
    ({"mem_fraction": 1.5}, r"mem_fraction must be in \(0, 1\]"),
    ({"activation_bits": 4}, "activation_bits must be 8 or 16"),
    ({"tp_timeout_s": 0}, "tp_timeout_s must be a positive number"),
])
def test_bad_values_are_refused_when_the_config_is_built(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**bad)


def test_cli_flags_come_from_the_fields_and_round_trip():
    parser = add_cli_args(argparse.ArgumentParser())
    cli_fields = [f for f in dataclasses.fields(EngineConfig) if f.metadata["cli"]]
    assert {a.dest for a in parser._actions} >= {f.name for f in cli_fields}
    assert from_cli_args(parser.parse_args([])) == EngineConfig.from_env()
    args = parser.parse_args(["--page-size", "4", "--schedule-policy", "fcfs", "--no-enable-jump-forward",
                              "--disable-radix-cache", "--kv-cache-tokens", "512", "--quantization", "none"])
    assert from_cli_args(args) == EngineConfig(page_size=4, schedule_policy="fcfs", enable_jump_forward=False,
                                               disable_radix_cache=True, kv_cache_tokens=512, quantization="none")
    with pytest.raises(SystemExit):
        parser.parse_args(["--schedule-policy", "random"])


def test_serve_flags_are_the_config_fields():
    from radix_backend.server import add_serve_args

    args = add_serve_args(argparse.ArgumentParser()).parse_args(["--tp-size", "2", "--page-size", "8"])
    assert from_cli_args(args) == EngineConfig.from_env(tp_size=2, page_size=8)


def test_the_environment_is_read_in_one_place_and_checked():
    env = {"RADIX_BACKEND_QUANTIZATION": "none", "RADIX_BACKEND_NATIVE": "0", "RADIX_BACKEND_TRITON_OPS": "off",
           "RADIX_BACKEND_ACTIVATION_BITS": "16", "RADIX_TP_TIMEOUT_S": "12.5", "RADIX_TP_STARTUP_TIMEOUT_S": "60"}
    cfg = EngineConfig.from_env(env, page_size=4)
    assert (cfg.quantization, cfg.native_kernels, cfg.triton_ops, cfg.activation_bits) == ("none", False, False, 16)
    assert (cfg.tp_timeout_s, cfg.tp_startup_timeout_s, cfg.page_size) == (12.5, 60.0, 4)
    assert EngineConfig.from_env({}) == EngineConfig()
    with pytest.raises(ValueError, match="RADIX_BACKEND_NATIVE='maybe' is not a valid bool"):
        EngineConfig.from_env({"RADIX_BACKEND_NATIVE": "maybe"})
    with pytest.raises(ValueError, match="RADIX_BACKEND_ACTIVATION_BITS='eight' is not a valid int"):
        EngineConfig.from_env({"RADIX_BACKEND_ACTIVATION_BITS": "eight"})
    with pytest.raises(ValueError, match="activation_bits must be 8 or 16"):
        EngineConfig.from_env({"RADIX_BACKEND_ACTIVATION_BITS": "4"})


def test_nothing_below_the_config_reads_the_engine_knobs_from_the_environment():
    from pathlib import Path

    import radix_backend
    from radix_backend.config import ENV_KNOBS

    root = Path(radix_backend.__file__).parent
    sources = [p for d in (root, root.parent / "kernels", root.parent / "lang", root.parent / "adapters")
               for p in d.rglob("*.py") if p.name != "config.py"]
    for path in sources:
        text = path.read_text()
        for var in ENV_KNOBS.values():
            assert var not in text, f"{path.name} reads {var}; EngineConfig.from_env is the one reader"


def test_page_size_reaches_flashinfer_under_auto(monkeypatch):
    """`auto` resolving to FlashInfer must hand it the pool's page size, as naming it does."""
    import radix_backend.kernels.flashinfer_backend as fb

    made = []

    class Recorder:
        def __init__(self, device, page_size, **kwargs):
            made.append(page_size)

    monkeypatch.setattr(fb, "FlashInferAttentionBackend", Recorder)
    monkeypatch.setattr(registry, "available_backends", lambda device: ["torch", "triton", "flashinfer"])
    registry.create_attention_backend("auto", "cuda", page_size=16)
    registry.create_attention_backend("flashinfer", "cuda", page_size=4)
    assert made == [16, 4]
