"""Engine test doubles, in one place, each checked against the seam it stands in for
(`test_engine_like.py`): fast unit tests of the adapters, the server and the GPU check without a
model. End-to-end behaviour is tested against the real Engine in the slow tests.

- `ScriptedEngine` (EngineLike): replies from a script, whitespace words as tokens; records calls.
- `CharEngine` (EngineLike): one char = one token, streams slowly and holds "KV slots" while a
  request runs, so the server's disconnect-aborts are observable.
- `TransformersLogitsEngine` (LogitsEngine): next-token logits by a full HF forward.
- `GpuCheckEngine`: just what `bench.gpu_check` drives (generate, encode, flush_cache, stats).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from radix_backend.errors import ConstraintError, InvalidRequestError, PromptTooLongError
from radix_backend.outputs import CacheStats, ChoiceScore, GenerateOutput, RequestMeta, StreamChunk, TokenLogprob
from radix_backend.sampling_params import SamplingParams
from radix_backend.utils import common_prefix_len

KV_SLOTS = 4096


def cache_stats(prompt_tokens: int, cached_tokens: int, *, used: int = 0, nodes: int = 0) -> CacheStats:
    """A fake's counters as the engine reports them."""
    return CacheStats(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                      hit_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0, nodes=nodes, evictions=0,
                      slots_total=KV_SLOTS, slots_used=used, slots_free=KV_SLOTS - used, cached_slots=0)


def protocol_members(protocol: type) -> list[str]:
    return [name for name in vars(protocol) if not name.startswith("_")]


def assert_implements(cls: type, protocol: type) -> None:
    """`cls` has every member of `protocol` (a property may be an annotated instance attribute),
    and its methods take the protocol's parameters, by name and in order."""
    annotated = {k for c in cls.__mro__ for k in getattr(c, "__annotations__", {})}
    for name in protocol_members(protocol):
        assert hasattr(cls, name) or name in annotated, f"{cls.__name__} lacks {protocol.__name__}.{name}"
        want = getattr(protocol, name)
        if isinstance(want, property):
            continue
        have_params = list(inspect.signature(getattr(cls, name)).parameters)
        want_params = list(inspect.signature(want).parameters)
        assert have_params[:len(want_params)] == want_params, f"{cls.__name__}.{name}{have_params} vs {want_params}"


class _Identity:
    """The model facts every EngineLike double shows."""

    model_id: str = "fake/model"
    context_length: int = 2048
    kv_capacity: int = KV_SLOTS
    dp_size: int = 1
    is_shutdown: bool = False
    tokenizer: Any = None  # no HF tokenizer: no chat template is shown to clients

    def shutdown(self) -> None:
        self.is_shutdown = True


# ---------------------------------------------------------------------------------- ScriptedEngine

Reply = Callable[[str, SamplingParams], str]


@dataclass
class Call:
    kind: str  # "generate" | "agenerate" | "stream" | "astream"
    prompts: list[str]  # rendered prompts (chat template applied)
    params: list[SamplingParams]


@dataclass
class ScriptedEngine(_Identity):
    """Replies come from a script (a list, or a function of the rendered prompt and params);
    `cached_tokens` is the longest word prefix shared with any earlier prompt. Every call is
    recorded, so tests check what the adapters send (one batch call, stop strings, sampling
    values, JSON schemas)."""

    replies: list[str] | Reply = field(default_factory=lambda: ["ok"])
    context_length: int = 2048
    calls: list[Call] = field(default_factory=list)
    _seen: list[list[str]] = field(default_factory=list)
    _prompt_tokens: int = 0
    _cached_tokens: int = 0
    _next: int = 0

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [hash(w) % 50000 for w in text.split()]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise InvalidRequestError("ScriptedEngine's tokens are hashes of words; they cannot be decoded")

    def cache_stats(self) -> CacheStats:
        return cache_stats(self._prompt_tokens, self._cached_tokens, nodes=len(self._seen))

    def flush_cache(self) -> bool:
        self._seen.clear()
        return True

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
        self._prompt_tokens += len(words)
        self._cached_tokens += cached
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

    def generate(self, prompt: Any = None, params: Any = None, *, input_ids: Any = None, messages: Any = None,
                 timeout: float | None = None) -> GenerateOutput | list[GenerateOutput]:
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

    def score(self, prefix: str | list[int], continuations: list[str] | list[list[int]], *,
              unconditional: bool = False) -> list[ChoiceScore]:
        """Shorter continuations score higher (-1 per word)."""
        return [ChoiceScore(text=str(c), token_ids=self.encode(str(c)), token_logprobs=[-1.0] * len(str(c).split()))
                for c in continuations]

    async def ascore(self, prefix: str | list[int], continuations: list[str] | list[list[int]], *,
                     unconditional: bool = False) -> list[ChoiceScore]:
        return self.score(prefix, continuations, unconditional=unconditional)


