"""The native CPU kernels (kernels/csrc/cpu_kernels.c) against the torch reference ops."""

from __future__ import annotations

import math
import platform
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from radix_backend import Engine, SamplingParams
from radix_backend.kernels import native, ops
from radix_backend.kernels.attention_base import AttentionMetadata
from radix_backend.kernels.native_backend import NativeCPUAttentionBackend, NativePlan

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernels unavailable (no C compiler)")


def reference_decode(q, k_cache, v_cache, slot_lists, scale):
    """softmax(q K^T) V per request and query head, in float64; returns (out, lse)."""
    hq, hkv = q.shape[1], k_cache.shape[1]
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
    for b, slots in enumerate(slot_lists):
        for h in range(hq):
            keys = k_cache[slots, h // (hq // hkv)].double()
            scores = keys @ q[b, h].double() * scale
            out[b, h] = (torch.softmax(scores, 0) @ v_cache[slots, h // (hq // hkv)].double()).float()
            lse[b, h] = torch.logsumexp(scores, 0).float()
    return out, lse


@pytest.mark.parametrize("hq,hkv,dim", [(9, 3, 64), (8, 8, 128), (4, 2, 40)])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_reads_the_pool_in_place(hq, hkv, dim, threads):
    gen = torch.Generator().manual_seed(hq + dim)
    k_cache, v_cache = torch.randn(600, hkv, dim, generator=gen), torch.randn(600, hkv, dim, generator=gen)
    lens = [1, 37, 250, 5]
    order = torch.randperm(599, generator=gen).add(1)  # scattered slots, as after evictions
    slot_lists, at = [], 0
    for n in lens:
        slot_lists.append(order[at:at + n])
        at += n
    kv_indices = torch.cat(slot_lists)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0)[:-1].tolist()])
    q = torch.randn(len(lens), hq, dim, generator=gen)
    scale = 1 / math.sqrt(dim)
    out, lse = native.decode_attention(q, k_cache, v_cache, kv_indices, starts, torch.tensor(lens), scale,
                                       with_lse=True, threads=threads)
    ref_out, ref_lse = reference_decode(q, k_cache, v_cache, slot_lists, scale)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lens,threads", [([1500], 2), ([1500], 4), ([700, 900], 4), ([300, 40], 4)])
def test_decode_attention_splits_long_requests_over_threads(lens, threads):
    """Fewer requests than threads: each long request's keys are attended in pieces on the pool's
    threads and merged by their log-sum-exps; the result is the one-piece result."""
    gen = torch.Generator().manual_seed(sum(lens))
    k_cache, v_cache = torch.randn(4000, 3, 64, generator=gen), torch.randn(4000, 3, 64, generator=gen)
    order = torch.randperm(3999, generator=gen).add(1)
    slot_lists = [order[sum(lens[:i]):sum(lens[:i + 1])] for i in range(len(lens))]
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))])
    q = torch.randn(len(lens), 9, 64, generator=gen)
    out, lse = native.decode_attention(q, k_cache, v_cache, torch.cat(slot_lists), starts, torch.tensor(lens), 0.125,
                                       with_lse=True, threads=threads)
    ref_out, ref_lse = reference_decode(q, k_cache, v_cache, slot_lists, 0.125)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_decode_attention_survives_extreme_scores():
    """Softmax after the max: large logits neither overflow nor underflow to NaN."""
    k_cache = torch.zeros(8, 1, 64)
    k_cache[1:4, 0, 0] = torch.tensor([300.0, -300.0, 299.0])
    v_cache = torch.arange(8 * 64, dtype=torch.float32).view(8, 1, 64)
    q = torch.zeros(1, 1, 64)
    q[0, 0, 0] = 1.0
    out, _ = native.decode_attention(q, k_cache, v_cache, torch.tensor([1, 2, 3]), torch.tensor([0]),
                                     torch.tensor([3]), 1.0)
    ref, _ = reference_decode(q, k_cache, v_cache, [torch.tensor([1, 2, 3])], 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-5)


