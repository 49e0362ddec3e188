"""The engine seam: what the DSL backend, the framework adapters, the server and the router call.

`Engine` is the implementation; the data-parallel `server.router.Router` offers the same calls
over several replicas, and tests use small doubles. Typing the callers against these protocols,
not `Engine` itself, keeps them off the engine's internals, and lets a reader follow a call from
the LangChain adapter to `Engine.generate`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from .outputs import CacheStats, ChoiceScore, GenerateOutput, StreamChunk
from .sampling_params import SamplingParams


@runtime_checkable
class EngineLike(Protocol):
    """Text in, text out: generation, streaming, scoring, the shared cache's controls, and what a
    frontend shows of the model it serves."""

    @property
    def model_id(self) -> str:
        """The model as the user named it (an HF id, a checkpoint dir or a .gguf file; the embedded
        model's HF id). Frontends show it through `paths.public_model_name`, never a host path."""

    @property
    def context_length(self) -> int: ...

    @property
    def kv_capacity(self) -> int:
        """KV slots one request can have at most (the pool of one replica)."""

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas behind this engine (1 for an `Engine`)."""

    @property
    def is_shutdown(self) -> bool: ...

    @property
    def tokenizer(self) -> Any:
        """The HF tokenizer (its chat template and special tokens are shown to clients)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str: ...

    def generate(self, prompt: Any = None, params: SamplingParams | list[SamplingParams] | None = None, *,
                 input_ids: Any = None, messages: Any = None,
                 timeout: float | None = None) -> GenerateOutput | list[GenerateOutput]: ...

    async def agenerate(self, prompt: Any = None, params: Any = None, *, input_ids: Any = None,
                        messages: Any = None) -> GenerateOutput | list[GenerateOutput]: ...

    def stream(self, prompt: Any = None, params: SamplingParams | None = None, *, input_ids: Any = None,
               messages: Any = None) -> Iterator[StreamChunk]: ...

    def astream(self, prompt: Any = None, params: Any = None, *, input_ids: Any = None,
                messages: Any = None) -> AsyncIterator[StreamChunk]: ...

    def score(self, prefix: str | list[int], continuations: list[str] | list[list[int]], *,
              unconditional: bool = False) -> list[ChoiceScore]: ...

    async def ascore(self, prefix: str | list[int], continuations: list[str] | list[list[int]], *,
                     unconditional: bool = False) -> list[ChoiceScore]: ...

    def cache_stats(self) -> CacheStats: ...

    def flush_cache(self) -> bool: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class LogitsEngine(Protocol):
    """Token-by-token drivers (Guidance): next-token logits over the shared cache."""

    @property
    def context_length(self) -> int: ...

    @property
    def tokenizer(self) -> Any: ...

    def next_token_logits(self, input_ids: list[int]) -> Any: ...

    def cache_stats(self) -> CacheStats: ...