# ---------------------------------------------------------------------------------- CharEngine

class CharEngine(_Identity):
    """One char = one token; the answer is a deterministic function of the prompt."""

    context_length = 400

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.held: dict[int, int] = {}  # request -> slots held
        self.seen: list[list[int]] = []
        self.aborted = 0
        self.finished = 0
        self._next = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in token_ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools: Any = None) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    @staticmethod
    def answer_for(text: str) -> str:
        return f"[{text[-6:]}] lorem ipsum dolor sit amet " * 4

    def _prepare(self, prompt: Any, params: SamplingParams | None, input_ids: Any,
                 messages: Any) -> tuple[list[int], str, SamplingParams]:
        params = params or SamplingParams()
        params.validate()
        if messages is not None:
            prompt = self.apply_chat_template(messages)
        ids = list(input_ids) if input_ids is not None else self.encode(prompt)
        if len(ids) + params.max_new_tokens > self.context_length:
            raise PromptTooLongError(f"{len(ids)} prompt tokens + max_new_tokens exceed {self.context_length}")
        if params.json_schema is not None:
            schema = params.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ConstraintError(f"json_schema is not valid JSON: {exc}") from exc
            if not isinstance(schema, dict) or schema.get("type") not in ("object", None):
                raise ConstraintError("json_schema: unsupported schema")
            answer = '{"ok": true}'
        else:
            answer = self.answer_for(self.decode(ids))
        return ids, answer, params

    async def astream(self, prompt: Any = None, params: Any = None, *, input_ids: Any = None,
                      messages: Any = None) -> AsyncIterator[StreamChunk]:
        ids, answer, params = self._prepare(prompt, params, input_ids, messages)
        rid = self._next
        self._next += 1
        cached = max((common_prefix_len(ids, s) for s in self.seen), default=0)
        self.seen.append(ids)
        self.prompt_tokens += len(ids)
        self.cached_tokens += cached
        self.held[rid] = len(ids)
        finished = False
        try:
            window = answer[: params.max_new_tokens]
            reason, matched, text = ("stop" if len(answer) <= params.max_new_tokens else "length"), None, window
            hits = [(window.find(s), s) for s in params.stop if s in window]
            if hits:
                pos, matched = min(hits)
                reason, text = "stop", window[:pos]
            n_tokens = len(text) + (len(matched) if matched else 0)
            for ch in text:
                await asyncio.sleep(self.delay)
                self.held[rid] += 1
                yield StreamChunk(text=ch, token_ids=[ord(ch)])
            finished = True
            meta = RequestMeta(prompt_tokens=len(ids), cached_tokens=cached, completion_tokens=n_tokens,
                               matched_stop=matched)
            yield StreamChunk(text="", token_ids=[], finish_reason=reason, meta=meta)
        finally:
            del self.held[rid]
            if finished:
                self.finished += 1
            else:
                self.aborted += 1

    async def agenerate(self, prompt: Any = None, params: Any = None, *, input_ids: Any = None,
                        messages: Any = None) -> GenerateOutput | list[GenerateOutput]:
        if isinstance(prompt, list):
            return [await self.agenerate(p, params) for p in prompt]
        text, ids, last = "", [], None
        async for chunk in self.astream(prompt, params, input_ids=input_ids, messages=messages):
            text += chunk.text
            ids += chunk.token_ids
            last = chunk
        assert last is not None and last.meta is not None
        lps = None
        if params is not None and params.logprobs:
            lps = [TokenLogprob(t, -0.25, [(t, -0.25), (ord("?"), -3.0)][: params.top_logprobs]) for t in ids]
        return GenerateOutput(text=text, token_ids=ids, finish_reason=last.finish_reason, meta=last.meta, logprobs=lps)

    def generate(self, prompt: Any = None, params: Any = None, *, input_ids: Any = None, messages: Any = None,
                 timeout: float | None = None) -> GenerateOutput | list[GenerateOutput]:
        return asyncio.run(self.agenerate(prompt, params, input_ids=input_ids, messages=messages))

    def stream(self, prompt: Any = None, params: Any = None, *, input_ids: Any = None,
               messages: Any = None) -> Iterator[StreamChunk]:
        out = self.generate(prompt, params, input_ids=input_ids, messages=messages)
        yield StreamChunk(text=out.text, token_ids=out.token_ids, finish_reason=out.finish_reason, meta=out.meta)

    def score(self, prefix: Any, continuations: Any, *, unconditional: bool = False) -> list[ChoiceScore]:
        return [ChoiceScore(text=self.decode(c), token_ids=list(c), token_logprobs=[-0.5] * len(c))
                for c in continuations]

    async def ascore(self, prefix: Any, continuations: Any, *, unconditional: bool = False) -> list[ChoiceScore]:
        return self.score(prefix, continuations, unconditional=unconditional)

    def cache_stats(self) -> CacheStats:
        return cache_stats(self.prompt_tokens, self.cached_tokens, used=sum(self.held.values()), nodes=len(self.seen))

    def flush_cache(self) -> bool:
        if self.held:
            return False
        self.seen.clear()
        return True