def reference_extend(q, k_cache, v_cache, slot_lists, q_lens, scale, causal=True):
    """Per request and new token: softmax over its visible keys, in float64; returns (out, lse)."""
    hq, hkv = q.shape[1], k_cache.shape[1]
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
    row = 0
    for slots, n in zip(slot_lists, q_lens):
        for i in range(n):
            visible = slots[:len(slots) - n + i + 1] if causal else slots
            for h in range(hq):
                scores = k_cache[visible, h // (hq // hkv)].double() @ q[row, h].double() * scale
                out[row, h] = (torch.softmax(scores, 0) @ v_cache[visible, h // (hq // hkv)].double()).float()
                lse[row, h] = torch.logsumexp(scores, 0).float()
            row += 1
    return out, lse


def extend_case(hq, hkv, dim, q_lens, prefix_lens, seed=0):
    """Scattered pool slots (as after evictions) for ragged requests; returns the kernel's inputs."""
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    slots = sum(kv_lens) + 50
    k_cache, v_cache = torch.randn(slots, hkv, dim, generator=gen), torch.randn(slots, hkv, dim, generator=gen)
    order = torch.randperm(slots - 1, generator=gen).add(1)
    slot_lists = [order[sum(kv_lens[:i]):sum(kv_lens[:i + 1])] for i in range(len(kv_lens))]
    q = torch.randn(sum(q_lens), hq, dim, generator=gen)
    starts = lambda lens: torch.tensor([sum(lens[:i]) for i in range(len(lens))])  # noqa: E731
    return (q, k_cache, v_cache, torch.cat(slot_lists), starts(q_lens), torch.tensor(q_lens), starts(kv_lens),
            torch.tensor(kv_lens)), slot_lists


@pytest.mark.parametrize("hq,hkv,dim", [(9, 3, 64), (8, 8, 128), (4, 2, 80), (2, 1, 16), (10, 2, 32)])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_extend_attention_reads_the_pool_in_place(hq, hkv, dim, threads, causal):
    """Ragged new tokens (1 to 70, with and without a cached prefix) attend their own keys only,
    causally or not; tiles of query rows cut across heads and positions (5 heads a group: every
    tile has padding rows), blocks of keys end mid-way."""
    q_lens, prefix_lens = [3, 1, 70, 17], [100, 0, 5, 130]
    args, slot_lists = extend_case(hq, hkv, dim, q_lens, prefix_lens, seed=hq + dim)
    scale = 1 / math.sqrt(dim)
    out, lse = native.extend_attention(*args, scale, causal=causal, with_lse=True, threads=threads)
    ref_out, ref_lse = reference_extend(args[0], args[1], args[2], slot_lists, q_lens, scale, causal)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_extend_attention_survives_extreme_scores_and_rejects_odd_head_sizes():
    args, slot_lists = extend_case(3, 1, 64, [5], [40], seed=3)
    args[1][slot_lists[0][:3], 0, :] *= 200.0  # scores of several hundred, positive and negative
    out, _ = native.extend_attention(*args, 1.0)
    ref, _ = reference_extend(args[0], args[1], args[2], slot_lists, [5], 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-4)
    odd, _ = extend_case(3, 1, 40, [5], [40])
    with pytest.raises(ValueError, match="multiple of 16"):
        native.extend_attention(*odd, 1.0)


def test_backend_extends_natively_and_keeps_torch_for_other_head_sizes():
    """The native backend hands extends to the native kernel; a head size it cannot take (40)
    falls back to the torch path, with the same result."""
    for dim in (64, 40):
        args, slot_lists = extend_case(6, 2, dim, [4, 9], [30, 0], seed=dim)
        q, k_cache, v_cache, kv_indices = args[:4]
        out_slots = torch.cat([slots[-n:] for slots, n in zip(slot_lists, [4, 9])])
        meta = AttentionMetadata.build([30, 0], [4, 9], kv_indices, out_slots, "cpu")
        new_k, new_v = k_cache[out_slots].clone(), v_cache[out_slots].clone()
        backend = NativeCPUAttentionBackend()
        backend.begin_forward(meta)
        assert isinstance(backend._plan, NativePlan) and backend._plan.extend
        out = backend.forward(q, new_k, new_v, k_cache, v_cache, meta, 0.125)
        assert isinstance(backend._plan, NativePlan) == (dim == 64)
        ref, _ = reference_extend(q, k_cache, v_cache, slot_lists, [4, 9], 0.125)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def shared_prefix_case(hq, hkv, dim, q_lens, shared, own_prefix, seed=0):
    """Requests whose keys begin with the same `shared` scattered slots (branches of one prompt),
    then own_prefix[b] cached keys and q_lens[b] new ones of their own."""
    gen = torch.Generator().manual_seed(seed)
    slots = shared + sum(own_prefix) + sum(q_lens) + 50
    k_cache, v_cache = torch.randn(slots, hkv, dim, generator=gen), torch.randn(slots, hkv, dim, generator=gen)
    order = torch.randperm(slots, generator=gen)
    common, rest, slot_lists = order[:shared], order[shared:], []
    for extra, n in zip(own_prefix, q_lens):
        slot_lists.append(torch.cat([common, rest[:extra + n]]))
        rest = rest[extra + n:]
    kv_lens = [len(s) for s in slot_lists]
    q = torch.randn(sum(q_lens), hq, dim, generator=gen)
    starts = lambda lens: torch.tensor([sum(lens[:i]) for i in range(len(lens))])  # noqa: E731
    return (q, k_cache, v_cache, torch.cat(slot_lists), starts(q_lens), torch.tensor(q_lens), starts(kv_lens),
            torch.tensor(kv_lens)), slot_lists


@pytest.mark.parametrize("hq,hkv,dim", [(9, 3, 64), (8, 8, 64), (16, 2, 128)])
@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16 pool"])
def test_extend_rows_over_a_shared_prefix_keep_their_bits(hq, hkv, dim, mode):
    """Requests continuing one cached prompt (few new tokens each, one a long extend that keeps its
    own tiles, one behind extra cached keys of its own) attend the shared whole blocks in full tiles
    first: every row and log-sum-exp has the bits it gets without sharing and alone."""
    q_lens, own_prefix = [12, 1, 5, 90, 3, 12], [0, 0, 70, 0, 64, 1]
    args, _ = shared_prefix_case(hq, hkv, dim, q_lens, 1057, own_prefix, seed=dim)
    q, k_cache, v_cache, kv_indices, q_starts, ql, kv_starts, kv_lens = args
    if mode == "bf16 pool":
        k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    bf16 = mode != "fp32"
    sharing = native.KeySharing.find(kv_indices, kv_starts.tolist(), (kv_lens - ql).tolist(), max_members=len(q_lens))
    assert sharing is not None and int(sharing.shared.max()) == 1024
    pool = (q, k_cache, v_cache, kv_indices, q_starts, ql, kv_starts, kv_lens, 0.125)
    plain = native.extend_attention(*pool, with_lse=True, threads=2, bf16=bf16)
    shared = native.extend_attention(*pool, with_lse=True, threads=2, bf16=bf16, sharing=sharing)
    assert torch.equal(shared[0], plain[0]) and torch.equal(shared[1], plain[1])
    for b in range(len(q_lens)):
        rows = slice(int(q_starts[b]), int(q_starts[b]) + q_lens[b])
        keys = kv_indices[int(kv_starts[b]):int(kv_starts[b] + kv_lens[b])]
        alone = native.extend_attention(q[rows], k_cache, v_cache, keys, torch.tensor([0]), ql[b:b + 1],
                                        torch.tensor([0]), kv_lens[b:b + 1], 0.125, with_lse=True, bf16=bf16)
        assert torch.equal(shared[0][rows], alone[0]) and torch.equal(shared[1][rows], alone[1])


def test_extend_sharing_must_stay_inside_each_cached_prefix():
    """Shared keys reaching into a member's new tokens (which not all of its rows see) are refused."""
    args, _ = shared_prefix_case(3, 1, 64, [4, 4], 128, [0, 0])
    plain, _ = native.extend_attention(*args, 0.125)
    shared, _ = native.extend_attention(*args, 0.125, sharing=native.KeySharing([([0, 1], 64)]))
    assert torch.equal(shared, plain)
    with pytest.raises(ValueError, match="shared prefix"):
        native.extend_attention(*args, 0.125, sharing=native.KeySharing([([0, 1], 192)]))


def test_backend_shares_the_cached_prefix_of_an_extend():
    """The native backend finds the requests of an extend that continue one cached prompt and hands
    their sharing to the kernel; the output is the one each request gets alone."""
    q_lens, own_prefix = [6, 6, 2], [0, 3, 0]
    args, slot_lists = shared_prefix_case(9, 3, 64, q_lens, 200, own_prefix, seed=5)
    q, k_cache, v_cache, kv_indices = args[:4]
    prefix_lens = [200 + p for p in own_prefix]
    out_slots = torch.cat([slots[-n:] for slots, n in zip(slot_lists, q_lens)])
    meta = AttentionMetadata.build(prefix_lens, q_lens, kv_indices, out_slots, "cpu")
    new_k, new_v = k_cache[out_slots].clone(), v_cache[out_slots].clone()
    backend = NativeCPUAttentionBackend()
    backend.begin_forward(meta)
    assert isinstance(backend._plan, NativePlan) and backend._plan.extend
    assert backend._plan.sharing is not None and int(backend._plan.sharing.shared.max()) == 192
    out = backend.forward(q, new_k, new_v, k_cache, v_cache, meta, 0.125)
    alone, _ = native.extend_attention(*args, 0.125)
    assert torch.equal(out, alone)
    assert NativeCPUAttentionBackend(share_prefixes=False)._build_plan(meta).sharing is None


def test_norms_match_the_torch_ops():
    gen = torch.Generator().manual_seed(1)
    x, residual = torch.randn(5, 576, generator=gen), torch.randn(5, 576, generator=gen)
    weight = torch.rand(576, generator=gen) + 0.5
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_residual = ops.fused_add_rms_norm_torch(x, residual, weight, 1e-5)
    torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=2e-6)
    assert torch.equal(new_residual, ref_residual)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs untouched
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), ops.rms_norm_torch(x, weight, 1e-5),
                               atol=2e-6, rtol=2e-6)


