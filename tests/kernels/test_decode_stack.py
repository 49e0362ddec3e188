"""The native 4-bit/8-bit matmuls and the one-call decode stack (kernels/csrc/decode_stack.c,
q8_matmul.c, thread_pool.c) against float64 references and against the per-layer path."""

from __future__ import annotations

import ctypes
import functools
import multiprocessing
import platform
import threading

import pytest
import torch

from radix_backend import Engine, SamplingParams
from radix_backend.kernels import decode_stack, native, q4, q8, quant, settings
from radix_backend.kernels.decode_stack import DecodeStack

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernels unavailable (no C compiler)")


def random_q4(n: int, k: int, seed: int) -> quant.Int4Codes:
    """Q4_1-style weights as a GGUF holds them: codes 0..15, fp16 scales and minimums."""
    gen = torch.Generator().manual_seed(seed)
    groups = (n, k // 32)
    return quant.Int4Codes(torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen),
                           (torch.rand(groups, generator=gen) * 0.01).half().float(),
                           (-torch.rand(groups, generator=gen) * 0.05).half().float(), exact=True)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def rounded_to_8_bits(x: torch.Tensor) -> torch.Tensor:
    """What the 8-bit activation format keeps of x: round(x * 127 / m) * (m / 127) per group of 32,
    m = max|x|, the rounding in fp32 as the kernel does it."""
    groups = x.float().view(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    return (torch.round(groups * (127 / amax)).double() * (amax / 127).double()).view(x.shape)


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 300])
@pytest.mark.parametrize("threads", [1, 2])
def test_q4_matmul_computes_with_the_exact_weights(rows, threads):
    q = random_q4(96, 320, seed=rows)
    bias = torch.randn(96)
    packed = q4.pack_q4(q.codes, q.scale, q.minimum, bias)
    x = torch.randn(rows, 320)
    weight = q.dequantize().double()
    want = x.double() @ weight.t() + bias.double()
    # 16-bit integer activations: ~1e-5 of the largest output; torch's bf16 int4 kernel is ~4e-3
    assert relative_error(q4.q4_matmul(x, packed, threads=threads), want) < 1e-4
    # 8-bit ones: the product of the rounded activations (up to fp32 summation and, rarely, a
    # rounding tie decided one step apart: 4e-4 here), which is ~1 % off the fp32 product at most
    got8 = q4.q4_matmul(x, packed, threads=threads, activation_bits=8)
    assert relative_error(got8, rounded_to_8_bits(x) @ weight.t() + bias.double()) < 1e-3
    assert relative_error(got8, want) < 2e-2
    with pytest.raises(ValueError, match="activation_bits"):
        q4.q4_matmul(x, packed, activation_bits=4)


@pytest.mark.parametrize("rows", [1, 3, 5, 16, 17, 300])
@pytest.mark.parametrize("threads", [1, 2])
def test_dense_fp32_matmul_is_the_fp32_product(rows, threads):
    """The fp32 reference path's native linears: any sizes (tails of the register tile and of
    the 16-lane vectors), the bias, fp32 sums within float rounding of the float64 product."""
    gen = torch.Generator().manual_seed(rows)
    weight, bias, x = torch.randn(37, 70, generator=gen), torch.randn(37, generator=gen), torch.randn(rows, 70, generator=gen)
    got = q4.q4_matmul(x, q4.DenseWeight(weight, bias), threads=threads)
    assert relative_error(got, x.double() @ weight.double().t() + bias.double()) < 1e-6
    with pytest.raises(ValueError, match="fp32"):
        q4.DenseWeight(weight.half(), None)


