"""The one attention-backend interface every backend (torch, triton, flashinfer) implements.

A forward batch is ragged: request i contributes `extend_lens[i]` new query tokens (1 for a
decode step) that sit at positions `prefix_lens[i] .. seq_lens[i]-1` of its sequence and attend
causally to the whole sequence, whose KV slots are `kv_indices[kv_indptr[i]:kv_indptr[i+1]]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    qo_indptr: torch.Tensor  # [B+1] int64: request i's new tokens are q[qo_indptr[i]:qo_indptr[i+1]]
    kv_indptr: torch.Tensor  # [B+1] int64: offsets into kv_indices
    kv_indices: torch.Tensor  # [sum(seq_lens)] int64: KV slot of every token of every sequence (prefix + new)
    prefix_lens: torch.Tensor  # [B] int64: tokens already in the KV cache before this forward
    extend_lens: torch.Tensor  # [B] int64: new tokens this forward (1 = decode)
    seq_lens: torch.Tensor  # [B] int64: prefix_lens + extend_lens
    out_slots: torch.Tensor  # [T] int64: where the new tokens' K/V are written
    # Host copies, so backends can plan without device syncs.
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.out_slots.shape[0])

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens_cpu)

    @property
    def seq_lens_cpu(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens_cpu, self.extend_lens_cpu)]

    @classmethod
    def build(cls, prefix_lens: list[int], extend_lens: list[int], kv_indices: torch.Tensor,
              out_slots: torch.Tensor, device: torch.device | str) -> "AttentionMetadata":
        """Build the metadata from host lists; kv_indices/out_slots already on `device`."""
        seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
        def cumsum(xs: list[int]) -> torch.Tensor:
            out = [0]
            for x in xs:
                out.append(out[-1] + x)
            return torch.tensor(out, dtype=torch.int64, device=device)
        return cls(
            qo_indptr=cumsum(extend_lens),
            kv_indptr=cumsum(seq),
            kv_indices=kv_indices,
            prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64, device=device),
            extend_lens=torch.tensor(extend_lens, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(seq, dtype=torch.int64, device=device),
            out_slots=out_slots,
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=list(extend_lens),
        )


@dataclass(frozen=True)
class ScoreMask:
    """What a layer's attention adds to plain causal attention; None fields are off."""

    window: int | None = None  # a query sees its last `window` keys, itself included
    softcap: float | None = None  # scores -> softcap * tanh(score / softcap), before the mask

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"sliding window must be >= 1, got {self.window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"attention softcap must be > 0, got {self.softcap}")

    @property
    def plain(self) -> bool:
        return self.window is None and self.softcap is None

    def changes(self, meta: AttentionMetadata) -> bool:
        """Whether this batch attends differently from plain causal attention (a window no
        sequence outgrows changes nothing)."""
        if self.softcap is not None:
            return True
        return self.window is not None and max(meta.seq_lens_cpu, default=0) > self.window


PLAIN = ScoreMask()


class AttentionBackend(ABC):
    """Computes attention for one layer of a ragged batch over the paged KV cache."""

    name: str = "base"
    _plan: Any = None  # what begin_forward made: an object with the `meta` it was made for

    def begin_forward(self, meta: AttentionMetadata) -> None:
        """Plan once per forward batch (shared by all layers). Default: nothing to plan."""

    def _plan_for(self, meta: AttentionMetadata) -> Any:
        """The plan of this forward: `begin_forward`'s, or made now when `forward` comes unplanned."""
        if self._plan is None or self._plan.meta is not meta:
            self.begin_forward(meta)
        return self._plan

    def native_decode_slots(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """After `begin_forward(meta)`: (starts, lens) into meta.kv_indices of each request's keys
        when this decode step may run attention natively over the pool in place with no shared-
        prefix pass (see kernels/decode_stack.py); None when it must go through `forward`."""
        return None

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                mask: ScoreMask = PLAIN) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens; k_cache/v_cache [slots, Hkv, D].

        Writes k/v into the cache at meta.out_slots, then returns attention output [T, Hq, D]
        under the layer's `mask` (a sliding window, soft-capped scores; see masked_attention.py).
        """

    @staticmethod
    def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        k_cache.index_copy_(0, meta.out_slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.out_slots, v.to(v_cache.dtype))
