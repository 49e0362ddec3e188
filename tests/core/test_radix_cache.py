"""RadixCache against a brute-force reference, plus targeted unit tests.

The reference is a dict `page-aligned prefix tuple -> KV slots of its last page`: the keys are
exactly the (prefix-closed) set of cached prefixes, so the longest cached prefix of a query is its
longest page-aligned prefix in the dict, and the expected slots are read off the dict. (With pages,
`[1,0,0,0]` and `[1,0,0,1]` are two separate entries: the tree is a trie over pages, not tokens.)
Eviction is checked, then the reference is re-synced from the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radix_backend.errors import InvalidRequestError
from radix_backend.mem_cache.kv_pool import SlotAccountingError, SlotAllocator
from radix_backend.mem_cache.radix_cache import RadixCache, TreeNode


Ref = dict[tuple[int, ...], tuple[int, ...]]


def tree_contents(tree: RadixCache) -> Ref:
    """page-aligned prefix -> slots of its last page, for every page the tree holds."""
    ps = tree.page_size
    out: Ref = {}
    stack: list[tuple[TreeNode, tuple[int, ...]]] = [(tree.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            value = child.value.tolist()
            for j in range(0, len(child.key), ps):
                out[prefix + tuple(child.key[: j + ps])] = tuple(value[j:j + ps])
            stack.append((child, prefix + tuple(child.key)))
    return out


def path_tokens(tree: RadixCache, node: TreeNode) -> list[int]:
    parts = []
    while node is not tree.root:
        parts.append(node.key)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def all_nodes(tree: RadixCache) -> list[TreeNode]:
    out, stack = [], list(tree.root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


@dataclass
class Req:
    tokens: list[int]
    slots: torch.Tensor  # slots[:prefix_len] owned by the tree, the rest by this request
    prefix_len: int
    last_node: TreeNode


class Harness:
    """A tiny scheduler driving the cache the way the engine does, checking each step."""

    def __init__(self, num_slots: int, page_size: int) -> None:
        self.ps = page_size
        self.alloc = SlotAllocator(num_slots, page_size, debug=True)
        self.tree = RadixCache(self.alloc, page_size)
        self.ref: Ref = {}
        self.reqs: list[Req] = []

    # --- reference ----------------------------------------------------------------------------
    def ref_match_len(self, tokens: list[int]) -> int:
        k = 0
        while k + self.ps <= len(tokens) and tuple(tokens[: k + self.ps]) in self.ref:
            k += self.ps
        return k

    def ref_slots(self, tokens: list[int], k: int) -> list[int]:
        return [s for j in range(0, k, self.ps) for s in self.ref[tuple(tokens[: j + self.ps])]]

    def ref_add(self, tokens: list[int], slots: torch.Tensor) -> int:
        """Model insert: returns the expected 'already cached' length."""
        aligned = len(tokens) - len(tokens) % self.ps
        already = self.ref_match_len(tokens[:aligned])
        for j in range(already, aligned, self.ps):
            self.ref[tuple(tokens[: j + self.ps])] = tuple(slots[j:j + self.ps].tolist())
        return already

    # --- operations ---------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> None:
        m = self.tree.match_prefix(tokens)
        k = self.ref_match_len(tokens)
        assert len(m) == k
        assert m.slots.tolist() == self.ref_slots(tokens, k)
        assert path_tokens(self.tree, m.last_node) == tokens[:k]  # split exactly at the match end

    def evict(self, n: int) -> int:
        locked_before = {id(r): self.ref_slots(r.tokens, r.prefix_len) for r in self.reqs}
        evictable, protected = self.tree.evictable_size(), self.tree.protected_size()
        old = dict(self.ref)
        evicted = self.tree.evict(n)
        assert evicted <= evictable
        assert evicted >= min(n, evictable) if n > 0 else evicted == 0
        if evicted < n:
            assert self.tree.evictable_size() == 0
        assert self.tree.protected_size() == protected
        new = tree_contents(self.tree)
        assert new.items() <= old.items()  # eviction only removes tokens, never moves them
        assert (len(old) - len(new)) * self.ps == evicted
        gone = torch.tensor([s for p, page in old.items() if p not in new for s in page], dtype=torch.int64)
        if gone.numel():
            assert bool(self.alloc.is_free(gone).all())
        self.ref = new
        for r in self.reqs:  # locked prefixes survive, with the same slots
            assert self.ref_slots(r.tokens, r.prefix_len) == locked_before[id(r)]
        return evicted

    def reserve(self, n_pages: int) -> bool:
        short = n_pages - self.alloc.num_free_pages
        if short > 0:
            self.evict(short * self.ps)
        return self.alloc.num_free_pages >= n_pages

    def insert_direct(self, tokens: list[int]) -> None:
        """Insert like a finished request that matched nothing: own slots for every token."""
        if not self.reserve(self.alloc.pages_needed(0, len(tokens))):
            return
        slots = self.alloc.alloc(len(tokens))
        expected = self.ref_match_len(tokens[: len(tokens) - len(tokens) % self.ps])
        already = self.tree.insert(tokens, slots)
        assert already == expected
        self.ref_add(tokens, slots)
        aligned = len(tokens) - len(tokens) % self.ps
        self.alloc.free(slots[:already])
        self.alloc.free(slots[aligned:])

    def start(self, tokens: list[int]) -> None:
        m = self.tree.match_prefix(tokens)
        assert len(m) == self.ref_match_len(tokens)
        self.tree.inc_lock_ref(m.last_node)
        k = len(m)
        last = int(m.slots[-1]) if k else None
        if not self.reserve(self.alloc.pages_needed(k, len(tokens) - k)):
            self.tree.dec_lock_ref(m.last_node)
            return
        own = self.alloc.alloc_extend(last, k, len(tokens) - k)
        self.reqs.append(Req(list(tokens), torch.cat((m.slots, own)), k, m.last_node))

    def extend(self, i: int, new_tokens: list[int]) -> None:
        r = self.reqs[i]
        cur = len(r.tokens)
        if not self.reserve(self.alloc.pages_needed(cur, len(new_tokens))):
            return
        last = int(r.slots[-1]) if cur else None
        more = self.alloc.alloc_extend(last, cur, len(new_tokens))
        r.tokens += new_tokens
        r.slots = torch.cat((r.slots, more))

    def cache_unfinished(self, i: int) -> None:
        r = self.reqs[i]
        old_slots = r.slots.clone()
        already = self.ref_match_len(r.tokens[: len(r.tokens) - len(r.tokens) % self.ps])
        self.ref_add(r.tokens, r.slots)
        kv = self.tree.cache_unfinished(r.tokens, r.slots, r.prefix_len, r.last_node)
        aligned = len(r.tokens) - len(r.tokens) % self.ps
        assert kv.prefix_len == aligned
        assert kv.slots.tolist() == self.ref_slots(r.tokens, aligned) + old_slots[aligned:].tolist()
        dup = old_slots[r.prefix_len:already]
        if dup.numel():
            assert bool(self.alloc.is_free(dup).all())
        r.slots, r.prefix_len, r.last_node = kv.slots, kv.prefix_len, kv.last_node

    def finish(self, i: int) -> None:
        r = self.reqs.pop(i)
        self.ref_add(r.tokens, r.slots)
        self.tree.cache_finished(r.tokens, r.slots, r.prefix_len, r.last_node)

    def abort(self, i: int) -> None:
        r = self.reqs.pop(i)
        self.alloc.free(r.slots[r.prefix_len:])
        self.tree.dec_lock_ref(r.last_node)

    # --- invariants ---------------------------------------------------------------------------
    def check(self) -> None:
        tree, ps = self.tree, self.ps
        assert tree_contents(tree) == self.ref
        assert tree.total_size() == len(self.ref) * ps
        nodes = all_nodes(tree)
        assert tree.num_nodes() == len(nodes)
        # Slot ownership: every page free, held by one running request, or owned by one node.
        tree_slots = tree.all_slots().tolist()
        assert len(tree_slots) == len(set(tree_slots))
        holders = [set(s // ps for s in tree_slots)]
        holders += [set((r.slots[r.prefix_len:] // ps).tolist()) for r in self.reqs]
        holders.append(set((self.alloc.free_slots() // ps).tolist()))
        assert sum(len(h) for h in holders) == self.alloc.num_pages
        assert set().union(*holders) == set(range(1, self.alloc.num_pages + 1))
        # Lock counts equal the number of running requests whose path passes through each node.
        expect = {id(n): 0 for n in nodes}
        for r in self.reqs:
            assert path_tokens(tree, r.last_node) == r.tokens[: r.prefix_len]
            node = r.last_node
            while node is not tree.root:
                expect[id(node)] += 1
                node = node.parent
        for n in nodes:
            assert n.lock_ref == expect[id(n)]
            assert len(n.key) == n.value.numel() > 0 and len(n.key) % ps == 0
            assert n.parent.children[tree._child_key(n.key, 0)] is n
        assert tree.protected_size() == sum(len(n.key) for n in nodes if n.lock_ref)
        assert tree.evictable_size() == sum(len(n.key) for n in nodes if not n.lock_ref)
        assert tree._evictable_leaves == {n for n in nodes if not n.children and not n.lock_ref}
        for r in self.reqs:  # paged layout: token j at offset j % ps of its page
            s = r.slots.tolist()
            assert len(s) == len(r.tokens)
            assert all(x % ps == j % ps for j, x in enumerate(s))
            assert all(s[j] // ps == s[j - 1] // ps for j in range(1, len(s)) if j % ps)

    def drain(self) -> None:
        """Finish or abort everything, flush, and expect every slot free."""
        while self.reqs:
            self.finish(0) if len(self.reqs) % 2 else self.abort(0)
        self.check()
        self.tree.reset()
        self.ref.clear()
        assert self.alloc.num_free == self.alloc.num_total
        assert self.tree.total_size() == self.tree.num_nodes() == 0


tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=14)


class RadixMachine(RuleBasedStateMachine):
    page_size = 1
    num_slots = 40

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(self.num_slots, self.page_size)

    @rule(tokens=tokens_st)
    def insert(self, tokens):
        self.h.insert_direct(tokens)

    @rule(tokens=tokens_st)
    def match(self, tokens):
        self.h.match(tokens)

    @rule(tokens=tokens_st)
    def start(self, tokens):
        if len(self.h.reqs) < 4:
            self.h.start(tokens)

    @precondition(lambda self: self.h.reqs)
    @rule(i=st.integers(0, 9), new=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def extend(self, i, new):
        self.h.extend(i % len(self.h.reqs), new)

    @precondition(lambda self: self.h.reqs)
    @rule(i=st.integers(0, 9))
    def cache_unfinished(self, i):
        self.h.cache_unfinished(i % len(self.h.reqs))

    @precondition(lambda self: self.h.reqs)
    @rule(i=st.integers(0, 9))
    def finish(self, i):
        self.h.finish(i % len(self.h.reqs))

    @precondition(lambda self: self.h.reqs)
    @rule(i=st.integers(0, 9))
    def abort(self, i):
        self.h.abort(i % len(self.h.reqs))

    @rule(n=st.integers(0, 20))
    def evict(self, n):
        self.h.evict(n)

    @precondition(lambda self: not self.h.reqs)
    @rule()
    def reset(self):
        self.h.drain()

    @invariant()
    def consistent(self):
        self.h.check()

    def teardown(self):
        self.h.drain()


class RadixMachinePaged(RadixMachine):
    page_size = 4
    num_slots = 64


_machine_settings = settings(max_examples=120, stateful_step_count=35, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
TestRadixPageSize1 = RadixMachine.TestCase
TestRadixPageSize1.settings = _machine_settings
TestRadixPageSize4 = RadixMachinePaged.TestCase
TestRadixPageSize4.settings = _machine_settings


# --- targeted unit tests -----------------------------------------------------------------------
def make(num_slots: int = 64, page_size: int = 1) -> tuple[SlotAllocator, RadixCache]:
    a = SlotAllocator(num_slots, page_size, debug=True)
    return a, RadixCache(a, page_size)


def insert_fresh(a: SlotAllocator, t: RadixCache, tokens: list[int]) -> torch.Tensor:
    slots = a.alloc(len(tokens))
    already = t.insert(tokens, slots)
    a.free(slots[:already])
    return slots


def test_split_on_match_and_insert_return():
    a, t = make()
    s = insert_fresh(a, t, [1, 2, 3, 4, 5])
    m = t.match_prefix([1, 2, 3, 9, 9])
    assert len(m) == 3 and m.slots.tolist() == s[:3].tolist()
    assert m.last_node.key == [1, 2, 3] and t.num_nodes() == 2
    assert t.insert([1, 2, 3, 4, 5, 6], a.alloc(6)) == 5
    assert t.total_size() == 6
    assert len(t.match_prefix([7])) == 0 and t.match_prefix([7]).last_node is t.root
    assert len(t.match_prefix([])) == 0
    assert "len=3" in t.pretty_print()


def test_lru_eviction_order_and_parent_becomes_candidate():
    a, t = make()

    def cached(tokens: list[int]) -> bool:  # no side effects, unlike match_prefix
        return tuple(tokens) in tree_contents(t)

    insert_fresh(a, t, [1, 1, 1])      # t=1
    insert_fresh(a, t, [2, 2])         # B, t=2
    t.match_prefix([1, 1, 5])          # t=3, splits: [1,1] gets t=3, its rest [1] keeps t=1
    insert_fresh(a, t, [1, 1, 4])      # t=4: [1,1] and the new leaf [4]
    insert_fresh(a, t, [3])            # t=5
    assert t.evict(1) == 1 and not cached([1, 1, 1]) and cached([1, 1, 4]) and cached([2, 2])
    t.match_prefix([2, 2])             # B becomes the most recent (t=6)
    assert t.evict(1) == 1 and not cached([1, 1, 4]) and cached([3]) and cached([2, 2])
    assert t.evict(1) == 2 and not cached([1]) and cached([3])  # [1,1] became a leaf (t=4)
    assert t.evict(1) == 1 and not cached([3]) and cached([2, 2])
    assert t.evict(5) == 2  # whole nodes go; fewer than asked when nothing is left
    assert t.total_size() == t.num_nodes() == 0
    assert t.evicted_tokens_total == 7
    assert a.num_free == 64


def test_locked_path_is_never_evicted():
    a, t = make()
    insert_fresh(a, t, [5, 6, 7, 8])
    insert_fresh(a, t, [9, 9])
    m = t.match_prefix([5, 6, 0])
    assert t.inc_lock_ref(m.last_node) == -2
    assert t.protected_size() == 2 and t.evictable_size() == 4
    assert t.evict(100) == 4
    assert t.total_size() == 2 and len(t.match_prefix([5, 6, 7])) == 2
    with pytest.raises(SlotAccountingError):
        t.reset()  # still locked
    assert t.dec_lock_ref(m.last_node) == 2
    with pytest.raises(SlotAccountingError):
        t.dec_lock_ref(m.last_node)
    t.reset()
    assert a.num_free == a.num_total


def test_paged_match_is_page_aligned():
    a, t = make(64, page_size=4)
    toks = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    slots = a.alloc(len(toks))
    assert t.insert(toks, slots) == 0  # caches the first 8 tokens only
    a.free(slots[8:])
    assert t.total_size() == 8
    m = t.match_prefix([1, 2, 3, 4, 5, 6, 0, 0])
    assert len(m) == 4 and m.slots.tolist() == slots[:4].tolist()
    assert [len(c.key) for c in m.last_node.children.values()] == [4]
    assert len(t.match_prefix([1, 2, 3])) == 0


def test_request_helpers_cache_unfinished_then_finished():
    a, t = make(32)
    r1 = insert_fresh(a, t, [1, 2, 3])
    m = t.match_prefix([1, 2, 3, 4, 5])
    t.inc_lock_ref(m.last_node)
    own = a.alloc(2)
    slots = torch.cat((m.slots, own))
    # Another request caches [1,2,3,4] meanwhile, so our slot for token 4 is a duplicate.
    other = insert_fresh(a, t, [1, 2, 3, 4])
    kv = t.cache_unfinished([1, 2, 3, 4, 5], slots, 3, m.last_node)
    assert kv.prefix_len == 5
    assert kv.slots.tolist() == r1.tolist() + [int(other[3]), int(own[1])]
    assert bool(a.is_free(own[:1]).all())
    assert t.protected_size() == 5
    assert t.cache_finished([1, 2, 3, 4, 5, 6], torch.cat((kv.slots, a.alloc(1))), kv.prefix_len, kv.last_node) == 1
    assert t.protected_size() == 0 and t.total_size() == 6
    t.reset()
    assert a.num_free == a.num_total


def test_disabled_cache_owns_nothing():
    a = SlotAllocator(16, debug=True)
    t = RadixCache(a, disable=True)
    slots = a.alloc(4)
    assert t.insert([1, 2, 3, 4], slots) == 4  # "already cached": the caller frees all of it
    m = t.match_prefix([1, 2, 3, 4])
    assert len(m) == 0 and m.last_node is t.root
    t.inc_lock_ref(m.last_node)
    t.cache_finished([1, 2, 3, 4], slots, 0, m.last_node)
    assert a.num_free == 16 and t.total_size() == 0 and t.evict(10) == 0


def test_bad_arguments():
    a = SlotAllocator(16, page_size=4)
    with pytest.raises(InvalidRequestError, match="page_size"):
        RadixCache(a, page_size=1)
    t = RadixCache(a, page_size=4)
    with pytest.raises(InvalidRequestError, match="slots"):
        t.insert([1, 2, 3, 4], torch.tensor([4, 5]))


def test_tensor_keys_and_caller_slot_reuse():
    a, t = make(16)
    table = a.alloc(3)
    t.insert(torch.tensor([4, 5, 6]), table)
    table[:] = 0  # caller reuses its row; the tree copied the slots
    assert t.match_prefix([4, 5, 6]).slots.tolist() == [1, 2, 3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tree_smoke():
    for ps in (1, 4):
        h = Harness(64, ps)
        h.alloc = SlotAllocator(64, ps, device="cuda", debug=True)
        h.tree = RadixCache(h.alloc, ps)
        for toks in ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 0, 0, 0, 0], [5] * 12):
            h.start(toks)
            h.check()
        h.cache_unfinished(0)
        h.extend(1, [3, 3, 3])
        h.check()
        assert h.tree.all_slots().is_cuda
        h.evict(4)
        h.drain()
