"""Plain result records returned by the engine."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestMeta:
    """Accounting for one request; `cached_tokens` were served from the radix cache."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_time_s: float = 0.0
    first_token_time_s: float = 0.0  # from submit to first generated token
    total_time_s: float = 0.0
    decode_steps: int = 0  # forward steps that produced tokens (jump-forward tokens need none)
    matched_stop: str | int | None = None


@dataclass
class GenerateOutput:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    meta: RequestMeta
    logprobs: list[TokenLogprob] | None = None
    request_id: str = ""
    prompt_logprobs: list[float] | None = None  # log p(prompt[i] | prompt[:i]) from the requested start
    next_token_logits: "torch.Tensor | None" = None  # [vocab] float32 after the last token, when asked for


@dataclass
class StreamChunk:
    """One streamed increment; `finish_reason` is set on the last chunk only."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    meta: RequestMeta | None = None
    logprobs: list[TokenLogprob] | None = None  # of this chunk's tokens, when SamplingParams.logprobs


@dataclass
class ChoiceScore:
    """Log-likelihood of one continuation after a shared prefix (what `select` needs)."""

    text: str
    token_ids: list[int]
    token_logprobs: list[float]  # log p(token_i | prefix, tokens_<i)
    unconditional_logprobs: list[float] | None = None  # same tokens with no prefix (for unconditional normalization)

    @property
    def total_logprob(self) -> float:
        return float(sum(self.token_logprobs))

    @property
    def normalized_logprob(self) -> float:
        return self.total_logprob / max(1, len(self.token_logprobs))



@dataclass
class SchedulerStats:
    """The scheduler's running counters."""

    prompt_tokens: int = 0  # prompt tokens seen by the scheduler
    cached_tokens: int = 0  # of those, served from the radix cache
    forward_steps: int = 0
    generated_tokens: int = 0
    retractions: int = 0
    finished_requests: int = 0
    spec_verified_steps: int = 0  # decode steps of a request that verified draft tokens
    spec_draft_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # of those, accepted (each one a token without a step of its own)


@dataclass
class KVUsage:
    """What the KV pool and the radix tree hold, in tokens."""

    nodes: int = 0
    evictions: int = 0  # evicted tokens, all time
    slots_total: int = 0
    slots_used: int = 0  # held by running requests or by the tree
    slots_free: int = 0
    cached_slots: int = 0  # owned by the radix tree


@dataclass
class CacheStats(KVUsage, SchedulerStats):
    """The engine's cache and scheduler figures at one moment (`Engine.cache_stats()`)."""

    hit_rate: float = 0.0  # cached_tokens / prompt_tokens
    spec_acceptance_rate: float = 0.0  # spec_accepted_tokens / spec_draft_tokens
    spec_tokens_per_step: float = 0.0  # tokens a drafted step gave: 1 + accepted draft tokens, on average
    running_requests: int = 0
    waiting_requests: int = 0
    disk_hit_tokens: int = 0  # prompt tokens whose KV was loaded from the disk tier (counted in cached_tokens too)
    disk_bytes_read: int = 0
    disk_bytes_written: int = 0
    disk_load_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
