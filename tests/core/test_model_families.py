"""Families beyond Llama (Gemma 1/2/3, mixtures of experts, OLMo 2): tiny random checkpoints through the
engine against HF transformers, with prompts longer than the sliding window, chunked and cached."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from radix_backend import Engine, SamplingParams

from conftest import TINY_GEMMA_WINDOW

FAMILIES = ["tiny_gemma_dir", "tiny_gemma2_dir", "tiny_gemma3_dir", "tiny_qwen2_moe_dir", "tiny_qwen3_moe_dir",
            "tiny_mixtral_dir", "tiny_olmo2_dir"]
PROMPTS = ["Hello, my name is", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25",
           "The quick brown fox jumps over the lazy dog. " * 4]
NEW = 10


def hf_reference(model_dir, prompt_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens and the log-softmax of its logits at each of their positions."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
    tokens = out[0, len(prompt_ids):].tolist()
    with torch.no_grad():
        logits = model(out).logits[0, len(prompt_ids) - 1:-1]
    return tokens, torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("fixture", FAMILIES)
def test_greedy_tokens_and_logprobs_match_hf(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    params = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=5)
    with Engine(str(model_dir), kv_cache_tokens=4096, device="cpu", dtype="float32") as engine:
        outs = engine.generate(PROMPTS, params)
        assert len(engine.encode(PROMPTS[-1])) > 2 * TINY_GEMMA_WINDOW
        for prompt, out in zip(PROMPTS, outs):
            tokens, logprobs = hf_reference(model_dir, engine.encode(prompt))
            assert out.token_ids == tokens, prompt
            for step, lp in enumerate(out.logprobs):
                top_ids = [t for t, _ in lp.top]
                got = torch.tensor([lp.logprob] + [v for _, v in lp.top])
                want = logprobs[step, [tokens[step]] + top_ids]
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        again = engine.generate(PROMPTS, params)  # the prompts are now cached: same tokens
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]
        assert all(o.meta.cached_tokens > 0 for o in again)


@pytest.mark.parametrize("fixture", ["tiny_gemma2_dir", "tiny_gemma3_dir", "tiny_mixtral_dir", "tiny_qwen2_moe_dir",
                                     "tiny_olmo2_dir"])
def test_chunked_prefill_and_a_cached_prefix_past_the_window_give_the_cold_tokens(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    prompt = PROMPTS[-1]
    params = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
    with Engine(str(model_dir), kv_cache_tokens=4096, device="cpu", dtype="float32") as engine:
        cold = engine.generate([prompt, prompt + " And then"], params)
    with Engine(str(model_dir), kv_cache_tokens=4096, device="cpu", dtype="float32",
                chunked_prefill_tokens=20) as chunked:
        assert chunked.generate(prompt, params).token_ids == cold[0].token_ids
        warm = chunked.generate(prompt + " And then", params)  # extends a cached prefix > window
        assert warm.meta.cached_tokens > 32  # longer than the windows (16, 32)
        assert warm.token_ids == cold[1].token_ids


def test_gemma_configs_refuse_what_is_not_implemented():
    from transformers import Gemma2Config, Gemma3TextConfig

    from radix_backend.errors import ModelLoadError
    from radix_backend.models.config_check import check_model_config

    check_model_config(Gemma2Config())
    check_model_config(Gemma3TextConfig())
    with pytest.raises(ModelLoadError, match="hidden_act='gelu'"):
        check_model_config(Gemma2Config(hidden_activation="gelu"))
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        check_model_config(Gemma3TextConfig(use_bidirectional_attention=True))
    yarn = Gemma3TextConfig(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                             "full_attention": {"rope_type": "yarn", "factor": 4.0,
                                                                "rope_theta": 1e6}})
    with pytest.raises(ModelLoadError, match="rope_type='yarn'"):
        check_model_config(yarn)


def test_moe_experts_load_from_the_stacked_layout_too(tiny_qwen3_moe_dir, tmp_path):
    """transformers 5 holds experts stacked ([E, 2I, H] gate|up, [E, H, I] down); a checkpoint saved
    that way gives the same tokens as the published per-expert one, and one missing an expert is
    refused by name."""
    import shutil

    from safetensors.torch import load_file, save_file

    from radix_backend.errors import ModelLoadError

    tensors = load_file(str(tiny_qwen3_moe_dir / "model.safetensors"))
    stacked = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(2):
        part = lambda e, proj: tensors[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"]  # noqa: E731
        stacked[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([part(e, "gate_proj"), part(e, "up_proj")]) for e in range(8)])
        stacked[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([part(e, "down_proj") for e in range(8)])
    shutil.copytree(tiny_qwen3_moe_dir, tmp_path / "stacked")
    save_file(stacked, str(tmp_path / "stacked" / "model.safetensors"), metadata={"format": "pt"})
    params = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
    with Engine(str(tiny_qwen3_moe_dir), kv_cache_tokens=1024, device="cpu", dtype="float32") as engine:
        want = engine.generate(PROMPTS, params)
    with Engine(str(tmp_path / "stacked"), kv_cache_tokens=1024, device="cpu", dtype="float32") as engine:
        assert [o.token_ids for o in engine.generate(PROMPTS, params)] == [o.token_ids for o in want]
    shutil.copytree(tiny_qwen3_moe_dir, tmp_path / "short")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "short" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises((ModelLoadError, ValueError), match="experts.gate_up_proj\\[5\\]"):
        Engine(str(tmp_path / "short"), kv_cache_tokens=1024, device="cpu", dtype="float32")


# What llama.cpp's files cannot say, set in the checkpoint they are compared with: Gemma is scaled
# by the head size (llama.cpp keeps no `query_pre_attn_scalar`), a llama (Mixtral) file has no window.
GGUF_CHECKPOINT_CHANGES = {
    "tiny_gemma2_dir": lambda config: {"query_pre_attn_scalar": config["head_dim"]},
    "tiny_gemma3_dir": lambda config: {"query_pre_attn_scalar": config["head_dim"]},
    "tiny_qwen2_moe_dir": lambda config: {}, "tiny_qwen3_moe_dir": lambda config: {},
    "tiny_mixtral_dir": lambda config: {"sliding_window": None},
    "tiny_gemma_dir": lambda config: {}, "tiny_olmo2_dir": lambda config: {},
}


@pytest.mark.parametrize("fixture", sorted(GGUF_CHECKPOINT_CHANGES))
def test_gguf_files_of_each_family_run_in_their_own_types(fixture, request, tmp_path):
    """The checkpoint written as llama.cpp's converter writes a GGUF (Gemma's 1 + w norms and window
    pattern, experts stacked per layer, Mixtral as a llama file with experts): in F32 it gives the
    checkpoint's tokens on the native GGUF path and on the fp32 reference path; in Q8_0 it runs on
    the native low-bit kernels (every expert too), cached == uncached."""
    import json
    import shutil

    from gguf_files import hf_to_gguf

    model_dir = tmp_path / "hf"
    shutil.copytree(request.getfixturevalue(fixture), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **GGUF_CHECKPOINT_CHANGES[fixture](config)}))
    params = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
    with Engine(str(model_dir), kv_cache_tokens=2048, device="cpu", dtype="float32") as engine:
        ids = [engine.encode(p) for p in PROMPTS]  # transformers reads a Gemma GGUF's BPE vocabulary its own way
        want = [o.token_ids for o in engine.generate(input_ids=ids, params=params)]
    f32 = hf_to_gguf(model_dir, tmp_path / "f32.gguf", "F32")
    with Engine(str(f32), kv_cache_tokens=2048, device="cpu", quantization="auto") as engine:
        assert engine.runner.quantization.mode == "gguf", engine.runner.quantization.reason
        assert [o.token_ids for o in engine.generate(input_ids=ids, params=params)] == want
    with Engine(str(f32), kv_cache_tokens=2048, device="cpu", quantization="none") as engine:  # fp32 reference
        assert [o.token_ids for o in engine.generate(input_ids=ids, params=params)] == want
    q8 = hf_to_gguf(model_dir, tmp_path / "q8.gguf", "Q8_0")
    with Engine(str(q8), kv_cache_tokens=2048, device="cpu", quantization="auto") as engine:
        assert "native low-bit" in engine.runner.quantization.kernels["Q8_0"]
        sparse = [layer.mlp for layer in engine.runner.model.layers if hasattr(layer.mlp, "experts")]
        assert bool(sparse) == ("moe" in fixture or "mixtral" in fixture)
        if sparse:
            assert sparse[0].experts.gate_up_linears[0].kernels == [("Q8_0", "native low-bit")] * 2
        first = [o.token_ids for o in engine.generate(input_ids=ids, params=params)]
        assert [o.token_ids for o in engine.generate(input_ids=ids, params=params)] == first


@pytest.mark.parametrize("fixture", ["tiny_gemma_dir", "tiny_olmo2_dir"])
def test_gguf_attention_biases_the_family_has_not_are_refused_by_name(fixture, request, tmp_path):
    """A Gemma or OLMo 2 file carrying attention biases (neither family has them, so nothing would
    add them) is refused before any weight is read, not run without them."""
    import shutil

    from gguf_files import hf_to_gguf
    from safetensors.torch import load_file, save_file

    from radix_backend.errors import ModelLoadError

    model_dir = tmp_path / "hf"
    shutil.copytree(request.getfixturevalue(fixture), model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    width = tensors["model.layers.0.self_attn.q_proj.weight"].shape[0]
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.full((width,), 0.5)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    path = hf_to_gguf(model_dir, tmp_path / "biased.gguf", "F32")
    with pytest.raises(ModelLoadError, match="attention biases"):
        Engine(str(path), kv_cache_tokens=1024, device="cpu")


@pytest.mark.parametrize("fixture", ["tiny_qwen3_moe_dir", "tiny_qwen2_moe_dir", "tiny_mixtral_dir", "tiny_gemma2_dir",
                                     "tiny_gemma3_dir", "tiny_gemma_dir", "tiny_olmo2_dir"])
def test_decode_steps_run_the_native_stack_with_the_per_layer_bits(fixture, request, tmp_path, monkeypatch):
    """A quantized file of a family beyond Llama: small decode steps run every layer in one native
    call (an MoE's router and picked experts included, kernels/csrc/moe.c, and Qwen2-MoE's
    sigmoid-gated shared expert beside a dense layer; Gemma 2's soft-capped scores; Gemma 2/3's
    sandwich norms, GeGLU and windowed local layers) and give the per-layer path's tokens and
    logprobs, one request at a time and two at once, past the sliding window."""
    import json
    import shutil

    from gguf_files import hf_to_gguf

    from radix_backend.kernels.decode_stack import DecodeStack

    model_dir = tmp_path / "hf"
    shutil.copytree(request.getfixturevalue(fixture), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **GGUF_CHECKPOINT_CHANGES[fixture](config)}))
    path = hf_to_gguf(model_dir, tmp_path / "q4_0.gguf", "Q4_0")
    calls: list[int] = []
    run = DecodeStack.run
    monkeypatch.setattr(DecodeStack, "run", lambda self, x, *a, **k: calls.append(x.shape[0]) or run(self, x, *a, **k))
    params = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True, logprobs=True)
    with Engine(str(path), kv_cache_tokens=2048, device="cpu", quantization="auto", speculative=False) as engine:
        model = engine.runner.model
        assert engine.runner.quantization.decode_stack and model.decode_stack is not None
        routed = [layer.moe for layer in model.decode_stack.layers if layer.moe is not None]
        moe = "moe" in fixture or "mixtral" in fixture
        assert len(routed) == {"tiny_qwen2_moe_dir": 2}.get(fixture, len(model.layers) if moe else 0)
        assert all((block.shared is not None) == ("qwen2_moe" in fixture) for block in routed)
        ids = [engine.encode(p) for p in PROMPTS[:2]]
        stacked = [engine.generate(input_ids=i, params=params) for i in ids] + engine.generate(input_ids=ids,
                                                                                               params=params)
        assert calls and max(calls) == 2
        model.decode_stack = None
        engine.flush_cache()
        layered = [engine.generate(input_ids=i, params=params) for i in ids] + engine.generate(input_ids=ids,
                                                                                               params=params)
    for got, want in zip(stacked, layered):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in got.logprobs]),
                                   torch.tensor([lp.logprob for lp in want.logprobs]), atol=1e-5, rtol=1e-5)
