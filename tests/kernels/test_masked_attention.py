"""Sliding-window and soft-capped attention over the paged pool: the plain-torch path against a
direct dense computation, and the native kernels' windows and soft-capping against it."""

from __future__ import annotations

import pytest
import torch

from radix_backend.kernels import masked_attention as ma
from radix_backend.kernels import native, settings
from radix_backend.kernels.attention_base import PLAIN, AttentionMetadata, ScoreMask
from radix_backend.kernels.native_backend import NativeCPUAttentionBackend
from radix_backend.kernels.torch_backend import TorchAttentionBackend


def ragged_batch(prefix_lens: list[int], extend_lens: list[int], hq: int, hkv: int, dim: int, seed: int = 0):
    """A pool with scattered slots (as after evictions) holding every request's keys, and the new
    tokens' q/k/v; the new tokens' K/V are not in the pool yet (the backend stores them)."""
    gen = torch.Generator().manual_seed(seed)
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    slots = sum(seq) + 20
    k_cache, v_cache = torch.randn(slots, hkv, dim, generator=gen), torch.randn(slots, hkv, dim, generator=gen)
    order = torch.randperm(slots, generator=gen)
    slot_lists = [order[sum(seq[:i]):sum(seq[:i + 1])] for i in range(len(seq))]
    out_slots = torch.cat([s[p:] for s, p in zip(slot_lists, prefix_lens)])
    meta = AttentionMetadata.build(prefix_lens, extend_lens, torch.cat(slot_lists), out_slots, "cpu")
    tokens = sum(extend_lens)
    q = torch.randn(tokens, hq, dim, generator=gen)
    k, v = torch.randn(tokens, hkv, dim, generator=gen), torch.randn(tokens, hkv, dim, generator=gen)
    return q, k, v, k_cache, v_cache, meta, slot_lists


def dense_reference(q, k_cache, v_cache, meta: AttentionMetadata, slot_lists, scale: float, mask: ScoreMask):
    """Every request's whole score matrix in float64, HF's masks written out."""
    hq, hkv = q.shape[1], k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for slots, prefix, extend in zip(slot_lists, meta.prefix_lens_cpu, meta.extend_lens_cpu):
        keys = k_cache[slots].double().repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        values = v_cache[slots].double().repeat_interleave(hq // hkv, dim=1)
        queries = q[row:row + extend].double()
        scores = torch.einsum("ehd,lhd->hel", queries, keys) * scale
        if mask.softcap is not None:
            scores = torch.tanh(scores / mask.softcap) * mask.softcap
        qpos = torch.arange(prefix, prefix + extend)[:, None]
        kpos = torch.arange(len(slots))[None, :]
        visible = (kpos <= qpos) & ((kpos > qpos - mask.window) if mask.window else True)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
        out[row:row + extend] = torch.einsum("hel,lhd->ehd", probs, values)
        row += extend
    return out.float()


CASES = {  # (prefix_lens, extend_lens): a decode step, an extend over cached prefixes, a cold prefill
    "decode": ([40, 7, 130, 64], [1, 1, 1, 1]),
    "extend": ([100, 0, 5, 33], [3, 70, 17, 1]),
    "prefill": ([0], [150]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mask", [ScoreMask(window=16), ScoreMask(softcap=5.0), ScoreMask(window=33, softcap=3.0),
                                  ScoreMask(window=1)])
def test_torch_path_matches_the_dense_masks(case, mask, monkeypatch):
    monkeypatch.setattr(ma, "QUERY_CHUNK", 32)  # several query chunks per long request
    prefix, extend = CASES[case]
    q, k, v, k_cache, v_cache, meta, slot_lists = ragged_batch(prefix, extend, hq=6, hkv=2, dim=32)
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.3, mask)
    want = dense_reference(q, k_cache, v_cache, meta, slot_lists, 0.3, mask)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not native.available(), reason="native kernels not built")
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [1, 16, 64, 65, 1000])
@pytest.mark.parametrize("hq,hkv,dim", [(6, 2, 32), (5, 1, 64)])
def test_native_window_matches_the_dense_masks(case, window, hq, hkv, dim):
    """Windows shorter than a key block, one block exactly, a block and a key, longer than any
    sequence; GQA groups that leave padding rows in the extend kernel's tiles."""
    prefix, extend = CASES[case]
    q, k, v, k_cache, v_cache, meta, slot_lists = ragged_batch(prefix, extend, hq, hkv, dim, seed=window)
    backend = NativeCPUAttentionBackend()
    backend.begin_forward(meta)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.2, ScoreMask(window=window))
    want = dense_reference(q, k_cache, v_cache, meta, slot_lists, 0.2, ScoreMask(window=window))
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not native.available(), reason="native kernels not built")
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mask", [ScoreMask(softcap=5.0), ScoreMask(softcap=0.5), ScoreMask(window=33, softcap=3.0)])
@pytest.mark.parametrize("invariant", [True, False])
def test_native_softcap_matches_the_dense_masks(case, mask, invariant):
    """Gemma 2's soft-capped scores in the native extend and decode kernels (a cap under the scores'
    spread too, where tanh saturates), alone and with a window; decode takes the invariant kernel
    either way, so its rows keep the extend kernel's bits."""
    prefix, extend = CASES[case]
    q, k, v, k_cache, v_cache, meta, slot_lists = ragged_batch(prefix, extend, 6, 2, 32, seed=7)
    backend = NativeCPUAttentionBackend()
    backend.begin_forward(meta)
    with settings.overridden(batch_invariant=invariant):
        out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.3, mask)
    want = dense_reference(q, k_cache, v_cache, meta, slot_lists, 0.3, mask)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not native.available(), reason="native kernels not built")
