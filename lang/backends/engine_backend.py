"""RadixEngineBackend: runs DSL programs on the in-process `radix_backend.Engine` (the default).

Every program in the process shares the engine's radix cache: few-shot headers, fork prefixes
and chat system prompts are computed once.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict
from typing import Any

from radix_backend.engine_like import EngineLike
from radix_backend.outputs import ChoiceScore, GenerateOutput, StreamChunk
from radix_backend.paths import public_model_name
from radix_backend.sampling_params import SamplingParams
from radix_backend.sglang_meta import prompt_logprob_pairs, prompt_logprob_split

from ..chat_template import ChatTemplate, from_renderer
from .base import BaseBackend

class RadixEngineBackend(BaseBackend):
    def __init__(self, engine: EngineLike | None = None, *, chat_template: ChatTemplate | None = None) -> None:
        self._engine = engine
        self._chat_template = chat_template
        self._lock = threading.Lock()

    @property
    def engine(self) -> EngineLike:
        """The wrapped engine; the process-shared `get_engine()` one unless given (created on first use)."""
        with self._lock:
            if self._engine is None:
                from radix_backend.engine import get_engine

                self._engine = get_engine()
            return self._engine

    def get_chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            engine = self.engine
            self._chat_template = from_renderer(
                lambda msgs, gen: engine.apply_chat_template(msgs, add_generation_prompt=gen), name="engine"
            )
        return self._chat_template

    def get_model_name(self) -> str:
        """As the server's /get_model_info names it: the model as given, a local path by its own name."""
        return public_model_name(self.engine.model_id)

    def generate(self, prompts: list[str], params: list[SamplingParams]) -> list[GenerateOutput]:
        outs = self.engine.generate(list(prompts), list(params))
        return list(outs) if isinstance(outs, list) else [outs]

    def generate_stream(self, prompt: str, params: SamplingParams) -> Iterator[StreamChunk]:
        yield from self.engine.stream(prompt, params)

    def prompt_logprobs(self, prompt: str, start: int) -> list[tuple[float | None, int]]:
        ids = self.engine.encode(prompt)
        split = prompt_logprob_split(ids, start)
        scored = self.engine.score(split[0], [split[1]])[0].token_logprobs if split else None
        return prompt_logprob_pairs(ids, start, scored)

    async def aprompt_logprobs(self, prompt: str, start: int) -> list[tuple[float | None, int]]:
        ids = self.engine.encode(prompt)
        split = prompt_logprob_split(ids, start)
        scored = (await self.engine.ascore(split[0], [split[1]]))[0].token_logprobs if split else None
        return prompt_logprob_pairs(ids, start, scored)

    # ---- async twins on the engine's own async API (no thread per waiting program) ----------
    async def agenerate(self, prompts: list[str], params: list[SamplingParams]) -> list[GenerateOutput]:
        outs = await self.engine.agenerate(list(prompts), list(params))
        return list(outs) if isinstance(outs, list) else [outs]

    async def agenerate_stream(self, prompt: str, params: SamplingParams) -> AsyncIterator[StreamChunk]:
        async for chunk in self.engine.astream(prompt, params):
            yield chunk

    async def ascore(self, prefix: str, continuations: list[str], *, unconditional: bool = False) -> list[ChoiceScore]:
        return await self.engine.ascore(prefix, list(continuations), unconditional=unconditional)

    async def atoken_texts(self, token_ids: list[int]) -> list[str]:
        return self.token_texts(token_ids)  # the tokenizer, in process: no wait

    async def acache_prefix(self, prefix: str) -> None:
        await self.engine.agenerate(prefix, SamplingParams(max_new_tokens=0))

    def token_texts(self, token_ids: list[int]) -> list[str]:
        return [self.engine.decode([t], skip_special_tokens=False) for t in token_ids]

    def score(self, prefix: str, continuations: list[str], *, unconditional: bool = False) -> list[ChoiceScore]:
        return self.engine.score(prefix, list(continuations), unconditional=unconditional)

    def cache_prefix(self, prefix: str) -> None:
        self.engine.generate(prefix, SamplingParams(max_new_tokens=0))

    def flush_cache(self) -> bool:
        return bool(self.engine.flush_cache())

    def get_server_info(self) -> dict[str, Any]:
        return {"backend": "radix_engine", "cache_stats": asdict(self.engine.cache_stats())}

