"""A KV pool of bf16 rows: with bf16 attention products the kernels round every K and V row to
bf16 anyway, so storing the rounded rows gives the same bits at half the bytes. Checked against
the same kernels over the fp32 pool the rows were rounded from."""

from __future__ import annotations

import pytest
import torch

from radix_backend.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native kernels (a C compiler)")


def test_rounding_is_the_products_rounding() -> None:
    """To nearest even like torch's bf16 for normal values and infinities; denormals become signed
    zeros (as vdpbf16ps's inputs do); every length (vector tails included)."""
    gen = torch.Generator().manual_seed(0)
    for n in (1, 5, 16, 31, 32, 33, 70):
        x = torch.randn(n, generator=gen) * 10
        assert torch.equal(native.round_bf16(x).view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    special = torch.tensor([1e-39, -1e-39, 0.0, -0.0, float("inf"), -float("inf"), 3.0e38, 1.0 + 2 ** -8,
                            1.0 + 3 * 2 ** -8])
    bits = native.round_bf16(special).view(torch.int16).tolist()
    assert bits[:4] == [0, -32768, 0, -32768]  # denormals to signed zero
    assert bits[4:] == special[4:].to(torch.bfloat16).view(torch.int16).tolist()  # ties to even, overflow to inf
    assert torch.isnan(native.round_bf16(torch.tensor([float("nan")])).float()).all()
    with pytest.raises(ValueError, match="fp32 CPU tensor"):
        native.round_bf16(torch.zeros(4, dtype=torch.float64))


def pools(slots: int, hkv: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(slots, hkv, dim, generator=gen), torch.randn(slots, hkv, dim, generator=gen)
    return (k, v), (native.round_bf16(k), native.round_bf16(v)), gen


@pytest.mark.parametrize("hq,hkv,dim,keys", [(9, 3, 64, 1), (9, 3, 64, 131), (32, 8, 128, 300), (4, 4, 96, 77),
                                             (8, 1, 256, 700)])
def test_extend_and_decode_read_a_bf16_pool_with_the_same_bits(hq, hkv, dim, keys) -> None:
    batch, new = 3, min(5, keys)
    (k32, v32), (k16, v16), gen = pools(batch * keys + 4, hkv, dim, keys)
    kv_indices = torch.randperm(batch * keys + 4, generator=gen)[:batch * keys]
    starts, lens = torch.arange(batch) * keys, torch.full((batch,), keys)
    q = torch.randn(batch * new, hq, dim, generator=gen)
    q_starts, q_lens = torch.arange(batch) * new, torch.full((batch,), new)
    for threads in (1, 2):
        for kwargs in ({}, {"window": 40}, {"softcap": 20.0}):
            ref = native.extend_attention(q, k32, v32, kv_indices, q_starts, q_lens, starts, lens, 0.125,
                                          with_lse=True, threads=threads, bf16=True, **kwargs)
            got = native.extend_attention(q, k16, v16, kv_indices, q_starts, q_lens, starts, lens, 0.125,
                                          with_lse=True, threads=threads, bf16=True, **kwargs)
            assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
        last = q_starts + q_lens - 1
        ref = native.decode_attention(q[last], k32, v32, kv_indices, starts, lens, 0.125, with_lse=True,
                                      threads=threads, invariant=True, bf16=True)
        for invariant in (True, False):  # a bf16 pool is always read by the invariant kernel
            got = native.decode_attention(q[last], k16, v16, kv_indices, starts, lens, 0.125, with_lse=True,
                                          threads=threads, invariant=invariant, bf16=True)
            assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


def test_shared_prefix_chunks_read_a_bf16_pool_with_the_same_bits() -> None:
    hq, hkv, dim = 9, 3, 64
    (k32, v32), (k16, v16), gen = pools(2048, hkv, dim, 7)
    free = torch.randperm(2048, generator=gen).tolist()
    prefix = [free.pop() for _ in range(130)]
    tables = [prefix + [free.pop() for _ in range(1 + 5 * i)] for i in range(10)]
    kv_indices = torch.tensor([s for t in tables for s in t])
    lens = torch.tensor([len(t) for t in tables])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)[:-1]])
    q = torch.randn(len(tables), hq, dim, generator=gen)
    sharing = native.KeySharing.find(kv_indices, starts.tolist(), lens.tolist())
    assert sharing is not None
    ref = native.decode_attention(q, k32, v32, kv_indices, starts, lens, 0.125, threads=2, invariant=True,
                                  sharing=sharing, bf16=True)[0]
    got = native.decode_attention(q, k16, v16, kv_indices, starts, lens, 0.125, threads=2, invariant=True,
                                  sharing=sharing, bf16=True)[0]
    assert torch.equal(ref, got)


def test_a_bf16_pool_needs_bf16_products() -> None:
    (_, _), (k16, v16), _ = pools(8, 1, 64, 1)
    q, idx, one = torch.randn(1, 1, 64), torch.arange(4), torch.tensor([4])
    with pytest.raises(ValueError, match="bf16 products only"):
        native.decode_attention(q, k16, v16, idx, torch.tensor([0]), one, 0.125)
    with pytest.raises(ValueError, match="bf16 products only"):
        native.extend_attention(q, k16, v16, idx, torch.tensor([0]), torch.tensor([1]), torch.tensor([0]), one, 0.125)
    with pytest.raises(ValueError, match="one shape and dtype"):
        native.decode_attention(q, k16, v16.float(), idx, torch.tensor([0]), one, 0.125, bf16=True)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
def test_store_kv_in_one_pass_equals_rounding_then_index_copy(pool_dtype) -> None:
    """A step's K and V rows into their slots (V a strided view into a fused qkv output, as the
    model hands it over): the same bytes as rounding them and `index_copy_`, no other slot
    touched; a slot outside the pool is an error that writes nothing."""
    gen = torch.Generator().manual_seed(3)
    tokens, hkv, dim, rows = 37, 3, 64, 100
    qkv = torch.randn(tokens, (4 + 2) * hkv * dim, generator=gen)
    k = qkv[:, 4 * hkv * dim:5 * hkv * dim].reshape(tokens, hkv, dim).contiguous()
    v = qkv[:, 5 * hkv * dim:].reshape(tokens, hkv, dim)
    assert not v.is_contiguous()
    slots = torch.randperm(rows, generator=gen)[:tokens]
    k_cache, v_cache = (torch.randn(rows, hkv, dim, generator=gen).to(pool_dtype) for _ in range(2))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    rounded = (lambda x: native.round_bf16(x.contiguous())) if pool_dtype == torch.bfloat16 else (lambda x: x)
    want_k.index_copy_(0, slots, rounded(k))
    want_v.index_copy_(0, slots, rounded(v))
    bits = torch.int16 if pool_dtype == torch.bfloat16 else torch.int32
    assert native.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(bits), want_k.view(bits)) and torch.equal(v_cache.view(bits), want_v.view(bits))
    bad = slots.clone()
    bad[-1] = rows
    before = k_cache.clone()
    with pytest.raises(IndexError, match="outside the pool"):
        native.store_kv(k * 2, v, k_cache, v_cache, bad)
    assert torch.equal(k_cache.float(), before.float())
    assert not native.store_kv(k.double(), v.double(), k_cache, v_cache, slots)  # not for it: the caller's path
