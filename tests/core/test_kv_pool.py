"""KVPool layout and SlotAllocator accounting (page_size 1 and paged)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radix_backend.errors import InvalidRequestError
from radix_backend.mem_cache.kv_pool import (KVPool, KVPoolConfig, SlotAccountingError, SlotAllocator,
                                   kv_tokens_for_budget)


def test_config_bytes_and_budget():
    cfg = KVPoolConfig(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float16)
    assert cfg.bytes_per_token() == 2 * 30 * 3 * 64 * 2
    assert kv_tokens_for_budget(cfg, cfg.bytes_per_token() * 100 + 7) == 100
    assert kv_tokens_for_budget(cfg, 0) == 0
    assert kv_tokens_for_budget(cfg, -5) == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_pool_layout_and_write(page_size):
    cfg = KVPoolConfig(num_layers=2, num_kv_heads=2, head_dim=4)
    pool = KVPool(cfg, num_slots=18, page_size=page_size)
    usable = 18 // page_size * page_size
    assert pool.num_slots == usable
    assert pool.k_buffer.shape == (2, usable + page_size, 2, 4)
    assert pool.k_cache(1).shape == (usable + page_size, 2, 4)
    assert pool.size_bytes() == 2 * 2 * (usable + page_size) * 2 * 4 * 4
    slots = torch.tensor([page_size, page_size + 3])
    k = torch.randn(2, 2, 4)
    v = torch.randn(2, 2, 4)
    pool.k_cache(1)[slots], pool.v_cache(1)[slots] = k, v  # what the attention backends do, through the views
    assert torch.equal(pool.k_cache(1)[slots], k)
    assert torch.equal(pool.v_cache(1)[slots], v)
    assert pool.k_cache(1).data_ptr() == pool.k_buffer[1].data_ptr()  # a view, not a copy
    assert not pool.k_cache(0).any()
    alloc = pool.make_allocator(debug=True)
    assert alloc.num_total == usable


def _resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_cpu_pool_is_zero_and_costs_memory_only_as_it_is_used(dtype):
    """The default CPU pool holds ~130k tokens; writing all its bytes at start-up took seconds."""
    cfg = KVPoolConfig(num_layers=16, num_kv_heads=8, head_dim=64, dtype=dtype)
    before = _resident_bytes()
    pool = KVPool(cfg, num_slots=65536)  # 2 x 1 GiB at bf16, 2 x 2 GiB at fp32
    assert pool.k_buffer.dtype == dtype and pool.size_bytes() >= 2 << 30
    assert _resident_bytes() - before < 64 << 20
    assert not pool.k_cache(15)[-8:].any() and not pool.v_cache(3)[:8].any()
    pool.v_cache(3)[torch.tensor([5])] = torch.ones(1, 8, 64, dtype=dtype)
    assert pool.v_cache(3)[5].eq(1).all() and not pool.v_cache(3)[6].any()


def test_pool_too_small():
    cfg = KVPoolConfig(num_layers=1, num_kv_heads=1, head_dim=2)
    with pytest.raises(InvalidRequestError, match="kv_cache_tokens"):
        KVPool(cfg, num_slots=3, page_size=4)
    with pytest.raises(InvalidRequestError):
        SlotAllocator(0)


def test_alloc_free_accounting():
    a = SlotAllocator(10, debug=True)
    assert (a.num_total, a.num_free) == (10, 10)
    x = a.alloc(4)
    y = a.alloc(6)
    assert a.num_free == 0
    assert sorted(torch.cat((x, y)).tolist()) == list(range(1, 11))  # slot 0 never handed out
    assert a.alloc(1) is None  # exhausted: None, nothing taken
    assert a.num_free == 0
    a.free(x[:2])
    assert a.num_free == 2
    assert a.alloc(3) is None and a.num_free == 2  # never partial
    z = a.alloc(2)
    assert sorted(z.tolist()) == sorted(x[:2].tolist())
    assert a.alloc(0).numel() == 0
    a.reset()
    assert a.num_free == 10
    assert a.free_slots().tolist() == list(range(1, 11))


def test_free_copies_callers_tensor():
    a = SlotAllocator(4, debug=True)
    table = a.alloc(4)
    assert table.tolist() == [1, 2, 3, 4]
    a.free(table[:2])
    table[:2] = torch.tensor([3, 4])  # caller reuses its slot table row
    got = a.alloc(2)
    assert sorted(got.tolist()) == [1, 2]  # what was freed, not what the row says now


@pytest.mark.parametrize("debug", [False, True])
def test_double_free_and_padding_free_raise(debug):
    a = SlotAllocator(8, debug=debug)
    x = a.alloc(3)
    a.free(x)
    with pytest.raises(SlotAccountingError, match="double free"):
        a.free(x[:1])
    with pytest.raises(SlotAccountingError, match="padding"):
        a.free(torch.tensor([0]))
    with pytest.raises(SlotAccountingError, match="out of range"):
        a.free(torch.tensor([9]))
    assert a.num_free == 8  # failed frees changed nothing


def test_duplicate_in_one_free_debug():
    a = SlotAllocator(8, debug=True)
    x = a.alloc(3)
    with pytest.raises(SlotAccountingError):
        a.free(torch.cat((x, x[:1])))


def test_paged_alloc_and_extend_continuity():
    ps = 4
    a = SlotAllocator(32, page_size=ps, debug=True)  # 8 pages, page 0 reserved
    assert (a.num_total, a.num_free, a.num_free_pages) == (32, 32, 8)
    s = a.alloc(6)  # 2 pages, 6 slots used
    assert s.numel() == 6 and a.num_free_pages == 6
    assert int(s[0]) % ps == 0 and torch.equal(s[:4], torch.arange(int(s[0]), int(s[0]) + 4))
    assert int(s[4]) % ps == 0
    assert a.pages_needed(6, 2) == 0 and a.pages_needed(6, 3) == 1
    more = a.alloc_extend(int(s[-1]), 6, 2)  # fills the rest of the current page, no new page
    assert more.tolist() == [int(s[-1]) + 1, int(s[-1]) + 2]
    assert a.num_free_pages == 6
    more2 = a.alloc_extend(int(more[-1]), 8, 5)  # page-aligned: two new pages
    assert a.num_free_pages == 4 and more2.numel() == 5
    assert int(more2[0]) % ps == 0 and torch.equal(more2[:4], torch.arange(int(more2[0]), int(more2[0]) + 4))
    seq = torch.cat((s, more, more2))
    pages = seq // ps
    for i in range(seq.numel()):  # token i of the sequence sits at offset i % ps of its page
        assert int(seq[i]) % ps == i % ps
        if i % ps:
            assert pages[i] == pages[i - 1]
    assert pages.unique().numel() == 4
    with pytest.raises(SlotAccountingError):  # last_slot inconsistent with cur_len
        a.alloc_extend(int(seq[-1]) + 1, 13, 1)
    assert a.alloc_extend(int(seq[-1]), 13, 3 + 4 * 4 + 1) is None  # needs 5 pages, 4 free
    a.free(seq[4:6])  # frees the whole 2nd page (caller owns pages whole)
    assert a.num_free_pages == 5
    with pytest.raises(SlotAccountingError, match="double free"):
        a.free(seq[5:7])
    a.free(torch.cat((seq[:4], seq[8:])))
    assert a.num_free == 32


def test_paged_extend_from_empty_equals_alloc():
    a = SlotAllocator(16, page_size=4)
    s = a.alloc_extend(None, 0, 3)
    assert s.numel() == 3 and int(s[0]) % 4 == 0
    assert a.num_free_pages == 3


@settings(max_examples=60, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4]),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=40))
def test_random_alloc_free_never_shares_a_page(page_size, ops):
    a = SlotAllocator(24, page_size=page_size, debug=True)
    held: list[torch.Tensor] = []
    for do_alloc, n in ops:
        if do_alloc:
            before = a.num_free_pages
            got = a.alloc(n)
            if got is None:
                assert a.pages_needed(0, n) > before and a.num_free_pages == before
            else:
                assert got.numel() == n
                held.append(got)
        elif held:
            a.free(held.pop(n % len(held)))
        owned = [set((h // page_size).tolist()) for h in held]
        flat = [p for o in owned for p in o]
        assert len(flat) == len(set(flat))  # no page in two holders
        free = set((a.free_slots() // page_size).tolist())
        assert free.isdisjoint(flat) and 0 not in free
        assert len(free) + len(flat) == a.num_pages == 24 // page_size
        assert a.num_free == len(free) * page_size


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_pool_and_allocator(page_size):
    cfg = KVPoolConfig(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16, device="cuda")
    pool = KVPool(cfg, num_slots=256, page_size=page_size)
    a = pool.make_allocator(device="cuda", debug=True)
    s = a.alloc(20)
    assert s.is_cuda and s.numel() == 20
    more = a.alloc_extend(int(s[-1]), 20, 30)
    k = torch.randn(50, 2, 8, device="cuda", dtype=torch.float16)
    slots = torch.cat((s, more))
    pool.k_cache(0)[slots] = k
    assert torch.equal(pool.k_cache(0)[slots], k)
    a.free(slots)
    assert a.num_free == a.num_total
    with pytest.raises(SlotAccountingError):
        a.free(slots[:1])


def test_a_decode_steps_slots_come_in_one_allocation_as_one_by_one():
    from radix_backend.mem_cache.kv_manager import KVManager, RequestSlots

    one_by_one, together = (KVManager(SlotAllocator(16, debug=True)) for _ in range(2))
    for kv in (one_by_one, together):
        kv.free(kv.allocator.alloc(5)[1::2])  # a used pool: freed slots come back in their own order
    held = [RequestSlots() for _ in range(4)]
    want = [one_by_one.alloc(h, 1) for h in held]
    got = together.alloc_decode(4)
    assert got is not None and [s.tolist() for s in got] == [s.tolist() for s in want]
    assert all(s.shape == (1,) for s in got) and together.allocator.num_free == one_by_one.allocator.num_free
    assert together.alloc_decode(together.allocator.num_free + 1) is None  # short: the caller goes one by one
    assert KVManager(SlotAllocator(16, page_size=4), page_size=4).alloc_decode(2) is None  # pages of several slots
