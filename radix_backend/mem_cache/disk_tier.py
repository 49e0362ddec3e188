"""The radix cache's second tier: KV blocks on disk, loaded back instead of recomputed.

`DiskTier` sits between the scheduler, the radix tree, the KV pool and a `DiskKVStore`, and is
called on the scheduler thread only:

- `extend_match`: a prefix match that stops short in memory continues on disk; the blocks found
  there are read, copied into freshly allocated pool slots and inserted into the tree, so the
  request (and every later one) sees them as ordinary cached KV (`cached_tokens` counts them).
- `on_cached`: write-through. When a request's KV is handed to the tree and its sequence is at
  least `write_through_tokens` long, its whole blocks not yet on disk are copied out and queued.
- the tree's eviction listener: write-back. A node about to be evicted has its blocks that end
  inside it copied out first (blocks ending in an ancestor are written when that one goes).

Blocks are `block_tokens` long from position 0 of the sequence, independent of where the tree's
nodes split, so a prefix written by one request is found by any other sharing it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..kernels import native
from .kv_pool import KVPool
from .kv_store import DiskKVStore, KVBlock, block_hashes, model_fingerprint
from .radix_cache import MatchResult, RadixCache, TreeNode

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..model_executor.model_runner import ModelRunner

BLOCK_TOKENS = 64  # per file: ~3 MB of fp32 KV for SmolLM2-135M; rounded up to whole KV pages

AllocFn = Callable[[int | None, int, int], "torch.Tensor | None"]  # (last_slot, cur_len, n) -> slots


def open_disk_tier(config: EngineConfig, runner: ModelRunner, tree: RadixCache, alloc: AllocFn) -> DiskTier:
    """The disk tier for this engine's model, its store named by the model's fingerprint."""
    block_tokens = math.lcm(BLOCK_TOKENS, config.page_size)
    pool = runner.kv_pool
    layout = (pool.cfg.num_layers, block_tokens, pool.cfg.num_kv_heads, pool.cfg.head_dim)
    store = DiskKVStore(config.disk_cache_dir, model_fingerprint(runner.model.state_dict(), kv_identity(runner)),
                        config.disk_cache_bytes, block_shape=layout, dtype=pool.dtype)
    return DiskTier(store, tree, pool, alloc, block_tokens=block_tokens,
                    write_through_tokens=config.disk_cache_write_through_tokens)


def kv_identity(runner: ModelRunner) -> dict[str, Any]:
    """Everything besides the weights that decides what KV the model computes (not where it was loaded from)."""
    model_config = runner.config.to_dict() if hasattr(runner.config, "to_dict") else dict(vars(runner.config))
    for volatile in ("_name_or_path", "transformers_version", "_commit_hash"):
        model_config.pop(volatile, None)
    report = runner.quantization
    # the kernels' numerics: their path (device, KV dtype, attention products, activation bits,
    # instruction set, ...) and their code, so KV written by another path or release is never read
    # back as this one's
    path = dataclasses.asdict(runner.kernel_path)
    path.pop("cuda_graph", None)  # how steps are launched, not what they compute
    return {"model_config": model_config, "quantization": report.mode, "dense_dtype": str(report.dense_dtype),
            "kernel_path": path, "kernel_sources": native.source_digest(), "torch": torch.__version__}


class DiskTier:
    def __init__(self, store: DiskKVStore, tree: RadixCache, pool: KVPool, alloc: AllocFn, *,
                 block_tokens: int, write_through_tokens: int) -> None:
        self.store = store
        self.tree = tree
        self.pool = pool
        self.alloc = alloc
        self.block_tokens = block_tokens
        self.write_through_tokens = write_through_tokens
        tree.evict_listener = self._on_evict

    # ---- read path ----------------------------------------------------------------------------
    def extend_match(self, tokens: Sequence[int], match: MatchResult) -> MatchResult:
        """`match` (the tree's longest prefix of `tokens`) made longer with blocks from disk."""
        b = self.block_tokens
        cached = len(match)
        first = cached // b
        names = block_hashes(tokens, b, self.store.fingerprint)
        if first >= len(names) or not self.store.has(names[first]):
            return match
        start = time.perf_counter()
        self.tree.inc_lock_ref(match.last_node)  # allocating may evict: keep the matched path
        try:
            present = first
            while present < len(names) and self.store.has(names[present]):
                present += 1
            blocks = self.store.read_run(names[first:present],
                                         [tokens[j * b:(j + 1) * b] for j in range(first, present)])
            if not blocks:
                return match
            end = (first + len(blocks)) * b
            last_slot = int(match.slots[-1]) if cached else None
            slots = self.alloc(last_slot, cached, end - cached)
            if slots is None:
                return match
            skip = cached - first * b  # tokens of the first block the tree already holds
            self._write_pool(slots, blocks, skip)
        finally:
            self.tree.dec_lock_ref(match.last_node)
        already = self.tree.insert(tokens[:end], torch.cat((match.slots, slots.to(match.slots.device))))
        if already > cached:  # cannot happen on the one scheduler thread; keep the slots balanced anyway
            self.tree.allocator.free(slots[:already - cached])
        stats = self.store.stats
        stats.hit_tokens += end - cached
        stats.load_s += time.perf_counter() - start
        return self.tree.match_prefix(tokens)

    def _write_pool(self, slots: torch.Tensor, blocks: list[KVBlock], skip: int) -> None:
        """Copy the blocks' K/V (the first block from token `skip` on) into the pool at `slots`."""
        dev, dtype = self.pool.device, self.pool.dtype
        index = slots.to(dev)
        pos = 0
        for i, blk in enumerate(blocks):
            k, v = (blk.k[:, skip:], blk.v[:, skip:]) if i == 0 else (blk.k, blk.v)
            rows = index[pos:pos + k.shape[1]]
            self.pool.k_buffer[:, rows] = k.to(device=dev, dtype=dtype)
            self.pool.v_buffer[:, rows] = v.to(device=dev, dtype=dtype)
            pos += k.shape[1]

    # ---- write paths --------------------------------------------------------------------------
    def on_cached(self, tokens: Sequence[int], slots: torch.Tensor) -> None:
        """Write-through: a long sequence's KV (slot i holds token i) is about to go to the tree."""
        if len(tokens) >= self.write_through_tokens:
            self._persist(tokens, slots, from_token=0)

    def _on_evict(self, node: TreeNode) -> None:
        tokens, slots = self.tree.path(node)
        self._persist(tokens, slots, from_token=len(tokens) - len(node.key))

    def _persist(self, tokens: Sequence[int], slots: torch.Tensor, from_token: int) -> None:
        """Queue the whole blocks of `tokens` that end after `from_token` and are not on disk yet."""
        b = self.block_tokens
        names = block_hashes(tokens, b, self.store.fingerprint)
        for j in range(from_token // b, len(names)):
            if self.store.has(names[j]):
                continue
            index = slots[j * b:(j + 1) * b].to(self.pool.device)
            k = self.pool.k_buffer[:, index].cpu()  # advanced indexing copies: the slots may be reused
            v = self.pool.v_buffer[:, index].cpu()
            if not self.store.put(names[j], tokens[j * b:(j + 1) * b], k, v):
                return  # writing is off or its queue is full: later blocks would be dropped too