def test_rope_on_views_of_a_fused_qkv_and_silu_match_the_torch_ops():
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(7, 9 * 64 + 2 * 3 * 64, generator=gen)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(7, 9, 64), k.view(7, 3, 64)
    positions = torch.tensor([0, 1, 5, 100, 2047, 3, 3])
    cache = ops.build_cos_sin_cache(ops.default_inv_freq(64), 2048)
    got_q, got_k = ops.apply_rotary(q, k, positions, cache)
    ref_q, ref_k = ops.apply_rotary_torch(q, k, positions, cache)
    torch.testing.assert_close(got_q, ref_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, ref_k, atol=1e-6, rtol=1e-6)
    partial = ops.build_cos_sin_cache(ops.default_inv_freq(32), 2048)  # rot_dim < head_dim: rest passes
    torch.testing.assert_close(ops.apply_rotary(q, k, positions, partial)[0],
                               ops.apply_rotary_torch(q, k, positions, partial)[0], atol=1e-6, rtol=1e-6)
    gate_up = torch.randn(4, 2 * 1536, generator=gen) * 4
    torch.testing.assert_close(ops.silu_and_mul(gate_up), ops.silu_and_mul_torch(gate_up), atol=1e-5, rtol=1e-5)
    gate, up = gate_up.chunk(2, dim=-1)  # Gemma's GeGLU: torch's tanh GELU, within fp32 rounding
    torch.testing.assert_close(ops.gelu_tanh_and_mul(gate_up), F.gelu(gate, approximate="tanh") * up,
                               atol=1e-5, rtol=1e-5)