# ---------------------------------------------------------------------------------- TransformersLogitsEngine

class TransformersLogitsEngine:
    """`next_token_logits` by a full forward pass of an HF causal LM (no KV reuse; nothing is
    reported cached). Lets tests compare our guidance backend with guidance's own transformers
    backend on the same (tiny) weights."""

    context_length: int
    tokenizer: Any

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.context_length = int(getattr(model.config, "max_position_embeddings", 2048))
        self.calls: list[list[int]] = []
        self._prompt_tokens = 0

    def next_token_logits(self, input_ids: list[int]) -> Any:
        import torch

        self.calls.append(list(input_ids))
        self._prompt_tokens += len(input_ids)
        with torch.inference_mode():
            return self.model(input_ids=torch.tensor([input_ids])).logits[0, -1].float()

    def cache_stats(self) -> CacheStats:
        return cache_stats(self._prompt_tokens, 0)


# ---------------------------------------------------------------------------------- GpuCheckEngine

@dataclass
class _Out:
    text: str
    token_ids: list[int]


@dataclass
class GpuCheckEngine:
    """Deterministic stand-in for `bench.gpu_check`'s engine factory: counts a prompt's characters
    as its tokens, half of them cached.

    `chat=False` mimics an engine without encode()/messages, which forces gpu_check's built-in
    prompts; `chat=True` takes the project's workloads (bench.workloads via core_bench).
    """

    backend: str
    chat: bool = False
    prompts: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def encode(self, text):
        if not self.chat:
            raise AttributeError("no tokenizer")
        return text.split()

    def generate(self, prompts=None, params=None, *, messages=None):
        if messages is not None:
            if not self.chat:
                raise TypeError("no chat support")
            prompts = ["\n".join(m["content"] for m in conv) for conv in messages]
        self.prompts += prompts
        self.prompt_tokens += sum(len(p) for p in prompts)
        self.cached_tokens += sum(len(p) // 2 for p in prompts)
        offset = 0 if self.backend == "torch" else 1
        return [_Out(text=p[-3:], token_ids=[len(p) + offset] * params.max_new_tokens) for p in prompts]

    def flush_cache(self):
        return True

    def cache_stats(self) -> CacheStats:
        return cache_stats(self.prompt_tokens, self.cached_tokens)
