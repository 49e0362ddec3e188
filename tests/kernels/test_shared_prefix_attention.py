"""Shared-prefix (cascade) attention in the torch and native backends equals plain per-request attention."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from radix_backend.kernels import native, settings
from radix_backend.kernels import shared_prefix as sp
from radix_backend.kernels.attention_base import AttentionMetadata
from radix_backend.kernels.native_backend import NativeCPUAttentionBackend, NativePlan
from radix_backend.kernels.torch_backend import TorchAttentionBackend

HQ, HKV, D = 6, 2, 16


BACKENDS = {"native": NativeCPUAttentionBackend, "torch": TorchAttentionBackend}


@pytest.fixture(autouse=True, params=list(BACKENDS))
def decode_path(request, monkeypatch) -> str:
    """Every test runs with attention on the native kernels (read in place) and on torch ops."""
    if request.param == "native" and not native.available():
        pytest.skip("native CPU kernels unavailable (no C compiler)")
    monkeypatch.setattr(sys.modules[__name__], "Backend", BACKENDS[request.param])
    return request.param


Backend: type[TorchAttentionBackend] = TorchAttentionBackend  # set per test by `decode_path`


def reference(q, k_cache, v_cache, slot_lists, prefix_lens, extend_lens, scale):
    """Textbook attention, one query at a time."""
    out = torch.empty_like(q)
    row = 0
    for slots, prefix, extend in zip(slot_lists, prefix_lens, extend_lens):
        for j in range(extend):
            visible = slots[:prefix + j + 1]
            for h in range(HQ):
                keys = k_cache[visible, h // (HQ // HKV)].double()
                values = v_cache[visible, h // (HQ // HKV)].double()
                weights = torch.softmax(keys @ q[row, h].double() * scale, dim=0)
                out[row, h] = (weights @ values).float()
            row += 1
    return out


def run(slot_lists, prefix_lens, extend_lens, share=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_slots = max(max(s) for s in slot_lists) + 1
    k_cache = torch.randn(num_slots, HKV, D, generator=gen)
    v_cache = torch.randn(num_slots, HKV, D, generator=gen)
    tokens = sum(extend_lens)
    q = torch.randn(tokens, HQ, D, generator=gen)
    k = torch.randn(tokens, HKV, D, generator=gen)
    v = torch.randn(tokens, HKV, D, generator=gen)
    out_slots = torch.tensor([s for slots, p in zip(slot_lists, prefix_lens) for s in slots[p:]])
    meta = AttentionMetadata.build(prefix_lens, extend_lens, torch.tensor([s for x in slot_lists for s in x]),
                                   out_slots, "cpu")
    backend = Backend(share_prefixes=share)
    scale = 1 / math.sqrt(D)
    # the shared-prefix pass runs where batch invariance is off (it sums in another order)
    with settings.overridden(batch_invariant=False):
        backend.begin_forward(meta)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    k_cache[out_slots], v_cache[out_slots] = k, v
    return out, reference(q, k_cache, v_cache, slot_lists, prefix_lens, extend_lens, scale), backend


def shared_batch(num_requests, shared, own, extend, contiguous=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    base = list(range(1, shared + 1)) if contiguous else torch.randperm(4 * shared, generator=gen)[:shared].add(1).tolist()
    nxt = 5 * shared + 10
    slot_lists, prefix_lens = [], []
    for i in range(num_requests):
        mine = list(range(nxt, nxt + own[i] + extend[i]))
        nxt += own[i] + extend[i] + 3
        slot_lists.append(base + mine)
        prefix_lens.append(shared + own[i])
    return slot_lists, prefix_lens


@pytest.mark.parametrize("contiguous", [True, False])
def test_decode_with_a_shared_prefix_equals_reference(contiguous, decode_path):
    slots, prefix = shared_batch(5, shared=70, own=[0, 3, 9, 1, 40], extend=[1] * 5, contiguous=contiguous)
    out, ref, backend = run(slots, prefix, [1] * 5)
    assert isinstance(backend._plan, NativePlan) == (decode_path == "native")
    assert len(backend._plan.groups) == 1 and backend._plan.groups[0].length == 70
    assert (backend._plan.groups[0].contiguous_start is not None) == contiguous
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_extend_with_a_shared_prefix_equals_reference(decode_path):
    slots, prefix = shared_batch(4, shared=40, own=[4, 5, 2, 3], extend=[3, 2, 4, 3])
    out, ref, backend = run(slots, prefix, [3, 2, 4, 3])
    if decode_path == "native":  # one in-place call attends every request's whole context
        assert backend._plan.extend and not backend._plan.groups
    else:
        assert backend._plan.groups and backend._plan.padded
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_partial_sharing_two_groups_and_a_loner():
    a, pa = shared_batch(3, shared=33, own=[2, 0, 4], extend=[1, 1, 1], seed=1)
    b, pb = shared_batch(2, shared=50, own=[1, 6], extend=[1, 1], seed=2)
    b = [[s + 1000 for s in x] for x in b]
    loner = [list(range(3000, 3100))]
    slot_lists, prefix = a + b + loner, pa + pb + [99]
    out, ref, backend = run(slot_lists, prefix, [1] * 6)
    assert sorted(g.length for g in backend._plan.groups) == [33, 50]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_nested_sharing_takes_the_common_part_of_the_group():
    # all share 40 tokens; two of them share 30 more: one group of length 40
    base = list(range(1, 41))
    slot_lists = [base + list(range(100, 130)) + [200], base + list(range(100, 130)) + [201], base + [300, 301, 302]]
    out, ref, backend = run(slot_lists, [70, 70, 42], [1, 1, 1])
    assert [g.length for g in backend._plan.groups] == [40]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_ragged_extend_falls_back_to_per_request_and_stays_exact(decode_path):
    slots, prefix = shared_batch(3, shared=40, own=[0, 0, 0], extend=[1, 1, 120])
    out, ref, backend = run(slots, prefix, [1, 1, 120])
    if decode_path == "native":
        assert backend._plan.extend
    else:
        assert not backend._plan.padded and backend._plan.groups
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    plain, ref2, _ = run(slots, prefix, [1, 1, 120], share=False)
    torch.testing.assert_close(plain, ref2, atol=2e-5, rtol=1e-4)


def test_short_common_prefixes_are_not_shared():
    slots, prefix = shared_batch(4, shared=sp.MIN_SHARED_TOKENS - 1, own=[5, 5, 5, 5], extend=[1] * 4)
    out, ref, backend = run(slots, prefix, [1] * 4)
    assert backend._plan.groups == []
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_forward_without_begin_forward_plans_itself():
    slots, prefix = shared_batch(3, shared=40, own=[1, 2, 3], extend=[1, 1, 1])
    gen = torch.Generator().manual_seed(0)
    meta = AttentionMetadata.build(prefix, [1, 1, 1], torch.tensor([s for x in slots for s in x]),
                                   torch.tensor([x[-1] for x in slots]), "cpu")
    cache = torch.randn(max(max(x) for x in slots) + 1, HKV, D, generator=gen)
    q, kv = torch.randn(3, HQ, D, generator=gen), torch.randn(3, HKV, D, generator=gen)
    shared = Backend().forward(q, kv, kv, cache.clone(), cache.clone(), meta, 0.25)
    plain = Backend(share_prefixes=False).forward(q, kv, kv, cache.clone(), cache.clone(), meta, 0.25)
    torch.testing.assert_close(shared, plain, atol=2e-5, rtol=1e-4)


def test_batch_invariance_attends_a_shared_prefix_in_one_pass_per_request():
    """The shared pass merges two partial softmaxes, which sums in another order than a request
    alone: with batch invariance (the default) every request takes one pass over its keys."""
    slots, prefix = shared_batch(4, shared=64, own=[3, 5, 2, 7], extend=[1, 1, 1, 1])
    meta = AttentionMetadata.build(prefix, [1] * 4, torch.tensor([s for x in slots for s in x]),
                                   torch.tensor([x[-1] for x in slots]), "cpu")
    backend = Backend()
    backend.begin_forward(meta)
    assert backend._plan.groups == []
