"""Token-level radix tree over KV slot indices (SGLang's RadixAttention `RadixCache`).

Each edge (`TreeNode`) holds a run of token ids (`key`) and the KV slots of those tokens
(`value`, an int64 tensor of the same length). A root-to-node path spells a token prefix whose
KV is cached. With page_size > 1 every key is a whole number of pages, children are keyed by
their first page (a tuple) and matches are rounded down to whole pages, so a node always owns
whole pages of the `SlotAllocator`.

Ownership: the tree owns the slots of every token it holds; running requests lock the path of
their matched prefix (`inc_lock_ref`) so it is never evicted. Eviction frees least-recently-used
unlocked leaves (a logical clock, bumped on each match/insert, orders them).

Not thread-safe on purpose: only the scheduler thread calls it, so no locks are taken.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count

import torch

from ..errors import InvalidRequestError
from ..utils import common_prefix_len
from .kv_pool import SlotAccountingError, SlotAllocator

_node_ids = count()
logger = logging.getLogger(__name__)


class TreeNode:
    """One edge of the radix tree: `key` tokens whose KV slots are `value`."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time", "id")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None, access_time: int) -> None:
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0  # running requests whose matched prefix passes through this node
        self.last_access_time = access_time
        self.id = next(_node_ids)

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, children={len(self.children)})"


@dataclass
class MatchResult:
    """The longest cached prefix of a query: its KV slots and the node it ends at."""

    slots: torch.Tensor  # int64 [len]
    last_node: TreeNode

    def __len__(self) -> int:
        return int(self.slots.numel())


@dataclass
class RequestKV:
    """A running request's KV after `cache_unfinished`: `slots[:prefix_len]` is owned by the tree
    (on the path locked at `last_node`); `slots[prefix_len:]` is still the request's own."""

    slots: torch.Tensor
    prefix_len: int
    last_node: TreeNode