@pytest.mark.parametrize("threads", [1, 2])
def test_dense_fp32_rows_have_the_same_bits_alone_and_in_any_batch(threads):
    """The fixed-order fp32 matmul: a row's sum order depends on K alone, not on its register tile,
    its chunk of rows (800 rows span two chunks at K = 70) or the thread split."""
    gen = torch.Generator().manual_seed(5)
    weight, x = torch.randn(37, 70, generator=gen), torch.randn(800, 70, generator=gen)
    dense = q4.DenseWeight(weight, None)
    batch = q4.q4_matmul(x, dense, threads=threads)
    for at in (0, 5, 401, 799):
        assert torch.equal(q4.q4_matmul(x[at:at + 1], dense, threads=3 - threads), batch[at:at + 1])
    assert torch.equal(q4.q4_matmul(x[3:10], dense, threads=threads), batch[3:10])


@pytest.mark.parametrize("bits", [8, 16])
def test_int4_linear_takes_every_batch_in_the_configured_activation_bits(bits):
    """One activation format for every row count, so a row's output does not depend on how many
    rows came with it: bit for bit the same alone and in a batch."""
    q = random_q4(64, 128, seed=3)
    layer = quant.Int4Linear(q, dense_dtype=torch.bfloat16)
    assert layer.native_q4 is not None and layer.dense_weight is None  # no dense copy beside the codes
    weight = q.dequantize().double()
    x = torch.randn(40, 128)
    with settings.overridden(activation_bits=bits):
        batch = layer(x)
        want = (rounded_to_8_bits(x) if bits == 8 else x.double()) @ weight.t()
        assert relative_error(batch, want) < (1e-3 if bits == 8 else 1e-4)
        for rows in (1, 3, 17):
            assert torch.equal(layer(x[:rows]), batch[:rows])
        assert layer(torch.randn(0, 128)).shape == (0, 64)  # an empty batch is an empty result, not an error


def test_q4_packing_refuses_what_it_cannot_keep_exactly():
    q = random_q4(16, 64, seed=0)
    assert q4.can_pack(q.codes, q.scale, q.minimum)
    with pytest.raises(ValueError, match="fp16-representable"):
        q4.pack_q4(q.codes, q.scale + 1e-9, q.minimum)
    odd = random_q4(24, 64, seed=1)  # 24 rows: not whole blocks of 16
    assert not q4.can_pack(odd.codes, odd.scale, odd.minimum)
    fine = random_q4(16, 64, seed=2)
    fine.scale = fine.scale + 1e-9  # scales finer than fp16
    layer = quant.Int4Linear(fine)  # such a layer keeps torch's int4 kernel
    assert layer.native_q4 is None and "torch int4pack" in layer.extra_repr()
    x = torch.randn(2, 64)
    assert relative_error(layer(x), x.double() @ fine.dequantize().double().t()) < 1e-2


def test_q8_0_codes_recover_q8_0_weights_and_the_matmul_is_exact_on_them():
    gen = torch.Generator().manual_seed(5)
    weight = q8.q8_0_codes(torch.randn(200, 96, generator=gen) * 0.05).dequantize()  # a Q8_0 tensor, dequantized
    packed = q8.q8_0_codes(weight)
    assert packed.exact and torch.equal(packed.dequantize(), weight)
    assert not q8.q8_0_codes(torch.randn(4, 64, generator=gen)).exact  # plain fp weights: a lossy choice
    for rows, threads in ((1, 1), (5, 2)):
        x = torch.randn(rows, 96, generator=gen)
        assert relative_error(q8.q8_matmul(x, packed, threads=threads), x.double() @ weight.double().t()) < 1e-4
    head = quant.Int8Linear(weight)
    assert head.native_q8 is not None
    x = torch.randn(2, 96, generator=gen)
    assert relative_error(head(x), x.double() @ weight.double().t()) < 1e-4


