"""The small interface the DSL interpreter needs from a model (cf. sglang.lang.backend.base_backend).

A backend turns prompt text into completions and scores continuations. Everything else
(roles, variables, forks, streaming, batching of forks) lives in the interpreter. To plug in a
new model server implement `generate` and `score`; the rest has working defaults.

Programs under `run_async` call the `a`-prefixed twins (see `lang.async_bridge`); by default they
run the synchronous method on a worker thread, and a backend with an async API overrides them.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator
from typing import Any

from radix_backend.outputs import ChoiceScore, GenerateOutput, StreamChunk
from radix_backend.sampling_params import SamplingParams

from ..chat_template import ChatTemplate, default_template
from ..errors import UnsupportedFeatureError


class BaseBackend(ABC):
    @abstractmethod
    def generate(self, prompts: list[str], params: list[SamplingParams]) -> list[GenerateOutput]:
        """Complete every prompt (one batch; branches of a fork arrive here together)."""

    @abstractmethod
    def score(self, prefix: str, continuations: list[str], *, unconditional: bool = False) -> list[ChoiceScore]:
        """Per-token logprobs of each continuation after `prefix` (the prefix computed once)."""

    def generate_stream(self, prompt: str, params: SamplingParams) -> Iterator[StreamChunk]:
        """Incremental text of one completion; the last chunk carries finish_reason and meta."""
        out = self.generate([prompt], [params])[0]
        yield StreamChunk(text=out.text, token_ids=out.token_ids, finish_reason=out.finish_reason, meta=out.meta)

    def prompt_logprobs(self, prompt: str, start: int) -> list[tuple[float | None, int]]:
        """SGLang's input_token_logprobs: (logprob, token id) of each prompt token from `start` (the
        first prompt token has None). For gen(return_logprob=True, logprob_start_len=...)."""
        raise UnsupportedFeatureError(f"{type(self).__name__} cannot report prompt logprobs (logprob_start_len)")

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """The text of each token, for gen(return_text_in_logprobs=True)."""
        raise UnsupportedFeatureError(f"{type(self).__name__} cannot report token texts (return_text_in_logprobs)")

    def get_chat_template(self) -> ChatTemplate:
        return default_template()

    # ---- async twins -----------------------------------------------------------------------
    async def agenerate(self, prompts: list[str], params: list[SamplingParams]) -> list[GenerateOutput]:
        return await asyncio.to_thread(self.generate, prompts, params)

    async def ascore(self, prefix: str, continuations: list[str], *, unconditional: bool = False) -> list[ChoiceScore]:
        return await asyncio.to_thread(lambda: self.score(prefix, continuations, unconditional=unconditional))

    async def agenerate_stream(self, prompt: str, params: SamplingParams) -> AsyncIterator[StreamChunk]:
        chunks, done = self.generate_stream(prompt, params), object()
        try:
            while (chunk := await asyncio.to_thread(next, chunks, done)) is not done:
                yield chunk  # type: ignore[misc]
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    async def aprompt_logprobs(self, prompt: str, start: int) -> list[tuple[float | None, int]]:
        return await asyncio.to_thread(self.prompt_logprobs, prompt, start)

    async def atoken_texts(self, token_ids: list[int]) -> list[str]:
        return await asyncio.to_thread(self.token_texts, token_ids)

    async def acache_prefix(self, prefix: str) -> None:
        await asyncio.to_thread(self.cache_prefix, prefix)

    @property
    def endpoint(self) -> "BaseBackend":
        """SGLang programs reach a runtime's backend as `.endpoint` (`sgl.Runtime(...).endpoint`);
        a backend here is its own endpoint, so that code runs unchanged."""
        return self

    def get_model_name(self) -> str:
        """The served model's name, as SGLang's `RuntimeEndpoint.get_model_name()` reports it."""
        raise UnsupportedFeatureError(f"{type(self).__name__} does not know its model's name")

    def cache_prefix(self, prefix: str) -> None:
        """Put `prefix` in the KV cache (a zero-token generate) so later requests start from a hit."""
        self.generate([prefix], [SamplingParams(max_new_tokens=0)])

    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        """Release what the backend owns (nothing by default)."""

    # ---- SGLang backend calls with no counterpart here: refused with the reason --------------
    def concatenate_and_append(self, src_rids: list[str], dst_rid: str) -> None:
        raise UnsupportedFeatureError(
            "concatenate_and_append (SGLang's KV concatenation of forks) is not supported: "
            "forks.join('concate_and_append') appends the forks' text, and the radix cache reuses what it can")

    def uncache_prefix(self, rid: str) -> None:
        raise UnsupportedFeatureError("uncache_prefix: the radix cache evicts by LRU; flush_cache() empties it")

    def start_profile(self) -> None:
        raise UnsupportedFeatureError(_NO_PROFILER.format("start_profile"))

    def stop_profile(self) -> None:
        raise UnsupportedFeatureError(_NO_PROFILER.format("stop_profile"))


_NO_PROFILER = "{} is not supported: profile the engine with torch.profiler, or measure with `radix-backend bench`"
