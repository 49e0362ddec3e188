"""ScriptedEngine: a test double with the Engine API, for fast adapter unit tests.

It runs no model: replies come from a script (a list or a function of the rendered prompt and
params), tokens are whitespace words, and `cached_tokens` is the longest word prefix shared with
any earlier prompt. It records every call, so tests can check what the adapters send (one batch
call, stop strings, sampling values, JSON schemas) without loading weights. End-to-end behaviour
is tested against the real Engine in the slow tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from radix_backend.errors import InvalidRequestError
from radix_backend.outputs import GenerateOutput, RequestMeta, StreamChunk
from radix_backend.utils import common_prefix_len
from radix_backend.sampling_params import SamplingParams

Reply = Callable[[str, SamplingParams], str]


@dataclass
class Call:
    kind: str  # "generate" | "agenerate" | "stream" | "astream"
    prompts: list[str]  # rendered prompts (chat template applied)
    params: list[SamplingParams]


@dataclass
class _Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class ScriptedEngine:
    replies: list[str] | Reply = field(default_factory=lambda: ["ok"])
    context_length: int = 2048
    calls: list[Call] = field(default_factory=list)
    _seen: list[list[str]] = field(default_factory=list)
    _stats: _Stats = field(default_factory=_Stats)
    _next: int = 0

    # -- helpers of the Engine API ------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [hash(w) % 50000 for w in text.split()]

    def cache_stats(self) -> _Stats:
        return self._stats

    # -- generation ---------------------------------------------------------------------
    def _render(self, prompt: Any, messages: Any) -> tuple[list[str], bool]:
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("pass exactly one of prompt / messages")
        if messages is not None:
            if messages and isinstance(messages[0], dict):
                return [self.apply_chat_template(messages)], False
            return [self.apply_chat_template(m) for m in messages], True
        if isinstance(prompt, str):
            return [prompt], False
        return list(prompt), True

    def _reply(self, prompt: str, params: SamplingParams) -> str:
        if callable(self.replies):
            return self.replies(prompt, params)
        text = self.replies[min(self._next, len(self.replies) - 1)]
        self._next += 1
        return text

    def _run_one(self, prompt: str, params: SamplingParams) -> GenerateOutput:
        params.validate()
        words = prompt.split()
        cached = max((common_prefix_len(words, seen) for seen in self._seen), default=0)
        self._seen.append(words)
        self._stats.prompt_tokens += len(words)
        self._stats.cached_tokens += cached
        text, finish = self._reply(prompt, params), "stop"
        cut = [text.index(s) for s in params.stop if s in text]
        if cut:
            text = text[:min(cut)]
        out_words = text.split(" ")
        if len(out_words) > params.max_new_tokens:
            text, finish = " ".join(out_words[:params.max_new_tokens]), "length"
        meta = RequestMeta(prompt_tokens=len(words), cached_tokens=cached, completion_tokens=len(text.split()))
        return GenerateOutput(text=text, token_ids=self.encode(text), finish_reason=finish, meta=meta)

    def _params_list(self, params: Any, n: int) -> list[SamplingParams]:
        if isinstance(params, Sequence):
            if len(params) != n:
                raise InvalidRequestError("params list length must match prompts")
            return list(params)
        return [params or SamplingParams()] * n

    def generate(self, prompt: Any = None, params: Any = None, *, input_ids: Any = None,
                 messages: Any = None) -> GenerateOutput | list[GenerateOutput]:
        prompts, many = self._render(prompt, messages)
        plist = self._params_list(params, len(prompts))
        self.calls.append(Call("generate", prompts, plist))
        outs = [self._run_one(p, sp) for p, sp in zip(prompts, plist)]
        return outs if many else outs[0]

    async def agenerate(self, prompt: Any = None, params: Any = None, *, input_ids: Any = None,
                        messages: Any = None) -> GenerateOutput | list[GenerateOutput]:
        await asyncio.sleep(0)
        prompts, many = self._render(prompt, messages)
        plist = self._params_list(params, len(prompts))
        self.calls.append(Call("agenerate", prompts, plist))
        outs = [self._run_one(p, sp) for p, sp in zip(prompts, plist)]
        return outs if many else outs[0]

    def _chunks(self, out: GenerateOutput) -> Iterator[StreamChunk]:
        pieces = [w + " " for w in out.text.split(" ")]
        pieces[-1] = pieces[-1][:-1]
        for piece in pieces[:-1]:
            yield StreamChunk(text=piece, token_ids=self.encode(piece))
        yield StreamChunk(text=pieces[-1], token_ids=self.encode(pieces[-1]), finish_reason=out.finish_reason,
                          meta=out.meta)

    def stream(self, prompt: Any = None, params: Any = None, *, input_ids: Any = None,
               messages: Any = None) -> Iterator[StreamChunk]:
        prompts, _ = self._render(prompt, messages)
        sp = params or SamplingParams()
        self.calls.append(Call("stream", prompts, [sp]))
        yield from self._chunks(self._run_one(prompts[0], sp))

    async def astream(self, prompt: Any = None, params: Any = None, *, input_ids: Any = None,
                      messages: Any = None) -> AsyncIterator[StreamChunk]:
        prompts, _ = self._render(prompt, messages)
        sp = params or SamplingParams()
        self.calls.append(Call("astream", prompts, [sp]))
        for chunk in self._chunks(self._run_one(prompts[0], sp)):
            await asyncio.sleep(0)
            yield chunk


class TransformersLogitsEngine:
    """Test double for the guidance backend: `next_token_logits` by a full forward pass of an HF
    causal LM (no KV reuse; `cache_stats` reports nothing cached). Lets tests compare our guidance
    backend with guidance's own transformers backend on the same (tiny) weights."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.context_length = int(getattr(model.config, "max_position_embeddings", 2048))
        self.calls: list[list[int]] = []
        self._stats = _Stats()

    def next_token_logits(self, input_ids: list[int]) -> Any:
        import torch

        self.calls.append(list(input_ids))
        self._stats.prompt_tokens += len(input_ids)
        with torch.inference_mode():
            return self.model(input_ids=torch.tensor([input_ids])).logits[0, -1].float()

    def cache_stats(self) -> _Stats:
        return self._stats
