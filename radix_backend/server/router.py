"""Data parallelism: `dp_size` engine replicas behind a cache-aware router.

Each replica has its own radix cache, so where a request goes decides whether its prefix is a
cache hit. The router keeps, per replica, an approximate radix tree of the token ids it has sent
there (prompt + output, LRU-trimmed to the replica's KV capacity) and sends a request to the
replica holding its longest prefix, like SGLang's router:

* if the loads are badly imbalanced, the least-loaded replica wins (a hot prefix must not pin all
  traffic to one replica);
* else if some replica matches at least `cache_threshold` of the prompt, the best-matching one
  (ties: least loaded);
* else the replica with the smallest tree (most free cache room), then least loaded.

`Router` exposes the Engine API (generate / agenerate / stream / astream / score / cache_stats /
flush_cache / shutdown), so the server and the DSL use it like one Engine.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, closing
from dataclasses import dataclass, field
from typing import Any

from ..engine_like import EngineLike
from ..errors import InvalidRequestError
from ..outputs import CacheStats, ChoiceScore, GenerateOutput, StreamChunk
from ..utils import common_prefix_len

POLICIES = ("cache_aware", "round_robin", "shortest_queue")


# ============================================================================ approximate radix tree


@dataclass(eq=False)
class _Node:
    edge: tuple[int, ...] = ()
    parent: "_Node | None" = None
    children: dict[int, "_Node"] = field(default_factory=dict)
    last_access: float = 0.0


class ApproxRadixTree:
    """Token-id radix tree of what one replica has probably cached; no KV, only keys.

    `capacity_tokens` bounds the stored tokens: least recently used leaves are dropped first,
    mirroring the replica's own LRU eviction closely enough for routing.
    """

    def __init__(self, capacity_tokens: int | None = None) -> None:
        self.capacity_tokens = capacity_tokens
        self.root = _Node()
        self.size = 0  # tokens stored

    def clear(self) -> None:
        self.root = _Node()
        self.size = 0

    def match(self, key: Sequence[int]) -> int:
        """Length of the longest stored prefix of `key` (marks the path as recently used)."""
        now = time.monotonic()
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = common_prefix_len(child.edge, key, pos)
            child.last_access = now
            pos += n
            if n < len(child.edge):
                break
            node = child
        return pos

    def insert(self, key: Sequence[int]) -> None:
        now = time.monotonic()
        node, pos = self.root, 0
        key = tuple(key)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = _Node(edge=key[pos:], parent=node, last_access=now)
                node.children[key[pos]] = leaf
                self.size += len(leaf.edge)
                break
            n = common_prefix_len(child.edge, key, pos)
            if n < len(child.edge):  # split the edge at n
                mid = _Node(edge=child.edge[:n], parent=node, last_access=now)
                node.children[key[pos]] = mid
                child.edge = child.edge[n:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            child.last_access = now
            node = child
            pos += n
        self._evict()

    def _evict(self) -> None:
        if self.capacity_tokens is None or self.size <= self.capacity_tokens:
            return
        heap = [(n.last_access, id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        while self.size > self.capacity_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.edge[0]]
            self.size -= len(leaf.edge)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def _leaves(self) -> Iterator[_Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                yield node


# ============================================================================ router


@dataclass
class RouterStats:
    requests: list[int]  # requests routed to each replica
    load: list[int]  # in-flight requests per replica
    tree_tokens: list[int]  # tokens in each approximate tree
    cache_routed: int  # decisions made by prefix match
    balance_routed: int  # decisions made by load (imbalance) or free room


class Router:
    """`dp_size` engines behind one Engine-like front that routes each request (see module doc)."""

    def __init__(self, replicas: Sequence[EngineLike], *, policy: str = "cache_aware", cache_threshold: float = 0.5,
                 balance_abs_threshold: int = 4, balance_rel_threshold: float = 1.5,
                 tree_capacity_tokens: int | None = None) -> None:
        if not replicas:
            raise InvalidRequestError("Router needs at least one replica")
        if policy not in POLICIES:
            raise InvalidRequestError(f"unknown router policy {policy!r}; use one of {POLICIES}")
        if not 0.0 <= cache_threshold <= 1.0:
            raise InvalidRequestError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.replicas = list(replicas)
        self.policy = policy
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        caps = [tree_capacity_tokens if tree_capacity_tokens is not None else (r.kv_capacity or None) for r in self.replicas]
        self.trees = [ApproxRadixTree(c) for c in caps]
        self._lock = threading.Lock()
        self._load = [0] * len(self.replicas)
        self._requests = [0] * len(self.replicas)
        self._rr = itertools.count()
        self._cache_routed = 0
        self._balance_routed = 0
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def from_model(cls, model: str | None = None, *, dp_size: int = 2, policy: str = "cache_aware",
                   router_kwargs: dict[str, Any] | None = None, **engine_kwargs: Any) -> "Router":
        """Load `dp_size` in-process engine replicas of `model` (same kwargs each)."""
        from ..engine import Engine

        if dp_size < 1:
            raise InvalidRequestError(f"dp_size must be >= 1, got {dp_size}")
        replicas = []
        try:
            for _ in range(dp_size):
                replicas.append(Engine(model, **engine_kwargs))
        except BaseException:
            for r in replicas:
                r.shutdown()
            raise
        return cls(replicas, policy=policy, **(router_kwargs or {}))

    # ------------------------------------------------------------------ Engine-like helpers

    @property
    def tokenizer(self) -> Any:
        return self.replicas[0].tokenizer

    @property
    def context_length(self) -> int:
        return self.replicas[0].context_length

    @property
    def model_id(self) -> str:
        return self.replicas[0].model_id

    @property
    def kv_capacity(self) -> int:
        """The smallest replica's pool: a request must fit whichever replica it is routed to."""
        return min(r.kv_capacity for r in self.replicas)

    @property
    def dp_size(self) -> int:
        return len(self.replicas)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.replicas[0].encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.replicas[0].decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        return self.replicas[0].apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    # ------------------------------------------------------------------ routing

    def routing_key(self, prompt: str | None = None, input_ids: Sequence[int] | None = None,
                    messages: list[dict] | None = None) -> list[int]:
        """Token ids the trees are keyed by (the tokenizer is shared by all replicas)."""
        if input_ids is not None:
            return list(input_ids)
        if messages is not None:
            return self.encode(self.apply_chat_template(messages))
        return self.encode(prompt or "")

    def choose(self, key: Sequence[int]) -> int:
        """Pick a replica for `key`, count it as in flight and remember the key in its tree."""
        with self._lock:
            idx = self._choose_locked(key)
            self._load[idx] += 1
            self._requests[idx] += 1
            self.trees[idx].insert(key)
            return idx

    def _choose_locked(self, key: Sequence[int]) -> int:
        n = len(self.replicas)
        if n == 1:
            return 0
        if self.policy == "round_robin":
            return next(self._rr) % n
        loads = self._load
        least_loaded = min(range(n), key=lambda i: (loads[i], self.trees[i].size))
        if self.policy == "shortest_queue":
            return least_loaded
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            self._balance_routed += 1
            return least_loaded
        matches = [t.match(key) for t in self.trees]
        best = max(matches)
        if key and best >= self.cache_threshold * len(key) and best > 0:
            self._cache_routed += 1
            return min((i for i in range(n) if matches[i] == best), key=lambda i: loads[i])
        self._balance_routed += 1
        return min(range(n), key=lambda i: (self.trees[i].size, loads[i]))

    def release(self, idx: int, key: Sequence[int], output_ids: Sequence[int] = ()) -> None:
        """The request finished on replica `idx`: its prompt + output are now cached there."""
        with self._lock:
            self._load[idx] -= 1
            if output_ids:
                self.trees[idx].insert(list(key) + list(output_ids))

    def stats(self) -> RouterStats:
        with self._lock:
            return RouterStats(list(self._requests), list(self._load), [t.size for t in self.trees],
                               self._cache_routed, self._balance_routed)

    # ------------------------------------------------------------------ generation

    @staticmethod
    def _split(prompt: Any, params: Any, input_ids: Any, messages: Any) -> tuple[list[dict[str, Any]], list[Any], bool]:
        """Normalize the Engine's single-or-batch calling convention into per-request kwargs."""
        if sum(x is not None for x in (prompt, input_ids, messages)) != 1:
            raise InvalidRequestError("pass exactly one of prompt, input_ids, messages")
        if prompt is not None:
            batch = isinstance(prompt, list)
            items = [{"prompt": p} for p in (prompt if batch else [prompt])]
        elif input_ids is not None:
            batch = bool(input_ids) and isinstance(input_ids[0], list)
            items = [{"input_ids": x} for x in (input_ids if batch else [input_ids])]
        else:
            batch = bool(messages) and isinstance(messages[0], list)
            items = [{"messages": m} for m in (messages if batch else [messages])]
        if isinstance(params, list):
            if len(params) != len(items):
                raise InvalidRequestError(f"got {len(params)} SamplingParams for {len(items)} prompts")
            plist = list(params)
        else:
            plist = [params] * len(items)
        return items, plist, batch

    def _route(self, item: dict[str, Any]) -> tuple[int, list[int]]:
        key = self.routing_key(**item)
        return self.choose(key), key

    def _generate_one(self, item: dict[str, Any], params: Any, timeout: float | None = None) -> GenerateOutput:
        idx, key = self._route(item)
        out = None
        try:
            out = self.replicas[idx].generate(**item, params=params, timeout=timeout)
            return out
        finally:
            self.release(idx, key, out.token_ids if out is not None else ())

    def generate(self, prompt: Any = None, params: Any = None, *, input_ids: Any = None,
                 messages: Any = None, timeout: float | None = None) -> GenerateOutput | list[GenerateOutput]:
        items, plist, batch = self._split(prompt, params, input_ids, messages)
        if not batch:
            return self._generate_one(items[0], plist[0], timeout)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="radix-router")
        return list(self._pool.map(self._generate_one, items, plist, [timeout] * len(items)))

    async def _agenerate_one(self, item: dict[str, Any], params: Any) -> GenerateOutput:
        idx, key = self._route(item)
        out = None
        try:
            out = await self.replicas[idx].agenerate(**item, params=params)
            return out
        finally:
            self.release(idx, key, out.token_ids if out is not None else ())

    async def agenerate(self, prompt: Any = None, params: Any = None, *, input_ids: Any = None,
                        messages: Any = None) -> GenerateOutput | list[GenerateOutput]:
        items, plist, batch = self._split(prompt, params, input_ids, messages)
        if not batch:
            return await self._agenerate_one(items[0], plist[0])
        return list(await asyncio.gather(*(self._agenerate_one(i, p) for i, p in zip(items, plist))))

    def stream(self, prompt: Any = None, params: Any = None, *, input_ids: Any = None,
               messages: Any = None) -> Iterator[StreamChunk]:
        items, plist, batch = self._split(prompt, params, input_ids, messages)
        if batch:
            raise InvalidRequestError("stream takes one prompt; call it once per prompt")
        idx, key = self._route(items[0])
        ids: list[int] = []
        try:
            with closing(self.replicas[idx].stream(**items[0], params=plist[0])) as chunks:
                for chunk in chunks:
                    ids += chunk.token_ids
                    yield chunk
        finally:
            self.release(idx, key, ids)

    async def astream(self, prompt: Any = None, params: Any = None, *, input_ids: Any = None,
                      messages: Any = None) -> AsyncIterator[StreamChunk]:
        items, plist, batch = self._split(prompt, params, input_ids, messages)
        if batch:
            raise InvalidRequestError("astream takes one prompt; call it once per prompt")
        idx, key = self._route(items[0])
        ids: list[int] = []
        try:
            async with aclosing(self.replicas[idx].astream(**items[0], params=plist[0])) as chunks:
                async for chunk in chunks:
                    ids += chunk.token_ids
                    yield chunk
        finally:
            self.release(idx, key, ids)

    def score(self, prefix: str | list[int], continuations: list[str] | list[list[int]], *,
              unconditional: bool = False) -> list[ChoiceScore]:
        key = list(prefix) if isinstance(prefix, list) else self.encode(prefix)
        idx = self.choose(key)
        try:
            return self.replicas[idx].score(prefix, continuations, unconditional=unconditional)
        finally:
            self.release(idx, key)

    async def ascore(self, prefix: str | list[int], continuations: list[str] | list[list[int]], *,
                     unconditional: bool = False) -> list[ChoiceScore]:
        key = list(prefix) if isinstance(prefix, list) else self.encode(prefix)
        idx = self.choose(key)
        try:
            return await self.replicas[idx].ascore(prefix, continuations, unconditional=unconditional)
        finally:
            self.release(idx, key)

    # ------------------------------------------------------------------ cache and lifecycle

    def cache_stats(self) -> CacheStats:
        """Sum of the replicas' stats (hit rate recomputed over the sums)."""
        stats = [r.cache_stats() for r in self.replicas]
        first = stats[0]
        total = {k: sum(getattr(s, k) for s in stats) for k in vars(first) if k != "hit_rate"}
        total["hit_rate"] = total["cached_tokens"] / total["prompt_tokens"] if total["prompt_tokens"] else 0.0
        return CacheStats(**total)

    def flush_cache(self) -> bool:
        ok = True
        for replica, tree in zip(self.replicas, self.trees):
            if replica.flush_cache():
                with self._lock:
                    tree.clear()
            else:
                ok = False
        return ok

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        for r in self.replicas:
            r.shutdown()

    @property
    def is_shutdown(self) -> bool:
        return all(r.is_shutdown for r in self.replicas)

    def __enter__(self) -> "Router":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

