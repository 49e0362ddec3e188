"""SamplingParams: the per-request knobs, validated once at submit time."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .errors import InvalidRequestError


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one request (names follow SGLang / vLLM)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    # Constraints (compiled by radix_backend.constrained through llguidance).
    regex: str | None = None
    json_schema: Any = None  # dict, JSON string, or pydantic model class
    grammar: str | None = None  # Lark / EBNF
    choices: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 1e-5 or self.top_k == 1

    @property
    def has_constraint(self) -> bool:
        return any(x is not None for x in (self.regex, self.json_schema, self.grammar, self.choices))

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    def copy(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)

    def validate(self) -> None:
        """Raise InvalidRequestError naming the bad field; called by the engine at submit."""

        def bad(msg: str) -> None:
            raise InvalidRequestError(f"SamplingParams: {msg}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            bad(f"max_new_tokens must be an int >= 0, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            bad(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.top_logprobs < 0 or self.top_logprobs > 20:
            bad(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        if not all(isinstance(s, str) for s in self.stop):
            bad("stop must be a string or a list of strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative ints")
        n_constraints = sum(x is not None for x in (self.regex, self.json_schema, self.grammar, self.choices))
        if n_constraints > 1:
            bad("set at most one of regex, json_schema, grammar, choices")
        if self.choices is not None and (not self.choices or not all(isinstance(c, str) for c in self.choices)):
            bad("choices must be a non-empty list of strings")
