"""`attention_dtype`: the native attention kernels' products in fp32 or in bf16 pairs.

auto picks bf16 for a model whose linears run low-bit (their activations are 8- or 16-bit already)
on a CPU with native bf16, read from the CPU's flags, never timed; an explicit choice is honoured
or refused by name. Bit-for-bit batch invariance with bf16 products is checked in
test_batch_invariance.py, the kernels themselves in tests/kernels."""

from __future__ import annotations

import pytest
import torch

from radix_backend import Engine, SamplingParams
from radix_backend.bench.invariance import recording_step_logits
from radix_backend.kernels import native, quant

pytestmark = pytest.mark.skipif(not native.available(), reason="bf16 products are the native CPU kernels'")

PROMPTS = ["The capital of France is", "Write a Python function that reverses a string.", "List three primary colors:",
           "Explain photosynthesis in one sentence.", "Once upon a time, in a small village,", "What is 12 times 7?",
           "Translate 'good morning' into Spanish.", "The quick brown fox"]


@pytest.mark.parametrize("cpu_has_bf16", [True, False])
def test_auto_follows_the_cpus_flags_for_low_bit_models(monkeypatch: pytest.MonkeyPatch, cpu_has_bf16: bool) -> None:
    monkeypatch.setattr(quant, "has_native_bf16", lambda cpuinfo=None: cpu_has_bf16)
    with Engine(quantization="auto", kv_cache_tokens=256) as eng:  # the embedded GGUF in its low-bit types
        assert eng.kernel_path.attention_bf16 is cpu_has_bf16


def test_fp_checkpoints_keep_fp32_products_unless_asked(tiny_qwen3_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant, "has_native_bf16", lambda cpuinfo=None: True)
    common = dict(device="cpu", dtype="float32", kv_cache_tokens=256)
    with Engine(str(tiny_qwen3_dir), **common) as eng:
        assert not eng.kernel_path.attention_bf16
    with Engine(str(tiny_qwen3_dir), attention_dtype="bf16", **common) as eng:  # head size 32
        assert eng.kernel_path.attention_bf16
        assert len(eng.generate("Hello there", SamplingParams(max_new_tokens=4, temperature=0)).token_ids) == 4


def test_float_gguf_files_keep_fp32_products(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF of F32/F16 tensors runs no low-bit linear: auto keeps fp32 products and an fp32 pool,
    as for an fp checkpoint (a quantized file of the same model takes bf16 on such a CPU)."""
    from gguf_files import ModelSpec, write_model

    monkeypatch.setattr(quant, "has_native_bf16", lambda cpuinfo=None: True)
    floats = {name: "F32" for name in ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output",
                                       "ffn_gate", "ffn_up", "ffn_down")} | {"ffn_up": "F16"}
    for types, bf16 in ((floats, False), ({}, True)):  # {}: the matrices in Q8_0
        path = write_model(tmp_path / f"m{int(bf16)}.gguf", ModelSpec(hidden=256, heads=4, kv_heads=2, types=types))
        with Engine(str(path), quantization="auto", kv_cache_tokens=256) as eng:
            assert eng.runner.quantization.low_bit is bf16
            assert eng.kernel_path.attention_bf16 is bf16
            assert eng.kernel_path.kv_dtype == ("bfloat16" if bf16 else "float32")


def test_bf16_products_are_refused_where_the_kernels_cannot_run_them(tiny_llama_dir, tiny_qwen3_dir) -> None:
    common = dict(device="cpu", dtype="float32", kv_cache_tokens=256, attention_dtype="bf16")
    with pytest.raises(ValueError, match=r"attention_dtype='bf16'.*head size 16"):
        Engine(str(tiny_llama_dir), **common)
    with pytest.raises(ValueError, match=r"attention_dtype='bf16'.*runs torch attention"):
        Engine(str(tiny_qwen3_dir), attention_backend="torch", **common)


@pytest.mark.slow
def test_bf16_products_stay_close_to_fp32_products_on_smollm2() -> None:
    """With 16-bit activations (so that the attention products are the main difference) the greedy
    tokens on eight prompts and the first step's logits against fp32 products: measured 8/8 prompts
    equal over 16 tokens and a largest logit difference of 0.43 (logits up to ~25); the default
    8-bit activations alone move the logits by ~1.0 from the fp32 reference."""
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    runs = {}
    for attention in ("fp32", "bf16"):
        with Engine(quantization="auto", attention_dtype=attention, activation_bits=16, speculative=False) as eng, \
                recording_step_logits() as seen:
            tokens = [eng.generate(p, params).token_ids for p in PROMPTS]
            runs[attention] = tokens, [steps[0] for steps in seen.values()]
    (fp32_tokens, fp32_logits), (bf16_tokens, bf16_logits) = runs["fp32"], runs["bf16"]
    assert sum(a == b for a, b in zip(fp32_tokens, bf16_tokens)) >= 6
    assert max(float((a - b).abs().max()) for a, b in zip(fp32_logits, bf16_logits)) < 1.0
    assert any(not torch.equal(a, b) for a, b in zip(fp32_logits, bf16_logits))  # the products did change


@pytest.mark.slow
def test_a_bf16_pool_gives_the_bits_of_an_fp32_pool_on_smollm2() -> None:
    """kv_cache_dtype auto stores bf16 rows where the products are bf16: every step's logits of a
    batch (decode stack, shared-prefix chunks, a cached prefix on the second pass) are the bits of
    the same engine over an fp32 pool, at half the pool's bytes."""
    attention = "auto" if quant.has_native_bf16() else "bf16"  # emulated pairs elsewhere: the same bits
    prompts = PROMPTS + [PROMPTS[0] + " a city of", PROMPTS[4] + " there lived"]
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    runs = {}
    for kv in ("fp32", "auto"):
        with Engine(quantization="auto", attention_dtype=attention, kv_cache_dtype=kv, kv_cache_tokens=4096,
                    speculative=False) as eng, recording_step_logits() as seen:
            assert eng.kernel_path.kv_dtype == ("float32" if kv == "fp32" else "bfloat16")
            outs = eng.generate(prompts, params) + eng.generate(prompts[:3], params)  # the second pass: cached
            runs[kv] = [(o.token_ids, seen[o.request_id]) for o in outs], eng.runner.kv_pool.size_bytes()
    (fp32_outs, fp32_bytes), (bf16_outs, bf16_bytes) = runs["fp32"], runs["auto"]
    assert bf16_bytes * 2 == fp32_bytes
    for (tokens_a, logits_a), (tokens_b, logits_b) in zip(fp32_outs, bf16_outs):
        assert tokens_a == tokens_b and len(logits_a) == len(logits_b) == 12
        assert all(torch.equal(a, b) for a, b in zip(logits_a, logits_b))


def test_kv_cache_dtype_bf16_needs_bf16_products(tiny_qwen3_dir) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype='bf16' needs bf16 attention products"):
        Engine(str(tiny_qwen3_dir), device="cpu", dtype="float32", kv_cache_tokens=256, kv_cache_dtype="bf16")
