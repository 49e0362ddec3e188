"""Weight-only quantized path: exact recovery of GGUF Q4_1 codes, kernel agreement with fp32, and
the quantized engine on SmolLM2 against the fp32 engine on the same (dequantized) weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radix_backend.kernels import native, q8, quant
from radix_backend.model_executor.quantize import quantize_model


def gguf_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """What a Q4_1 GGUF holds for `weight`, dequantized by gguf-py (as the loader does)."""
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    blocks = quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_1)
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_1)))


def test_q4_1_codes_recover_gguf_weights_exactly():
    weight = gguf_q4_1(torch.randn(96, 128, generator=torch.Generator().manual_seed(0)) * 0.05)
    codes = quant.q4_1_codes(weight)
    assert codes.exact
    assert torch.equal(codes.dequantize(), weight)
    assert int(codes.codes.min()) >= 0 and int(codes.codes.max()) <= 15


def test_q4_1_codes_of_plain_weights_are_not_exact():
    codes = quant.q4_1_codes(torch.randn(8, 64, generator=torch.Generator().manual_seed(1)))
    assert not codes.exact
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.q4_1_codes(torch.randn(4, 40))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("batch", [1, 5, 32])
def test_int4_linear_matches_fp32_on_the_same_weights(batch):
    gen = torch.Generator().manual_seed(2)
    weight = gguf_q4_1(torch.randn(320, 256, generator=gen) * 0.05)
    bias = torch.randn(320, generator=gen)
    layer = quant.Int4Linear(quant.q4_1_codes(weight), bias)
    x = torch.randn(batch, 256, generator=gen)
    # bf16 activations and bf16 scale/zero: ~0.5% relative error is the kernel's precision
    assert relative_error(layer(x), x @ weight.t() + bias) < 1e-2
    assert layer(x).dtype == torch.float32 and layer(x[None]).shape == (1, batch, 320)


def test_int8_linear_matches_fp32():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 96, generator=gen)
    x = torch.randn(7, 96, generator=gen)
    assert relative_error(quant.Int8Linear(weight)(x), x @ weight.t()) < 1e-2


def test_auto_leaves_fp_checkpoints_and_non_cpu_setups_alone(tiny_llama_dir):
    from radix_backend.model_executor.loader import iter_weights, resolve_checkpoint
    from radix_backend.models import build_model

    ckpt = resolve_checkpoint(str(tiny_llama_dir))
    model = build_model(ckpt.config, iter_weights(ckpt), torch.float32, torch.device("cpu"))
    report = quantize_model(model, "auto", from_gguf=False, device=torch.device("cpu"), dtype=torch.float32)
    assert report.mode == "none" and "fp checkpoint" in report.reason
    report = quantize_model(model, "auto", from_gguf=True, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert report.mode == "none" and "fp32" in report.reason
    with pytest.raises(ValueError, match="CPU kernels"):
        quantize_model(model, "int4", from_gguf=True, device=torch.device("meta"), dtype=torch.float32)
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(model, "int3", from_gguf=True, device=torch.device("cpu"), dtype=torch.float32)


# relative logit error bounds on the random-weight model: 4-bit round-to-nearest of Gaussian
# weights is lossy (measured ~0.22); per-row int8 is not (measured below 0.05)
@pytest.mark.parametrize("mode,bound", [("int4", 0.35), ("int8", 0.05)])
def test_explicit_modes_quantize_an_fp_checkpoint(tiny_llama_dir, mode, bound):
    from radix_backend.engine import Engine

    with Engine(str(tiny_llama_dir), kv_cache_tokens=1024, quantization=mode) as eng, \
            Engine(str(tiny_llama_dir), kv_cache_tokens=1024, quantization="none") as ref:
        report = eng.runner.quantization
        assert report.mode == mode and report.layers == 4 * eng.runner.config.num_hidden_layers
        assert not report.lossless  # random fp weights are not 4-bit: int4 here is a lossy choice
        ids = eng.encode("The quick brown fox jumps over the lazy dog")
        assert relative_error(eng.next_token_logits(ids), ref.next_token_logits(ids)) < bound


@pytest.mark.slow
def test_smollm2_auto_runs_the_gguf_weights_in_their_own_types():
    """The embedded GGUF's linears are Q4_1 and its head Q8_0: auto runs them as they are on the
    native kernels (never decided by timing); the engine tracks the fp32 engine on the same
    dequantized weights, and cached == uncached. Attention multiplies in fp32 here: the weights'
    path is what is checked (bf16 attention products: test_attention_dtype.py)."""
    from radix_backend.engine import Engine
    from radix_backend.sampling_params import SamplingParams

    prompts = ["What is the capital of France?", "Write a haiku about the sea.",
               "List three prime numbers.", "Explain what a radix tree is."]
    params = SamplingParams(max_new_tokens=24, temperature=0)
    with Engine(kv_cache_tokens=8192, quantization="auto", attention_dtype="fp32") as eng, \
            Engine(kv_cache_tokens=8192) as ref:
        report = eng.runner.quantization
        if not native.available():
            pytest.skip("the native kernels do not build here")
        assert report.mode == "gguf" and report.lossless and report.layers == 211
        assert set(report.kernels) == {"Q4_1", "Q8_0"} and report.kernels["Q4_1"] == {"native low-bit": 210}
        assert report.decode_stack
        assert report.weight_bytes * 4 < ref.runner.quantization.weight_bytes  # fp32 reads >4x the bytes
        for prompt in prompts:
            ids = eng.encode(eng.apply_chat_template([{"role": "user", "content": prompt}]))
            got, want = eng.next_token_logits(ids), ref.next_token_logits(ids)
            # 8-bit activations through 30 layers: measured 5.3 % on the first prompt (BENCHMARKS.md)
            assert relative_error(got, want) < 0.1
        msgs = [[{"role": "user", "content": p}] for p in prompts]
        cold = [o.token_ids for o in eng.generate(messages=msgs, params=params)]
        warm = [o.token_ids for o in eng.generate(messages=msgs, params=params)]
        assert eng.cache_stats().cached_tokens > 0
        assert cold == warm
        fp32 = [o.token_ids for o in ref.generate(messages=msgs, params=params)]
        agree = sum(a == b for x, y in zip(cold, fp32) for a, b in zip(x, y)) / sum(map(len, fp32))
        assert agree > 0.5  # greedy agreement with fp32 is measured on the workloads (BENCHMARKS.md)
        if eng.runner.model.layers[0].mlp.down_proj.native_q4 is not None:
            # 16-bit activations everywhere: the GGUF's own weights at fp32 accuracy, fp32's tokens
            with Engine(kv_cache_tokens=8192, quantization="auto", activation_bits=16, attention_dtype="fp32") as exact:
                assert exact.kernel_path.activation_bits == 16 and eng.kernel_path.activation_bits == 8
                assert relative_error(exact.next_token_logits(ids), ref.next_token_logits(ids)) < 1e-3
                assert [o.token_ids for o in exact.generate(messages=msgs, params=params)] == fp32


@pytest.mark.parametrize("dense_dtype,bound", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_large_batches_run_a_dense_copy_of_the_same_weights_without_native_kernels(dense_dtype, bound):
    gen = torch.Generator().manual_seed(4)
    weight = gguf_q4_1(torch.randn(64, 96, generator=gen) * 0.05)
    layer = quant.Int4Linear(quant.q4_1_codes(weight), dense_dtype=dense_dtype, use_native=False)
    big = torch.randn(layer.small_batch_rows + 1, 96, generator=gen)
    assert relative_error(layer(big), big @ weight.t()) < bound  # dense path: the GGUF's weights
    small = big[:layer.small_batch_rows]
    assert relative_error(layer(small), small @ weight.t()) < 1e-2  # low-bit kernel path
    head = quant.Int8Linear(weight, dense_dtype=dense_dtype, use_native=False)
    assert relative_error(head(big), big @ head.dense_weight.float().t()) < bound


@pytest.mark.skipif(not native.available(), reason="native CPU kernels unavailable (no C compiler)")
def test_native_kernels_serve_large_batches_without_a_dense_copy():
    gen = torch.Generator().manual_seed(4)
    weight = gguf_q4_1(torch.randn(64, 96, generator=gen) * 0.05)
    layer = quant.Int4Linear(quant.q4_1_codes(weight), dense_dtype=torch.bfloat16)
    assert layer.dense_weight is None
    big = torch.randn(40, 96, generator=gen)
    assert relative_error(layer(big), big @ weight.t()) < 2e-2  # 8-bit activations (test_decode_stack.py)
    head = quant.Int8Linear(weight, dense_dtype=torch.bfloat16)
    if head.native_q8_tiled is None:
        pytest.skip("the tiled 8-bit head needs AVX512-VNNI")
    assert head.dense_weight is None and "tiled" in head.extra_repr()
    q8_weight = q8.q8_0_codes(weight).dequantize()  # the codes the head holds, tiled
    assert relative_error(head(big), big.double() @ q8_weight.double().t()) < 1e-4


def test_small_steps_off_the_main_thread_run_single_threaded_and_restore(tiny_llama_dir):
    import threading

    from radix_backend import Engine, SamplingParams

    seen: list[int] = []
    with Engine(str(tiny_llama_dir), kv_cache_tokens=1024) as eng:
        model_forward = eng.runner.model.forward

        def spy(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return model_forward(*args, **kwargs)

        eng.runner.model.forward = spy
        before = torch.get_num_threads()
        ids = eng.encode("one two three four five six seven eight nine ten")
        eng.generate(input_ids=ids, params=SamplingParams(max_new_tokens=3, temperature=0))
        assert torch.get_num_threads() == before
        assert threading.main_thread() is threading.current_thread()
    if before > 1:
        assert seen[0] == before and set(seen[1:]) == {1}  # prefill of 10 tokens: all threads; decode: one


def test_the_dense_dtype_follows_the_cpu_features_not_a_timing(monkeypatch):
    """bf16 only where the CPU computes it natively; no probe, so a busy machine cannot flip it."""
    for flags, want in (({"avx2", "avx512_bf16"}, torch.bfloat16), ({"avx2", "amx_bf16"}, torch.bfloat16),
                        ({"avx2", "avx512f"}, torch.float32), (set(), torch.float32)):
        monkeypatch.setattr(quant, "_cpu_flags", lambda flags=flags: flags)
        quant.dense_dtype_for_large_batches.cache_clear()
        assert quant.dense_dtype_for_large_batches() == want
    quant.dense_dtype_for_large_batches.cache_clear()