def test_sigmoid_gated_add_is_torchs_sum():
    """Qwen2-MoE's shared expert added natively (the per-layer path and the decode stack share it):
    y + sigmoid(gate) * x within fp32 rounding of torch's, saturating gates included; shapes checked."""
    gen = torch.Generator().manual_seed(4)
    y, x = torch.randn(5, 96, generator=gen), torch.randn(5, 96, generator=gen)
    gate = torch.tensor([[-3.0], [0.0], [0.7], [40.0], [-120.0]])
    torch.testing.assert_close(native.sigmoid_gated_add(y, gate, x), y + torch.sigmoid(gate) * x, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="gate"):
        native.sigmoid_gated_add(y, gate[:4], x)


def test_bf16_tensors_keep_the_torch_path():
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    weight = torch.ones(64, dtype=torch.bfloat16)
    assert not native.supports(x, weight)
    assert torch.equal(ops.rms_norm(x, weight), ops.rms_norm_torch(x, weight))


def test_the_library_builds_from_source_once_and_loads(tmp_path):
    """What a fresh machine does on first use: compile into the cache dir, then reuse the file."""
    import ctypes

    compiler = native._compiler()
    built = native.build(compiler, tmp_path)
    assert built.parent == tmp_path and built.suffix == ".so"
    assert hasattr(ctypes.CDLL(str(built)), "rb_decode_attention")
    mtime = built.stat().st_mtime_ns
    assert native.build(compiler, tmp_path) == built and built.stat().st_mtime_ns == mtime  # cache hit
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no temporary files left
    assert built.stat().st_mode & 0o777 == 0o700


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not shutil.which("objdump"),
                    reason="reads x86 code with objdump")
@pytest.mark.parametrize("function", ["member_block", "q4_rows", "full_tile"])  # attention keys, next weight blocks
def test_the_kernels_fetch_what_they_read_next(function):
    """The prefetches are in the built code: GCC once judged the helper around a prefetch pure and
    deleted every call, so none ran, with no other symptom than the time."""
    built = native.library()._name  # the library this process loaded
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", built], capture_output=True, text=True,
                             check=True).stdout
    bodies = re.findall(rf"<{function}[^>]*>:\n(.*?)\n\n", listing, flags=re.S)
    assert bodies and any("prefetch" in body for body in bodies)


def test_a_library_others_could_have_planted_is_never_loaded(tmp_path):
    """Loading a library runs its code: the cached build must be this user's, writable by no one else."""
    compiler = native._compiler()
    shared = tmp_path / "shared"
    built = native.build(compiler, shared)
    built.chmod(0o766)  # group/others may write it: anyone could have swapped it
    with pytest.raises(RuntimeError, match="writable by others"):
        native.build(compiler, shared)
    built.chmod(0o700)
    shared.chmod(0o777)  # or swapped it within a shared directory
    with pytest.raises(RuntimeError, match="writable by others"):
        native.build(compiler, shared)
    shared.chmod(0o700)
    link_dir = tmp_path / "link"
    link_dir.symlink_to(shared)
    with pytest.raises(RuntimeError, match="not a plain directory"):
        native.build(compiler, link_dir)
    assert native.build(compiler, shared) == built


