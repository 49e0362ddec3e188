"""Engine: the thread-safe public front of the runtime (SKELETON: signatures are the contract).

Implementation lands in the core-engine work; adapters, the DSL and the server code against
exactly these signatures.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .outputs import ChoiceScore, GenerateOutput, StreamChunk
from .sampling_params import SamplingParams

Prompt = str
Message = dict[str, Any]  # {"role": "system"|"user"|"assistant", "content": str}


@dataclass
class CacheStats:
    prompt_tokens: int  # prompt tokens seen by the scheduler
    cached_tokens: int  # of those, served from the radix cache
    hit_rate: float  # cached_tokens / prompt_tokens
    nodes: int
    evictions: int  # evicted tokens
    slots_total: int
    slots_used: int  # held by running requests or by the tree
    slots_free: int
    cached_slots: int  # owned by the radix tree


class Engine:
    def __init__(self, model: str | None = None, *, device: str = "auto", dtype: str = "auto",
                 kv_cache_tokens: int | None = None, mem_fraction: float | None = None, page_size: int = 1,
                 schedule_policy: str = "lpm", attention_backend: str = "auto", max_running_requests: int = 64,
                 chunked_prefill_tokens: int = 2048, disable_radix_cache: bool = False, seed: int = 0) -> None: ...

    # Tokenizer helpers (transformers tokenizer underneath: `engine.tokenizer`).
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str: ...
    @property
    def context_length(self) -> int: ...

    # Generation: exactly one of prompt / input_ids / messages; a list prompt (or list of lists
    # of ids, or list of message lists) gives a list of outputs, submitted as one batch.
    def generate(self, prompt: Prompt | list[Prompt] | None = None, params: SamplingParams | list[SamplingParams] | None = None,
                 *, input_ids: list[int] | list[list[int]] | None = None,
                 messages: list[Message] | list[list[Message]] | None = None) -> GenerateOutput | list[GenerateOutput]: ...
    async def agenerate(self, prompt=None, params=None, *, input_ids=None, messages=None): ...
    def stream(self, prompt: Prompt | None = None, params: SamplingParams | None = None, *,
               input_ids: list[int] | None = None, messages: list[Message] | None = None) -> Iterator[StreamChunk]: ...
    async def astream(self, prompt=None, params=None, *, input_ids=None, messages=None) -> AsyncIterator[StreamChunk]: ...

    # Scoring for `select`: the prefix is computed once and shared by all continuations.
    def score(self, prefix: Prompt | list[int], continuations: list[str] | list[list[int]], *,
              unconditional: bool = False) -> list[ChoiceScore]: ...

    def cache_stats(self) -> CacheStats: ...
    def flush_cache(self) -> bool: ...
    def shutdown(self) -> None: ...
    def __enter__(self) -> "Engine": ...
    def __exit__(self, *exc) -> None: ...


def get_engine(model: str | None = None, **kwargs: Any) -> Engine:
    """The process-wide shared engine for `model` (created on first use), so every adapter and DSL
    program in one process shares one radix cache."""
    ...