@pytest.mark.skipif(not q8.tiled_available(), reason="the tiled 8-bit kernel needs AVX512-VNNI")
@pytest.mark.parametrize("rows,threads", [(1, 1), (7, 2), (33, 2)])
def test_tiled_q8_matmul_is_the_row_kernel_on_many_rows(rows, threads):
    gen = torch.Generator().manual_seed(rows)
    packed = q8.q8_0_codes(torch.randn(80, 128, generator=gen) * 0.05)
    tiled = q8.tile(packed)
    weight = packed.dequantize().double()
    x = torch.randn(rows, 128, generator=gen) * 3
    assert relative_error(q8.q8_tiled_matmul(x, tiled, threads=threads), x.double() @ weight.t()) < 1e-4
    got8 = q8.q8_tiled_matmul(x, tiled, threads=threads, activation_bits=8)
    assert relative_error(got8, rounded_to_8_bits(x) @ weight.t()) < 1e-3
    assert q8.tile(q8.q8_0_codes(torch.randn(24, 64, generator=gen))) is None  # not whole blocks of 16


def test_q8_0_codes_match_gguf():
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    import numpy as np

    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(6)) * 0.05
    blocks = quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
    dequantized = torch.from_numpy(np.ascontiguousarray(quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)))
    assert q8.q8_0_codes(dequantized).exact