def test_the_build_key_names_the_cpu_on_every_architecture(monkeypatch, tmp_path):
    """An ARM /proc/cpuinfo has no "model name"/"flags" lines: its own lines key the build instead."""
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n"
    monkeypatch.setattr(native.Path, "read_text", lambda self, *a, **k: arm)
    identity = native._cpu_identity()
    assert "Features\t: fp asimd sve" in identity and "CPU part\t: 0xd40" in identity


def test_a_failing_compiler_is_reported(tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'cc: broken' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="broken"):
        native.build(str(fake), tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.so"))  # no half-written library left behind


def test_engine_tokens_and_logits_equal_with_and_without_native_kernels(tiny_llama_dir, monkeypatch):
    """The whole decode path (norms, RoPE, attention in place) on the tiny model, both ways."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8] * 5, [9, 10, 11] * 20, [1, 2, 3, 4, 5, 6, 7, 8] * 5 + [42]]
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=True)

    def run(native_kernels: bool) -> list:
        engine = Engine(str(tiny_llama_dir), kv_cache_tokens=2048, quantization="none", native_kernels=native_kernels)
        assert engine.kernel_path.attention == ("native" if native_kernels else "torch")
        assert engine.kernel_path.layer_ops == ("native" if native_kernels else "torch")
        try:
            outs = engine.generate(input_ids=prompts, params=params)
            return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]
        finally:
            engine.shutdown()

    with_native = run(True)
    without = run(False)
    for (tokens_a, logprobs_a), (tokens_b, logprobs_b) in zip(with_native, without):
        assert tokens_a == tokens_b
        torch.testing.assert_close(torch.tensor(logprobs_a), torch.tensor(logprobs_b), atol=1e-4, rtol=0)


def test_backend_plans_native_decode_only_for_decode_steps():
    meta = AttentionMetadata.build([10], [1], torch.arange(11), torch.tensor([10]), "cpu")
    backend = NativeCPUAttentionBackend()
    backend.begin_forward(meta)
    assert backend._plan.lens is not None and not backend._plan.extend
    extend = AttentionMetadata.build([10], [3], torch.arange(13), torch.tensor([10, 11, 12]), "cpu")
    backend.begin_forward(extend)
    assert backend._plan.lens is None and backend._plan.extend


def test_wrappers_refuse_what_would_make_the_c_code_read_or_write_out_of_bounds():
    """The C kernels trust their arguments; each wrapper checks shapes, dtypes and index ranges."""
    k, v, q = torch.randn(10, 2, 16), torch.randn(10, 2, 16), torch.randn(1, 4, 16)
    one = torch.tensor([0])
    good = dict(kv_indices=torch.tensor([1, 2, 3]), starts=one, lens=torch.tensor([3]), scale=0.25)
    native.decode_attention(q, k, v, **good)
    native.decode_attention(q, k, v, **(good | {"kv_indices": torch.tensor([1, 2, 3], dtype=torch.int32)}))  # converted
    native.decode_attention(q, k, v, **(good | {"starts": torch.tensor([99]), "lens": torch.tensor([0])}))  # padding
    for bad, match in [({"kv_indices": torch.tensor([1, 2, 10])}, "kv_indices"),
                       ({"kv_indices": torch.tensor([-1, 2, 3])}, "kv_indices"),
                       ({"lens": torch.tensor([4])}, "ranges"), ({"starts": torch.tensor([-1])}, "ranges"),
                       ({"starts": torch.tensor([0, 1])}, "starts"), ({"kv_indices": torch.tensor([1.0])}, "int")]:
        with pytest.raises(ValueError, match=match):
            native.decode_attention(q, k, v, **(good | bad))
    with pytest.raises(ValueError, match="does not fit"):
        native.decode_attention(torch.randn(1, 3, 16), k, v, **good)
    with pytest.raises(ValueError, match="fp32"):
        native.decode_attention(q.double(), k, v, **good)
    ext = dict(kv_indices=torch.tensor([1, 2, 3]), q_starts=one, q_lens=torch.tensor([1]), kv_starts=one,
               kv_lens=torch.tensor([3]), scale=0.25)
    native.extend_attention(q, k, v, **ext)
    for bad in ({"q_lens": torch.tensor([2])}, {"kv_lens": torch.tensor([4])}, {"kv_indices": torch.tensor([1, 2, 99])}):
        with pytest.raises(ValueError):
            native.extend_attention(q, k, v, **(ext | bad))
    cache = torch.randn(8, 16)
    native.rope(torch.randn(2, 2, 16), torch.tensor([0, 7]), cache)
    with pytest.raises(ValueError, match="positions"):
        native.rope(torch.randn(2, 2, 16), torch.tensor([0, 8]), cache)  # past the table
    with pytest.raises(ValueError, match="even rot"):
        native.rope(torch.randn(2, 2, 16), torch.tensor([0, 1]), torch.randn(8, 32))
    with pytest.raises(ValueError, match=r"\[\.\.\., 2d\]"):
        native.silu_and_mul(torch.randn(3, 7))  # an odd width wrote past the output
    with pytest.raises(ValueError, match="weight"):
        native.add_rms_norm(None, torch.randn(3, 8), torch.randn(7), 1e-6)


def test_quantized_matmuls_check_the_input_width():
    from radix_backend.kernels import q8

    packed = q8.q8_0_codes(torch.randn(16, 64))
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        q8.q8_matmul(torch.randn(2, 32), packed)


@pytest.mark.parametrize("hq,hkv,dim,keys", [(9, 3, 64, 1), (9, 3, 64, 130), (32, 8, 128, 300), (4, 4, 96, 77),
                                             (8, 1, 256, 700), (9, 3, 64, 63)])
@pytest.mark.parametrize("bf16", [False, True])
def test_invariant_decode_gives_each_row_the_extend_kernels_bits(hq, hkv, dim, keys, bf16):
    """A decode row equals, bit for bit, the extend kernel's row at the same position, whatever the
    batch: so a token decoded, recomputed in a cold prefill or verified inside a longer extend
    gets the same logits; with bf16 products too (odd key counts end in half a pair). The default
    decode kernel (invariance off, fp32) is only close."""
    gen = torch.Generator().manual_seed(keys)
    batch, new = 3, 5
    k_cache, v_cache = torch.randn(batch * keys + 4, hkv, dim, generator=gen), torch.randn(batch * keys + 4, hkv, dim, generator=gen)
    kv_indices = torch.randperm(batch * keys + 4, generator=gen)[:batch * keys]
    starts, lens = torch.arange(batch) * keys, torch.full((batch,), keys)
    q = torch.randn(batch * new, hq, dim, generator=gen)
    last = torch.arange(batch) * new + new - 1
    extend = extend_lse = None
    if keys >= new:  # each request's last `new` keys are its new tokens', the last row sees them all
        extend, extend_lse = native.extend_attention(q, k_cache, v_cache, kv_indices, torch.arange(batch) * new,
                                                     torch.full((batch,), new), starts, lens, 0.125, with_lse=True,
                                                     threads=2, bf16=bf16)
    for threads in (1, 2):
        out, lse = native.decode_attention(q[last], k_cache, v_cache, kv_indices, starts, lens, 0.125, with_lse=True,
                                           threads=threads, invariant=True, bf16=bf16)
        alone, _ = native.decode_attention(q[last][:1], k_cache, v_cache, kv_indices, starts[:1], lens[:1], 0.125,
                                           invariant=True, bf16=bf16)
        assert torch.equal(alone[0], out[0])
        if extend is not None:
            assert torch.equal(out, extend[last]) and torch.equal(lse, extend_lse[last])
        default, _ = native.decode_attention(q[last], k_cache, v_cache, kv_indices, starts, lens, 0.125, threads=threads)
        torch.testing.assert_close(out, default, atol=3e-2 if bf16 else 2e-6, rtol=1e-5)


@pytest.mark.parametrize("hq,hkv,dim,softcap", [(9, 3, 64, None), (8, 1, 128, None), (4, 4, 96, None),
                                                (8, 2, 64, 20.0)])
@pytest.mark.parametrize("bf16", [False, True])
def test_requests_that_begin_with_the_same_keys_read_them_once_with_the_same_bits(hq, hkv, dim, softcap, bf16):
    """Rows whose requests continue one radix node (the same leading slots) are read in chunks whose
    shared key blocks are attended with the members' heads as the rows of one tile (each key read
    once for all): every row keeps, bit for bit, what it gets alone. Prefixes of 130 keys (two
    whole blocks shared) and 40 (none), 11 members (two chunks), and requests with no partner; the
    chunks the finder made, and wrong chunks refused before the C code sees them."""
    gen = torch.Generator().manual_seed(dim)
    pool = 4096
    k_cache, v_cache = torch.randn(pool, hkv, dim, generator=gen), torch.randn(pool, hkv, dim, generator=gen)
    free = torch.randperm(pool, generator=gen).tolist()
    take = lambda n: [free.pop() for _ in range(n)]  # noqa: E731
    long_prefix, short_prefix = take(130), take(40)
    tables = [long_prefix + take(1 + 7 * i) for i in range(11)]   # 11 requests behind a 130-key node
    tables += [short_prefix + take(3), short_prefix + take(90)]   # a node shorter than one block
    tables += [take(200)]                                          # a request of its own
    tables.insert(5, take(64))                                     # interleaved in the batch order
    kv_indices = torch.tensor([s for t in tables for s in t])
    lens = torch.tensor([len(t) for t in tables])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)[:-1]])
    q = torch.randn(len(tables), hq, dim, generator=gen)
    sharing = native.KeySharing.find(kv_indices, starts.tolist(), lens.tolist(), max_members=8)
    assert sharing is not None
    chunks = sorted(zip(sharing.bounds.diff().tolist(), sharing.shared.tolist()))
    assert [c for c in chunks if c[0] > 1] == [(3, 128), (8, 128)]
    assert sorted(sharing.order.tolist()) == list(range(len(tables)))
    for threads in (1, 2):
        plain, plain_lse = native.decode_attention(q, k_cache, v_cache, kv_indices, starts, lens, 0.125, with_lse=True,
                                                   threads=threads, invariant=True, softcap=softcap, bf16=bf16)
        shared, shared_lse = native.decode_attention(q, k_cache, v_cache, kv_indices, starts, lens, 0.125,
                                                     with_lse=True, threads=threads, invariant=True, softcap=softcap,
                                                     sharing=sharing, bf16=bf16)
        assert torch.equal(plain, shared) and torch.equal(plain_lse, shared_lse)
    reference, _ = reference_decode(q, k_cache, v_cache, tables, 0.125)
    if softcap is None:
        torch.testing.assert_close(shared, reference, atol=3e-2 if bf16 else 2e-6, rtol=1e-5)
    one_chunk = native.KeySharing([(list(range(len(tables))), 0)])  # everyone in one chunk, nothing shared
    assert torch.equal(native.decode_attention(q, k_cache, v_cache, kv_indices, starts, lens, 0.125, invariant=True,
                                               softcap=softcap, sharing=one_chunk, bf16=bf16)[0], plain)
    for bad in ([(list(range(len(tables) - 1)), 0)], [([0, 0] + list(range(2, len(tables))), 0)],
                [(list(range(len(tables))), int(lens.min()))]):
        with pytest.raises(ValueError, match="key sharing|shared prefix"):
            native.decode_attention(q, k_cache, v_cache, kv_indices, starts, lens, 0.125, invariant=True,
                                    sharing=native.KeySharing(bad))
    assert native.KeySharing.find(kv_indices[:200], [0], [200]) is None


@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 1), (15, 5), (14, 2)])
@pytest.mark.parametrize("rows", [2, 4, 8, 9, 16])
@pytest.mark.parametrize("bf16", [False, True])
def test_one_requests_draft_rows_split_over_the_threads_keep_their_bits(hq, hkv, rows, bf16):
    """A speculative step's rows of one request (row j: the request's 300 keys and its first j + 1
    new ones) form one chunk, a kv head a task: with an odd number of kv heads the tasks do not
    divide among 2 threads, so the kernel splits the chunk into halves that each read the shared
    blocks (where both halves still fill a tile). Every row keeps the bits it gets alone, on 1, 2
    and 3 threads, and matches the float reference."""
    dim = 64
    gen = torch.Generator().manual_seed(rows * 10 + hkv)
    k_cache, v_cache = torch.randn(1024, hkv, dim, generator=gen), torch.randn(1024, hkv, dim, generator=gen)
    free = torch.randperm(1024, generator=gen).tolist()
    context, new = free[:300], free[300:300 + rows]
    tables = [context + new[:j + 1] for j in range(rows)]
    kv_indices = torch.tensor([s for t in tables for s in t])
    lens = torch.tensor([len(t) for t in tables])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)[:-1]])
    sharing = native.KeySharing.find(kv_indices, starts.tolist(), lens.tolist())
    assert sharing is not None and sharing.bounds.diff().tolist() == [rows] and sharing.shared.tolist() == [256]
    q = torch.randn(rows, hq, dim, generator=gen)
    alone = [native.decode_attention(q[j:j + 1], k_cache, v_cache, kv_indices, starts[j:j + 1], lens[j:j + 1], 0.125,
                                     with_lse=True, invariant=True, bf16=bf16) for j in range(rows)]
    for threads in (1, 2, 3):
        out, lse = native.decode_attention(q, k_cache, v_cache, kv_indices, starts, lens, 0.125, with_lse=True,
                                           threads=threads, invariant=True, sharing=sharing, bf16=bf16)
        assert torch.equal(out, torch.cat([o for o, _ in alone])) and torch.equal(lse, torch.cat([l for _, l in alone]))
    reference, _ = reference_decode(q, k_cache, v_cache, tables, 0.125)
    torch.testing.assert_close(out, reference, atol=3e-2 if bf16 else 2e-6, rtol=1e-5)


@pytest.mark.parametrize("bf16", [False, True])
def test_branches_behind_a_common_system_prompt_share_their_transcript(bf16):
    """A batch's branches (three questions after each of three transcripts) all begin with the same
    short system prompt: the finder still groups each transcript's branches (a trie over whole
    blocks), and a chunk of three requests, too few to fill a tile's lanes, loads each shared block
    once for its members; every row keeps the bits it gets alone."""
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache = torch.randn(2048, 3, 64, generator=gen), torch.randn(2048, 3, 64, generator=gen)
    free = torch.randperm(2048, generator=gen).tolist()
    take = lambda n: [free.pop() for _ in range(n)]  # noqa: E731
    system = take(23)
    tables = [system + transcript + take(5 + b) for transcript in (take(150), take(200), take(90)) for b in range(3)]
    tables.append(system + take(300))  # a request with no branch partner
    kv_indices = torch.tensor([s for t in tables for s in t])
    lens = torch.tensor([len(t) for t in tables])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)[:-1]])
    sharing = native.KeySharing.find(kv_indices, starts.tolist(), lens.tolist())
    assert sharing is not None
    chunks = sorted(zip(sharing.bounds.diff().tolist(), sharing.shared.tolist()))
    assert chunks == [(1, 0), (3, 64), (3, 128), (3, 192)]
    q = torch.randn(len(tables), 9, 64, generator=gen)
    for threads in (1, 2):
        alone = native.decode_attention(q, k_cache, v_cache, kv_indices, starts, lens, 0.125, with_lse=True,
                                        threads=threads, invariant=True, bf16=bf16)
        shared = native.decode_attention(q, k_cache, v_cache, kv_indices, starts, lens, 0.125, with_lse=True,
                                         threads=threads, invariant=True, sharing=sharing, bf16=bf16)
        assert torch.equal(alone[0], shared[0]) and torch.equal(alone[1], shared[1])
    reference, _ = reference_decode(q, k_cache, v_cache, tables, 0.125)
    torch.testing.assert_close(shared[0], reference, atol=3e-2 if bf16 else 2e-6, rtol=1e-5)


def test_element_wise_kernels_split_over_threads_with_the_same_bits():
    """Prefill-sized norms, RoPE and gated activations split their rows over the thread pool; each
    row's arithmetic is the one-thread kernel's, so the results are the same bits."""
    from radix_backend.kernels import settings

    gen = torch.Generator().manual_seed(5)
    rows, dim = 700, 576
    x, residual, weight = (torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen),
                           torch.randn(dim, generator=gen))
    qkv = torch.randn(rows, 15, 64, generator=gen)
    positions = torch.randint(0, 2048, (rows,), generator=gen)
    table = torch.randn(2048, 64, generator=gen)
    gate_up = torch.randn(rows, 2 * 1536, generator=gen)

    def run() -> list[torch.Tensor]:
        return [*native.add_rms_norm(x, residual, weight, 1e-5), native.add_rms_norm(None, residual, weight, 1e-5)[0],
                native.rope(qkv[:, :9], positions, table), native.silu_and_mul(gate_up), native.gelu_tanh_and_mul(gate_up)]

    with settings.native_matmul_threads(1):
        alone = run()
    with settings.native_matmul_threads(2):
        split = run()
    assert all(torch.equal(a, b) for a, b in zip(alone, split))
    gate, up = gate_up[:, :1536], gate_up[:, 1536:]
    torch.testing.assert_close(split[4], F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split[5], F.gelu(gate, approximate="tanh") * up, rtol=1e-5, atol=1e-5)


def test_argmax_rows_is_torchs_argmax():
    """Greedy sampling's native argmax: torch's pick for every row, ties (the first maximum),
    NaN (the first NaN), all -inf, +inf, widths that leave a partial vector, one column."""
    gen = torch.Generator().manual_seed(0)
    for shape in [(1, 49152), (32, 4099), (7, 17), (3, 1), (5, 16), (2, 33)]:
        x = torch.randn(*shape, generator=gen)
        assert native.argmax_rows(x) == x.argmax(-1).tolist(), shape
    x = torch.randn(8, 100, generator=gen)
    x[0, 5] = x[0, 70] = x[0, 21] = 50.0  # ties in different lanes: the first
    x[1, :] = float("-inf")
    x[2, 60] = x[2, 40] = float("nan")
    x[3, 99] = float("inf")
    x[4, :] = 0.0
    x[5, 0], x[5, 3] = float("inf"), float("nan")
    x[6, 16] = x[6, 32] = 9.0  # ties in one lane
    x[7, 98] = x[7, 99] = 9.0  # in the tail past the last whole vector
    assert native.argmax_rows(x) == x.argmax(-1).tolist()
    assert native.argmax_rows(x[:, ::2]) == x[:, ::2].argmax(-1).tolist()  # a strided view
    with pytest.raises(ValueError, match="argmax_rows"):
        native.argmax_rows(x.double())
