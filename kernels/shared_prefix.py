"""Find the KV that several requests of one batch share, so attention reads it once for all of them.

Requests that continue one radix-tree node hold the very same KV slots for that prefix. Attention
over a shared prefix is then one matrix product of all their queries with one copy of the prefix
K/V (FlashInfer's cascade attention, Hydragen), instead of one gather and one product per request;
each request's own remainder is attended separately and the two parts are merged through their
log-sum-exp. The plan is built once per forward from the slot tables and used by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Below this many shared tokens a separate prefix pass costs more than it saves.
MIN_SHARED_TOKENS = 32


@dataclass
class SharedPrefix:
    """Requests `members` (batch indices) all start with the KV at `slots` (length `length`)."""

    members: torch.Tensor  # [m] int64 batch indices
    slots: torch.Tensor  # [length] int64 KV slots
    contiguous_start: int | None  # slots == arange(start, start + length): read as a view, no copy

    @property
    def length(self) -> int:
        return int(self.slots.shape[0])


def find_shared_prefixes(kv_indices: torch.Tensor, kv_indptr: list[int], prefix_lens: list[int],
                         min_tokens: int = MIN_SHARED_TOKENS) -> tuple[list[SharedPrefix], list[int]]:
    """Group requests by their first KV slot and take each group's longest common slot prefix.

    Returns the groups worth a shared pass and, per request, how many leading tokens a group
    covers (0 for requests in none). Only cached tokens (< prefix_lens[i]) can be shared, so every
    query of a member sees the whole shared prefix: no causal mask is needed there.
    """
    slots = kv_indices.cpu()
    shared_len = [0] * len(prefix_lens)
    by_first: dict[int, list[int]] = {}
    for i, prefix in enumerate(prefix_lens):
        if prefix >= min_tokens:
            by_first.setdefault(int(slots[kv_indptr[i]]), []).append(i)
    groups: list[SharedPrefix] = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        limit = min(prefix_lens[i] for i in members)
        rows = torch.stack([slots[kv_indptr[i]:kv_indptr[i] + limit] for i in members])
        differs = (rows != rows[0]).any(dim=0)
        length = int(differs.nonzero()[0, 0]) if bool(differs.any()) else limit
        if length < min_tokens:
            continue
        prefix_slots = rows[0, :length]
        first = int(prefix_slots[0])
        contiguous = bool(torch.equal(prefix_slots, torch.arange(first, first + length)))
        groups.append(SharedPrefix(torch.tensor(members, dtype=torch.int64), prefix_slots.to(kv_indices.device),
                                   first if contiguous else None))
        for i in members:
            shared_len[i] = length
    return groups, shared_len


def read_slots(cache: torch.Tensor, slots: torch.Tensor, contiguous_start: int | None) -> torch.Tensor:
    """cache[slots] without a copy when the slots are one run."""
    if contiguous_start is not None:
        return cache.narrow(0, contiguous_start, slots.shape[0])
    return cache.index_select(0, slots)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
           causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns the log-sum-exp of the scores, for merging.

    q [B, H, M, D], k/v [B, H, L, D] (same heads), mask additive, broadcastable to [B, H, M, L];
    `causal`: query i sees keys 0..i -> (out [B, H, M, D], lse [B, H, M, 1]). On CPU this is
    torch's flash-attention kernel, which returns the log-sum-exp itself; elsewhere the formula.
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        return out, lse.unsqueeze(-1).to(q.dtype)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores.add_(mask)
    if causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu_(1)
        scores.masked_fill_(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores.sub_(lse)), v), lse


def attend_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: torch.Tensor | None = None, with_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One new token per request, its query heads grouped by KV head: q [B, Hkv, G, D] against
    k/v [B, Hkv, L, D] (a view with any stride along L's parent), mask additive broadcastable to
    [B, Hkv, G, L] -> (out [B, Hkv, G, D], lse [B, Hkv, G, 1]). Two batched matmuls: on the CPU about
    twice as fast as the flash kernel for a single query row (which also repeats K/V per head).
    Without `with_lse` the softmax is one fused op and lse is None. Below fp32 the scores of a
    half-precision matmul would be rounded to it, and K/V laid out [B, L, Hkv, D] (a fresh gather)
    would be copied by matmul: those run `attend` (flash kernel: fp32 accumulation, any strides)."""
    batch_mergeable = k.stride(0) == k.shape[1] * k.stride(1)  # else matmul would copy K/V first
    if q.dtype != torch.float32 or not batch_mergeable:
        out, lse = attend(q, k, v, scale, mask)
        return out, lse if with_lse else None
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    if mask is not None:
        scores.add_(mask)
    if not with_lse:
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v), None
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores.sub_(lse)).to(v.dtype)
    return torch.matmul(probs, v), lse.to(q.dtype)


def attend_after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's new tokens: q [1, H, E, D] at positions prefix..prefix+E-1 of k/v [1, H, L, D]
    (L = prefix + E). Split into the prefix, which every query sees whole, and the new tokens,
    causal among themselves, so both parts run without an explicit mask."""
    extend = q.shape[2]
    if prefix == 0:
        return attend(q, k, v, scale, causal=True)
    if extend == 1:
        return attend(q, k, v, scale)
    out_a, lse_a = attend(q, k[:, :, :prefix], v[:, :, :prefix], scale)
    out_b, lse_b = attend(q, k[:, :, prefix:], v[:, :, prefix:], scale, causal=True)
    return merge(out_a, lse_a, out_b, lse_b), torch.logaddexp(lse_a, lse_b)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Combine attention over two disjoint key sets from their outputs and log-sum-exps."""
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse) + out_b * torch.exp(lse_b - lse)