def test_native_softcap_decode_rows_carry_the_extend_bits():
    """A decode row of soft-capped attention equals the last row of a cold prefill of the same
    request, bit for bit (what lets cached and uncached runs of Gemma 2 agree)."""
    q, k, v, k_cache, v_cache, meta, slot_lists = ragged_batch([0], [90], 4, 2, 64, seed=3)
    mask = ScoreMask(softcap=4.0)
    whole = NativeCPUAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.2, mask)
    step = AttentionMetadata.build([89], [1], meta.kv_indices, meta.out_slots[89:], "cpu")
    backend = NativeCPUAttentionBackend()
    backend.begin_forward(step)
    last = backend.forward(q[89:], k[89:], v[89:], k_cache, v_cache, step, 0.2, mask)
    assert torch.equal(last, whole[89:])
    with pytest.raises(ValueError, match="soft-capped"):
        native.extend_attention(q, k_cache, v_cache, meta.kv_indices, meta.qo_indptr[:-1], meta.extend_lens,
                                meta.kv_indptr[:-1], meta.seq_lens, 0.1, softcap=0.0)


@pytest.mark.skipif(not native.available(), reason="native kernels not built")
def test_native_window_rows_do_not_depend_on_their_tile():
    """A row's bits are the same whether it is prefilled cold in one call or extended after a cached
    prefix (the window's skipped key blocks stay on the request's grid)."""
    q, k, v, k_cache, v_cache, meta, slot_lists = ragged_batch([0], [200], 4, 2, 64, seed=5)
    whole = NativeCPUAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.1, ScoreMask(window=70))
    tail = AttentionMetadata.build([150], [50], meta.kv_indices, meta.out_slots[150:], "cpu")
    part = NativeCPUAttentionBackend().forward(q[150:], k[150:], v[150:], k_cache, v_cache, tail, 0.1,
                                               ScoreMask(window=70))
    assert torch.equal(part, whole[150:])


def test_a_window_no_sequence_outgrows_is_plain_attention():
    q, k, v, k_cache, v_cache, meta, _ = ragged_batch([10, 3], [5, 1], 4, 2, 32)
    assert not ScoreMask(window=15).changes(meta) and ScoreMask(window=14).changes(meta)
    plain = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.2, PLAIN)
    windowed = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.2, ScoreMask(window=15))
    assert torch.equal(plain, windowed)


def test_masks_reject_nonsense():
    with pytest.raises(ValueError, match="window"):
        ScoreMask(window=0)
    with pytest.raises(ValueError, match="softcap"):
        ScoreMask(softcap=-1.0)
    q, _k, _v, k_cache, v_cache, meta, _ = ragged_batch([0], [4], 2, 1, 16)
    with pytest.raises(ValueError, match="causal"):
        native.extend_attention(q, k_cache, v_cache, meta.kv_indices, meta.qo_indptr[:-1], meta.extend_lens,
                                meta.kv_indptr[:-1], meta.seq_lens, 0.1, causal=False, window=4)
