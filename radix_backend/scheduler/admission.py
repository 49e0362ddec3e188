"""Admission policy: which waiting requests join the next forward, in what order, and how much.

Pure decisions over request state; the scheduler does the KV bookkeeping (matching, allocation,
eviction) and asks this module what to do (mini-sglang's `PrefillAdder` plays the same part).

- `order_waiting`: cache-aware order. `lpm` puts the longest cached prefix first, so hits are
  used before eviction can take them; `dfs-weight` groups requests under the same radix node,
  heaviest group first; `fcfs` keeps arrival order.
- `StepBudget`: the chunked-prefill token budget of one forward, shared by running requests that
  are still prefilling and by new admissions.
- `PrefillAdder`: admits requests in order until the token budget, the request seats or the KV
  (after reserving decode room for every running request) run out. A request that shares an
  uncached prefix with one being prefilled right now waits a step, so it reuses that prefix
  instead of computing it again (SGLang's in-batch prefix check).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .request import Req

DECODE_RESERVE_TOKENS = 16  # per running request, kept free when admitting new prompts
IN_BATCH_PREFIX_TOKENS = 8  # shared uncached tokens that make a waiting request defer one step


def needs_match_to_order(policy: str, num_waiting: int) -> bool:
    """Whether `order_waiting` reads cache matches (the scheduler then matches every waiting request)."""
    return policy != "fcfs" and num_waiting > 1


def order_waiting(waiting: Sequence[Req], policy: str) -> list[Req]:
    """Waiting requests in admission order. Except under fcfs, every request must be matched
    (`kv.last_node`, `kv.cached_len` set). Stable: ties keep arrival order."""
    if not needs_match_to_order(policy, len(waiting)):
        return list(waiting)
    if policy == "lpm":
        return sorted(waiting, key=lambda r: -r.kv.cached_len)
    weight: dict[int, int] = {}  # dfs-weight: requests per deepest matched node
    for r in waiting:
        weight[id(r.kv.last_node)] = weight.get(id(r.kv.last_node), 0) + 1
    return sorted(waiting, key=lambda r: (-weight[id(r.kv.last_node)], -r.kv.cached_len))


@dataclass
class StepBudget:
    """Prefill tokens one forward may still compute; chunks are cut to whole pages."""

    prefill_tokens: int
    page_size: int = 1

    def chunk_len(self, pending: int) -> int:
        """How many of `pending` uncomputed tokens fit now (0 when none do)."""
        n = min(pending, self.prefill_tokens)
        if n < pending and self.page_size > 1:
            n = n // self.page_size * self.page_size
        return max(n, 0)

    def spend(self, n: int) -> None:
        self.prefill_tokens -= n


@dataclass
class PrefillAdder:
    """Admits waiting requests into one step; see the module docstring."""

    budget: StepBudget
    running: Sequence[Req]
    max_running: int
    admitted: list[Req] = field(default_factory=list)
    _prefilling: list[list[int]] = field(default_factory=list)  # token lists (`Req.fill_ids`)

    def __post_init__(self) -> None:
        self._prefilling = [r.fill_ids for r in self.running if r.kv.kv_len < len(r.prompt_ids)]

    @property
    def decode_reserve(self) -> int:
        return DECODE_RESERVE_TOKENS * len(self.running)

    def has_room(self) -> bool:
        """Budget and a request seat left: worth looking at the next waiting request."""
        return self.budget.prefill_tokens > 0 and len(self.running) + len(self.admitted) < self.max_running

    def should_defer(self, req: Req) -> bool:
        """Would admitting `req` now recompute a prefix another request is computing this step? That
        is, does another one begin with the same `cached_len + IN_BATCH_PREFIX_TOKENS` tokens (one
        list comparison each, which stops where they part)."""
        shared = req.kv.cached_len + IN_BATCH_PREFIX_TOKENS
        ids = req.fill_ids
        if min(len(ids), req.max_prefix_len) < shared:
            return False
        head = ids[:shared]
        return any(other[:shared] == head for other in self._prefilling)

    def admissible_len(self, req: Req, available_kv: int) -> int:
        """Tokens of `req` to prefill now, or 0: stop admitting (budget or KV short; the order is
        kept, so a long prompt at the head is not starved by shorter ones behind it)."""
        n = self.budget.chunk_len(req.pending_tokens)
        if n <= 0 or available_kv - self.decode_reserve < n:
            return 0
        return n

    def admit(self, req: Req, n: int) -> None:
        self.budget.spend(n)
        self.admitted.append(req)
        self._prefilling.append(req.fill_ids)