def test_concurrent_callers_share_the_pool_safely():
    """Two threads dispatching at once: one gets the pool, the other runs its loop itself."""
    q = random_q4(256, 576, seed=7)
    packed = q4.pack_q4(q.codes, q.scale, q.minimum)
    xs = [torch.randn(2, 576, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    want = [q4.q4_matmul(x, packed) for x in xs]
    errors: list[str] = []

    def worker(i: int) -> None:
        for _ in range(50):
            if not torch.equal(q4.q4_matmul(xs[i], packed, threads=2), want[i]):
                errors.append(f"thread {i}")
                return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a pool dispatch hung"
    assert not errors


def _child_matmul(queue) -> None:
    q = random_q4(64, 64, seed=8)
    packed = q4.pack_q4(q.codes, q.scale, q.minimum)
    x = torch.ones(1, 64)
    queue.put(q4.q4_matmul(x, packed, threads=2).tolist())


def test_a_forked_child_gets_a_fresh_pool():
    q = random_q4(64, 64, seed=8)
    packed = q4.pack_q4(q.codes, q.scale, q.minimum)
    want = q4.q4_matmul(torch.ones(1, 64), packed, threads=2).tolist()  # the parent's helpers exist now
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_matmul, args=(queue,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0, "the forked child hung or crashed using the pool"
    assert queue.get(timeout=5) == want


def _stack_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    run = DecodeStack.run

    def counting(self, embeddings, *args, **kwargs):
        calls.append(embeddings.shape[0])
        return run(self, embeddings, *args, **kwargs)

    monkeypatch.setattr(DecodeStack, "run", counting)
    return calls


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir", "tiny_mistral_window_dir", "tiny_gemma_dir",
                                     "tiny_gemma2_dir", "tiny_gemma3_dir", "tiny_phi4_dir", "tiny_granite_dir",
                                     "tiny_olmo2_dir"])
def test_stack_equals_the_per_layer_path(fixture, request, monkeypatch):
    """Same 4-bit weights, same native ops: one call for all layers gives the per-layer path's
    greedy tokens and logprobs, for one request and for a few at once, and fills the same cache
    (Qwen3: with its q/k norms per head; Mistral: a sliding window shorter than the context; Gemma:
    GeGLU and scaled embeddings; Gemma 2: soft-capped scores, local layers; Gemma 3: sandwich norms,
    q/k norms, local layers with their own window and RoPE base; Phi-4-mini: RoPE on 3/4 of each
    head; Granite: its multipliers; OLMo 2: no pre-norms, norms after attention and MLP, q/k norms
    over the whole projection)."""
    calls = _stack_calls(monkeypatch)
    params = SamplingParams(max_new_tokens=12, temperature=0, logprobs=True)
    prompts = ["The quick brown fox", "A radix tree stores", "Once upon a time " * 20]  # past both windows
    with Engine(str(request.getfixturevalue(fixture)), kv_cache_tokens=2048, quantization="int4") as eng:
        assert eng.runner.quantization.decode_stack and eng.runner.model.decode_stack is not None
        stacked = [eng.generate(p, params) for p in prompts] + eng.generate(prompts, params)
        assert calls and max(calls) > 1  # batch-1 and batch-3 decode steps went through the stack
        calls.clear()
        eng.runner.model.decode_stack = None
        eng.flush_cache()
        layered = [eng.generate(p, params) for p in prompts] + eng.generate(prompts, params)
        assert not calls
    for got, want in zip(stacked, layered):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in got.logprobs]),
                                   torch.tensor([lp.logprob for lp in want.logprobs]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_gemma3_dir"])
def test_the_stack_takes_the_final_norm_with_the_callers_bits(fixture, request, monkeypatch):
    """The stack applies the model's final add-and-norm itself (no Python and torch round per
    step): greedy tokens and logprobs bit for bit what the model's own norm after the stack gives,
    one request and several at once, with speculative rows (Gemma 3: its 1 + w weights)."""
    calls = _stack_calls(monkeypatch)
    params = SamplingParams(max_new_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    prompts = ["The quick brown fox", "A radix tree stores", "Once upon a time"]
    with Engine(str(request.getfixturevalue(fixture)), kv_cache_tokens=2048, quantization="int4") as eng:
        stack = eng.runner.model.decode_stack
        assert stack is not None and stack.final_norm is not None
        assert stack.final_norm.data_ptr() == eng.runner.model.norm.weight.data_ptr()
        fused = [eng.generate(p, params) for p in prompts] + eng.generate(prompts, params)
        assert calls and max(calls) > 1
        monkeypatch.setattr(stack, "final_norm", None)
        monkeypatch.setattr(stack._dims, "final_norm", None)  # the model's own norm after the stack
        eng.flush_cache()
        apart = [eng.generate(p, params) for p in prompts] + eng.generate(prompts, params)
    for got, want in zip(fused, apart):
        assert got.token_ids == want.token_ids
        assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in want.logprobs]
        assert [lp.top for lp in got.logprobs] == [lp.top for lp in want.logprobs]


def test_fp32_path_runs_its_dense_weights_in_the_stack(tiny_llama_dir, monkeypatch):
    """quantization='none' on the CPU: small decode steps take the stack on the fp32 weights as they
    are; tokens and logprobs as the torch layers give them."""
    calls = _stack_calls(monkeypatch)
    params = SamplingParams(max_new_tokens=12, temperature=0, logprobs=True)
    prompts = ["The quick brown fox", "A radix tree stores", "Once upon a time"]
    with Engine(str(tiny_llama_dir), kv_cache_tokens=2048, quantization="none", speculative=False) as eng:
        model = eng.runner.model
        assert eng.runner.quantization.decode_stack and model.decode_stack.dense
        assert model.decode_stack_limit() == 64  # batch-invariant: the same fixed-order matmul either way
        with settings.overridden(batch_invariant=False):
            assert model.decode_stack_limit() == 8  # else oneDNN's per-layer linears win past 8 rows
        assert model.decode_stack.layers[0].qkv.weight.data_ptr() == model.layers[0].self_attn.qkv_proj.weight.data_ptr()
        native_run = [eng.generate(p, params) for p in prompts] + eng.generate(prompts, params)
        assert calls and max(calls) == 3
        model.decode_stack = None
        eng.flush_cache()
        torch_run = [eng.generate(p, params) for p in prompts] + eng.generate(prompts, params)
    for got, want in zip(native_run, torch_run):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in got.logprobs]),
                                   torch.tensor([lp.logprob for lp in want.logprobs]), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_smollm2_decode_runs_the_stack_and_tracks_fp32(monkeypatch):
    """The embedded GGUF at batch 1: decode steps go through the stack, the cache gives the same
    tokens warm and cold, and the greedy tokens follow the fp32 engine on the same weights up to
    near ties: where they part, the fp32 engine rates our token within 0.5 nats of its own (8-bit
    activations tip such ties either way)."""
    calls = _stack_calls(monkeypatch)
    params = SamplingParams(max_new_tokens=24, temperature=0)
    prompts = ["Write a haiku about the sea.", "Explain what a radix tree is."]
    with Engine(kv_cache_tokens=4096, quantization="auto", speculative=False) as eng:
        assert eng.runner.quantization.mode == "gguf" and eng.runner.quantization.decode_stack
        prompt_ids = [eng.encode(eng.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]
        cold = [eng.generate(input_ids=ids, params=params).token_ids for ids in prompt_ids]
        warm = [eng.generate(input_ids=ids, params=params).token_ids for ids in prompt_ids]
    assert calls and set(calls) == {1}
    assert cold == warm
    with Engine(kv_cache_tokens=4096, quantization="none", speculative=False) as ref:
        fp32 = [ref.generate(input_ids=ids, params=params).token_ids for ids in prompt_ids]
        for ids, ours, theirs in zip(prompt_ids, cold, fp32):
            part = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            if part is None:
                continue
            mine, best = ref.score(ids + ours[:part], [[ours[part]], [theirs[part]]])
            assert best.token_logprobs[0] - mine.token_logprobs[0] < 0.5, (part, ours[part], theirs[part])



def test_speculative_rows_of_one_request_run_in_the_stack(monkeypatch):
    """A drafted request's verification rows are decode rows: at batch 1 the stack gets several
    rows per step, and the tokens are plain decoding's."""
    calls = _stack_calls(monkeypatch)
    prompt = "Repeat exactly: alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta alpha beta"
    params = SamplingParams(max_new_tokens=32, temperature=0)
    with Engine(kv_cache_tokens=4096, quantization="auto") as eng:
        assert eng.scheduler.speculative
        spec = eng.generate(prompt, params).token_ids
        eng.scheduler.set_speculative(False)
        eng.flush_cache()
        plain = eng.generate(prompt, params).token_ids
    assert spec == plain and max(calls) > 1


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set variants")
@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_other_instruction_sets_compute_the_same(tmp_path, march):
    """The CPU varies between machines: the AVX2-without-VNNI path (haswell) and the portable C
    path (x86-64) give this machine's results up to float summation order."""
    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in native.FLAGS)
    try:
        lib = native.declare(ctypes.CDLL(str(native.build(native._compiler(), tmp_path, flags))))
    except OSError as exc:  # built for a CPU feature this one lacks (haswell on a pre-AVX2 CPU)
        pytest.skip(f"cannot load the {march} build here: {exc}")
    assert lib.rb_q4_tile_rows() == {"haswell": 4, "x86-64": 1}[march]  # what the draft cost model prices
    q = random_q4(64, 192, seed=9)
    packed4 = q4.pack_q4(q.codes, q.scale, q.minimum, torch.randn(64))
    packed8 = q8.q8_0_codes(torch.randn(48, 192, generator=torch.Generator().manual_seed(10)))
    x = torch.randn(6, 192, generator=torch.Generator().manual_seed(11))
    got4, got8 = torch.empty(6, 64), torch.empty(6, 48)
    for bits in (16, 8):
        assert lib.rb_q4_matmul(ctypes.byref(packed4.as_struct()), x.data_ptr(), 6, got4.data_ptr(), 2, bits) == 0
        torch.testing.assert_close(got4, q4.q4_matmul(x, packed4, activation_bits=bits), rtol=1e-5, atol=1e-5)
    dense = q4.DenseWeight(torch.randn(21, 192, generator=torch.Generator().manual_seed(13)), torch.randn(21))
    got_dense = torch.empty(6, 21)
    assert lib.rb_q4_matmul(ctypes.byref(dense.as_struct()), x.data_ptr(), 6, got_dense.data_ptr(), 2, 16) == 0
    torch.testing.assert_close(got_dense, q4.q4_matmul(x, dense), rtol=1e-5, atol=1e-5)
    assert lib.rb_q8_matmul(ctypes.byref(packed8.as_struct()), x.data_ptr(), 6, got8.data_ptr(), 2) == 0
    torch.testing.assert_close(got8, q8.q8_matmul(x, packed8), rtol=1e-5, atol=1e-5)
    # extend attention, whose vector code is 16 floats wide with AVX-512 and 8 otherwise
    gen = torch.Generator().manual_seed(12)
    k_cache, v_cache = torch.randn(300, 2, 80, generator=gen), torch.randn(300, 2, 80, generator=gen)
    q = torch.randn(90, 6, 80, generator=gen)
    index_args = [torch.randperm(300, generator=gen)[:250], torch.tensor([0, 20]), torch.tensor([20, 70]),
                  torch.tensor([0, 100]), torch.tensor([100, 150])]
    got = torch.empty_like(q)
    assert lib.rb_extend_attention(*(t.data_ptr() for t in (q, k_cache, v_cache, *index_args)), 2, 2, 3, 80, 0.1, 1,
                                   got.data_ptr(), None, 2) == 0
    want, _ = native.extend_attention(q, k_cache, v_cache, *index_args, 0.1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # invariant decode rows, alone and in chunks that read a shared prefix once: the same bits in this build too
    kv_indices = torch.cat([torch.arange(200), torch.arange(150), torch.arange(200, 240), torch.arange(130), torch.arange(240, 290)])
    starts, lens = torch.tensor([0, 200, 390]), torch.tensor([200, 190, 180])
    q = torch.randn(3, 6, 80, generator=gen)
    sharing = native.KeySharing.find(kv_indices, starts.tolist(), lens.tolist())
    assert sharing is not None and sharing.shared.tolist() == [128]
    alone, together = torch.empty_like(q), torch.empty_like(q)
    for out, share in ((alone, None), (together, ctypes.byref(sharing.struct))):
        assert lib.rb_decode_attention_invariant(*(t.data_ptr() for t in (q, k_cache, v_cache, kv_indices, starts, lens)),
                                                 3, 2, 3, 80, 0.1, 0.0, share, out.data_ptr(), None, 2, 0) == 0
    assert torch.equal(alone, together)
    # bf16 products: vdpbf16ps where the CPU has it, two fp32 multiply-adds elsewhere: the same bits where
    # the build has fused multiply-adds (the softmax's exp polynomial uses them), else close
    same = torch.equal if march == "haswell" else functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-6)
    k_cache, v_cache, q = k_cache[..., :64].contiguous(), v_cache[..., :64].contiguous(), torch.randn(90, 6, 64, generator=gen)
    got = torch.empty_like(q)
    assert lib.rb_extend_attention_window(*(t.data_ptr() for t in (q, k_cache, v_cache, *index_args)), 2, 2, 3, 64,
                                          0.1, 1, 0, 0.0, got.data_ptr(), None, 2, 1) == 0
    want, _ = native.extend_attention(q, k_cache, v_cache, *index_args, 0.1, bf16=True)
    assert same(got, want) in (True, None)
    q = q[:3]
    got = torch.empty_like(q)
    assert lib.rb_decode_attention_invariant(*(t.data_ptr() for t in (q, k_cache, v_cache, kv_indices, starts, lens)),
                                             3, 2, 3, 64, 0.1, 0.0, ctypes.byref(sharing.struct), got.data_ptr(), None,
                                             2, 1) == 0
    want, _ = native.decode_attention(q, k_cache, v_cache, kv_indices, starts, lens, 0.1, invariant=True, bf16=True)
    assert same(got, want) in (True, None)