class RadixCache:
    """Radix tree of cached prefixes; see the module docstring. Sizes are in tokens."""

    def __init__(self, allocator: SlotAllocator, page_size: int = 1, disable: bool = False) -> None:
        if allocator.page_size != page_size:
            raise InvalidRequestError(
                f"RadixCache page_size {page_size} differs from the allocator's {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self.evicted_tokens_total = 0
        # called with each node about to be evicted, its ancestors still in place (the disk tier's write-back)
        self.evict_listener: Callable[[TreeNode], None] | None = None
        self._init_tree()

    # --- state ------------------------------------------------------------------------------
    def _init_tree(self) -> None:
        self._clock = 0
        self.root = TreeNode([], self._empty(), None, 0)
        self.root.lock_ref = 1  # the root is never evictable
        self._evictable_size = 0
        self._protected_size = 0
        self._num_nodes = 0
        self._evictable_leaves: set[TreeNode] = set()

    def reset(self) -> None:
        """Free every slot the tree owns and empty it. Call only while no node is locked."""
        if self._protected_size:
            raise SlotAccountingError(
                f"reset() with {self._protected_size} tokens still locked by running requests")
        self.allocator.free(self.all_slots())
        self._init_tree()

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def num_nodes(self) -> int:
        """Nodes besides the root."""
        return self._num_nodes

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree owns (for invariant checks; O(tree))."""
        values = [n.value for n in self._iter_nodes()]
        return torch.cat(values) if values else self._empty()

    # --- lookup / insert --------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached (page-aligned) prefix of `token_ids`.

        If the match ends inside a node, that node is split so `last_node` covers exactly the
        match. Every node on the path gets a fresh access time. Disabled: empty match at root.
        """
        key = self._aligned_key(token_ids)
        if self.disable or not key:
            return MatchResult(self._empty(), self.root)
        now = self._tick()
        node, pos, values = self.root, 0, []
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = self._match_len(child.key, key, pos)
            ends_inside = n < len(child.key)
            if ends_inside:
                child = self._split(child, n)
            child.last_access_time = now  # after the split: the unmatched rest keeps its age
            values.append(child.value)
            node, pos = child, pos + n
            if ends_inside:
                break
        # Always a fresh tensor, so a caller writing into it can never corrupt a node's slots.
        slots = torch.cat(values) if len(values) > 1 else (values[0].clone() if values else self._empty())
        return MatchResult(slots, node)

    def continuation(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens the tree holds right after the whole of `token_ids` (what an
        earlier request produced after this very sequence), along the most recently used branch;
        [] when the tree does not hold all of `token_ids`. Read-only: no split, no access time
        (a speculative draft, not a use of the KV)."""
        key = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids  # read only: no copy
        if self.disable or max_tokens <= 0:
            return []
        node, pos, out = self.root, 0, []
        while pos < len(key):
            child = self._child_along(node, key, pos)
            if child is None:
                return []
            n = common_prefix_len(child.key, key, pos)
            if pos + n == len(key):
                out = child.key[n:n + max_tokens]
            elif n < len(child.key):
                return []
            node, pos = child, pos + n
        while len(out) < max_tokens and node.children:
            node = max(node.children.values(), key=lambda c: c.last_access_time)
            out.extend(node.key[:max_tokens - len(out)])
        return out

    def _child_along(self, node: TreeNode, key: Sequence[int], pos: int) -> TreeNode | None:
        """The child of `node` whose key continues `key[pos:]` (with pages, a last partial page
        picks the most recently used child that starts with it)."""
        if self.page_size == 1 or len(key) - pos >= self.page_size:
            return node.children.get(self._child_key(key, pos))
        rest = list(key[pos:])
        fits = [c for c in node.children.values() if c.key[:len(rest)] == rest]
        return max(fits, key=lambda c: c.last_access_time, default=None)

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        """Cache the (page-aligned) prefix of `token_ids` whose KV sits at `slots`.

        Returns how many leading tokens were already in the tree: the caller still owns (and
        should free) its slots for those beyond its own matched prefix; the tree takes ownership
        of the slots of the newly inserted tokens only (it copies the tensor). When disabled the
        tree takes nothing and returns the aligned length, so that same caller code frees all.
        """
        key = self._aligned_key(token_ids)
        if self.disable or not key:
            return len(key)
        if slots.numel() < len(key):
            raise InvalidRequestError(f"insert got {len(key)} tokens but only {slots.numel()} slots")
        now = self._tick()
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = self._match_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            node, pos = child, pos + n
        if pos < len(key):
            self._add_leaf(node, key[pos:], slots[pos:len(key)].to(device=self.allocator.device, dtype=torch.int64).clone(), now)
        return pos

    def path(self, node: TreeNode) -> tuple[list[int], torch.Tensor]:
        """Tokens and KV slots from the root down to `node`, inclusive."""
        keys, values = [], []
        while node is not self.root:
            keys.append(node.key)
            values.append(node.value)
            node = node.parent
        tokens = [t for key in reversed(keys) for t in key]
        return tokens, torch.cat(values[::-1]) if values else self._empty()

    # --- locking ----------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock `node` and its ancestors (a running request uses that prefix). Returns the change
        in evictable size."""
        delta = 0
        while node is not self.root:
            if node.lock_ref == 0:
                size = len(node.key)
                self._evictable_size -= size
                self._protected_size += size
                delta -= size
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one `inc_lock_ref(node)`. Returns the change in evictable size."""
        delta = 0
        while node is not self.root:
            if node.lock_ref <= 0:
                raise SlotAccountingError(f"dec_lock_ref on unlocked node {node!r}")
            if node.lock_ref == 1:
                size = len(node.key)
                self._evictable_size += size
                self._protected_size -= size
                delta += size
                if not node.children:
                    self._evictable_leaves.add(node)
            node.lock_ref -= 1
            node = node.parent
        return delta

    # --- eviction ---------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked leaves until `num_tokens` tokens are freed (or nothing
        evictable is left). A parent left childless and unlocked becomes a candidate. Returns the
        tokens evicted (whole nodes, so it can exceed `num_tokens`)."""
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        evicted, freed = 0, []
        while evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if self.evict_listener is not None:
                try:
                    self.evict_listener(node)
                except Exception:  # noqa: BLE001 - a failed write-back must not stop eviction
                    logger.exception("evict listener failed; evicting node %s anyway", node.id)
            freed.append(node.value)
            evicted += len(node.key)
            parent = node.parent
            self._delete_leaf(node)
            if parent in self._evictable_leaves:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        if freed:
            self.allocator.free(torch.cat(freed))
        self.evicted_tokens_total += evicted
        return evicted

    # --- request hand-over: the scheduler's only way to give KV to the tree --------------------
    #
    # A request's KV, by index into its `slots` (`slots[i]` holds the KV of `token_ids[i]`),
    # n = len(slots), aligned = n rounded down to whole pages, already = tokens the tree held
    # before this call (returned by `insert`):
    #
    #   [0, prefix_len)        the tree's own, on the path locked at `last_node` (from match_prefix)
    #   [prefix_len, already)  the request's copies of tokens another request inserted meanwhile:
    #                          FREED, the tree's copies stay
    #   [already, aligned)     new to the tree: INSERTED, the tree owns them from now on
    #   [aligned, n)           the unaligned tail (page_size > 1): FREED when finished, KEPT by
    #                          the request when unfinished
    #
    # finished: the lock on `last_node` is dropped. unfinished: the lock moves to the node that
    # ends at `aligned`, and the request continues with the tree's [0, aligned) + its own tail.
    # With the tree disabled nothing is inserted: finished frees all of [prefix_len, n),
    # unfinished changes nothing.

    def cache_finished(self, token_ids: Sequence[int], slots: torch.Tensor, prefix_len: int,
                       last_node: TreeNode) -> int:
        """Hand a finished, aborted or retracted request's KV to the tree and drop its lock.
        Returns the tokens newly cached."""
        aligned, already = self._insert_request_kv(token_ids, slots, prefix_len)
        self.allocator.free(slots[aligned:])
        self.dec_lock_ref(last_node)
        return 0 if self.disable else aligned - already

    def cache_unfinished(self, token_ids: Sequence[int], slots: torch.Tensor, prefix_len: int,
                         last_node: TreeNode) -> RequestKV:
        """Cache a still-running request's KV so far (after a prefill chunk) and move its lock
        forward. Use the returned slots / prefix_len / last_node from then on."""
        if self.disable:
            return RequestKV(slots, prefix_len, last_node)
        aligned, _ = self._insert_request_kv(token_ids, slots, prefix_len)
        match = self.match_prefix(token_ids[:aligned])
        if len(match) != aligned:
            raise SlotAccountingError(f"re-match after insert found {len(match)} of {aligned} tokens")
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(last_node)
        new_slots = torch.cat((match.slots, slots[aligned:].to(match.slots.device)))
        return RequestKV(new_slots, aligned, match.last_node)

    def _insert_request_kv(self, token_ids: Sequence[int], slots: torch.Tensor, prefix_len: int) -> tuple[int, int]:
        """Insert [0, aligned) and free the request's duplicates [prefix_len, already)."""
        n = int(slots.numel())
        aligned = n - n % self.page_size
        already = self.insert(token_ids[:aligned], slots[:aligned])
        if already < prefix_len:
            raise SlotAccountingError(f"locked prefix of {prefix_len} tokens shrank to {already}")
        self.allocator.free(slots[prefix_len:already])
        return aligned, already

    # --- debugging --------------------------------------------------------------------------
    def pretty_print(self, max_tokens: int = 8) -> str:
        """An indented dump of the tree (keys truncated to `max_tokens`)."""
        lines = [f"root (nodes={self._num_nodes}, tokens={self.total_size()}, "
                 f"evictable={self._evictable_size}, protected={self._protected_size})"]

        def walk(node: TreeNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda c: c.id):
                key = child.key[:max_tokens]
                more = "..." if len(child.key) > max_tokens else ""
                lines.append(f"{'  ' * depth}{key}{more} len={len(child.key)} lock={child.lock_ref} "
                             f"t={child.last_access_time} slots={child.value[:max_tokens].tolist()}{more}")
                walk(child, depth + 1)

        walk(self.root, 1)
        return "\n".join(lines)

    # --- internals --------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.allocator.device)

    def _aligned_key(self, token_ids: Sequence[int]) -> list[int]:
        key = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        if self.page_size > 1:
            del key[len(key) - len(key) % self.page_size:]
        return key

    def _child_key(self, key: list[int], pos: int) -> int | tuple[int, ...]:
        return key[pos] if self.page_size == 1 else tuple(key[pos:pos + self.page_size])

    def _match_len(self, node_key: list[int], key: list[int], pos: int) -> int:
        """Page-aligned length of the common prefix of `node_key` and `key[pos:]`."""
        i = common_prefix_len(node_key, key, pos)
        return i - i % self.page_size

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after `n` tokens; return the new upper node (same lock and access time)."""
        upper = TreeNode(child.key[:n], child.value[:n], child.parent, child.last_access_time)
        upper.lock_ref = child.lock_ref
        child.key, child.value = child.key[n:], child.value[n:]
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        upper.parent.children[self._child_key(upper.key, 0)] = upper
        self._num_nodes += 1
        return upper

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor, now: int) -> None:
        leaf = TreeNode(key, value, parent, now)
        parent.children[self._child_key(key, 0)] = leaf
        self._evictable_leaves.discard(parent)
        self._evictable_leaves.add(leaf)
        self._evictable_size += len(key)
        self._num_nodes += 1

    def _delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        del parent.children[self._child_key(node.key, 0)]
        self._evictable_leaves.discard(node)
        self._evictable_size -= len(node.key)
        self._num_nodes -= 1
        if parent is not self.root and not parent.children and parent.lock_ref == 0:
            self._evictable_leaves.add(parent)

    def _iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
