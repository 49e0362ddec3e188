"""Engine: the thread-safe public front of the runtime.

Callers on any thread or event loop submit requests; one scheduler thread batches them over
one radix cache. Validation, tokenization and constraint compilation happen in the caller's
thread at submit time, so bad input raises there and never reaches the scheduler.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .config import EngineConfig
from .errors import InvalidRequestError
from .model_executor.loader import EMBEDDED_MODEL_ID, load_tokenizer, resolve_checkpoint, token_decoder
from .model_executor.model_runner import KernelPath, ModelRunner
from .outputs import CacheStats, ChoiceScore, GenerateOutput, StreamChunk
from .request_builder import Message, RequestBuilder, collect_eos_token_ids
from .scheduler.request import RequestHandle
from .sampling_params import SamplingParams
from .scheduler.scheduler import Scheduler

PREP_THREADS = 4  # concurrent request preparations (tokenizing, templating, grammar compiling) per engine

Prompt = str


class Engine:
    """One model, one radix cache, one scheduler thread; share it across the whole process."""

    model_id: str  # the model as the user named it (EngineLike.model_id)
    tokenizer: Any  # the HF tokenizer

    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **overrides: Any) -> None:
        """`model`: None (the embedded SmolLM2-135M), an HF checkpoint dir or a .gguf file.
        `config` and/or keyword `overrides` set the EngineConfig knobs (device, kv_cache_tokens, ...)."""
        self.config = (config or EngineConfig.from_env()).replace(**overrides)
        self.checkpoint = resolve_checkpoint(model)
        self.model_id = model if model is not None else EMBEDDED_MODEL_ID  # as the user named it; no cache paths
        self.tokenizer = load_tokenizer(self.checkpoint)
        self._decode_ids = token_decoder(self.tokenizer)
        self.runner = ModelRunner(self.checkpoint, self.config)
        self.eos_token_ids = collect_eos_token_ids(self.checkpoint.config, self.tokenizer, self.checkpoint.path)
        # async callers' tokenizing, chat templating and grammar compiling run here, off their event loop
        self._prep = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="radix-prep")
        self.scheduler = Scheduler(self.runner, self.config, detokenize=self.decode)
        self.requests = RequestBuilder(self.tokenizer, model_id=self.model_id, vocab_size=self.runner.vocab_size,
                                       context_length=self.runner.context_length, kv_capacity=self.scheduler.kv.total,
                                       eos_token_ids=self.eos_token_ids, seed=self.config.seed)

    # ---- tokenizer helpers --------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.requests.encode(text, add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._decode_ids(token_ids, skip_special_tokens)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        return self.requests.apply_chat_template(messages, add_generation_prompt, tools)

    @property
    def context_length(self) -> int:
        return self.runner.context_length

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def kernel_path(self) -> KernelPath:
        """What runs the model: attention backend, layer ops, linears, decode stack, CUDA graphs."""
        return self.runner.kernel_path

    @property
    def kv_capacity(self) -> int:
        return self.scheduler.kv.total

    @property
    def dp_size(self) -> int:
        return 1

    @property
    def constraint_compiler(self):
        """The llguidance compiler, built on first use (constrained decoding is optional)."""
        return self.requests.constraint_compiler

    def submit(self, prompt: Prompt | None = None, params: SamplingParams | None = None, *,
               input_ids: list[int] | None = None, messages: list[Message] | None = None,
               stream: bool = False) -> RequestHandle:
        """Queue one request and return its handle (`.wait()`, `.iter_chunks()`, `.rid`)."""
        req = self.requests.request(self.requests.prompt_ids(prompt, input_ids, messages), params, stream)
        self.scheduler.submit(req)
        return req.handle

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def _submit_many(self, prompt, params, input_ids, messages) -> tuple[list[RequestHandle], bool]:
        """Normalise single/batch inputs; validate every item before submitting any."""
        batched = (isinstance(prompt, list) or (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list))
                   or (isinstance(messages, list) and messages and isinstance(messages[0], list)))
        if not batched:
            return [self.submit(prompt, params, input_ids=input_ids, messages=messages)], False
        items = prompt if isinstance(prompt, list) else input_ids if input_ids is not None else messages
        if not items:
            raise InvalidRequestError("the batch is empty")
        if isinstance(params, list) and len(params) != len(items):
            raise InvalidRequestError(f"got {len(items)} prompts but {len(params)} SamplingParams")
        reqs = []
        for i, item in enumerate(items):
            p = params[i] if isinstance(params, list) else params
            kw = {"prompt": item} if isinstance(prompt, list) else {"input_ids": item} if input_ids is not None else {"messages": item}
            ids = self.requests.prompt_ids(kw.get("prompt"), kw.get("input_ids"), kw.get("messages"))
            reqs.append(self.requests.request(ids, p, stream=False))
        self.scheduler.submit_all(reqs)
        return [r.handle for r in reqs], True

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, prompt: Prompt | list[Prompt] | None = None,
                 params: SamplingParams | list[SamplingParams] | None = None, *,
                 input_ids: list[int] | list[list[int]] | None = None,
                 messages: list[Message] | list[list[Message]] | None = None,
                 timeout: float | None = None) -> GenerateOutput | list[GenerateOutput]:
        """Generate for one prompt or a batch (a list), blocking until all finish."""
        handles, batched = self._submit_many(prompt, params, input_ids, messages)
        outputs = [h.wait(timeout) for h in handles]
        return outputs if batched else outputs[0]

    async def _off_loop(self, submit: Callable[[], Any]) -> Any:
        """Run `submit` (which tokenizes, templates, compiles grammars and submits requests) on the
        preparation threads: on hostile input that takes seconds, and the caller's event loop (a
        server's, shared by every client) must keep serving. If the caller is cancelled meanwhile,
        whatever `submit` submitted is aborted when it returns."""
        future = asyncio.get_running_loop().run_in_executor(self._prep, submit)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(self._abort_submitted)
            raise

    def _abort_submitted(self, future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        result = future.result()
        for handle in result[0] if isinstance(result, tuple) else [result]:
            self.abort(handle.rid)

    async def agenerate(self, prompt=None, params=None, *, input_ids=None, messages=None):
        """Async `generate`: awaits without blocking the event loop; cancelling aborts the requests."""
        handles, batched = await self._off_loop(lambda: self._submit_many(prompt, params, input_ids, messages))
        outputs = await self._await_all(handles)
        return outputs if batched else outputs[0]

    async def _await_all(self, handles: list[RequestHandle]) -> list[GenerateOutput]:
        """Every handle's output; if the caller is cancelled (or one fails), the unfinished ones abort."""
        try:
            return [await h.await_result() for h in handles]
        except BaseException:
            for h in handles:
                if not h.done:
                    self.abort(h.rid)
            raise

    def stream(self, prompt: Prompt | None = None, params: SamplingParams | None = None, *,
               input_ids: list[int] | None = None, messages: list[Message] | None = None) -> Iterator[StreamChunk]:
        """Yield text increments as they are generated; closing the iterator aborts the request."""
        handle = self.submit(prompt, params, input_ids=input_ids, messages=messages, stream=True)
        try:
            yield from handle.iter_chunks()
        finally:
            if not handle.done:
                self.abort(handle.rid)

    async def astream(self, prompt=None, params=None, *, input_ids=None, messages=None) -> AsyncIterator[StreamChunk]:
        handle = await self._off_loop(lambda: self.submit(prompt, params, input_ids=input_ids, messages=messages,
                                                          stream=True))
        try:
            async for chunk in handle.aiter_chunks():
                yield chunk
        finally:
            if not handle.done:
                self.abort(handle.rid)

    # ---- scoring (select) ----------------------------------------------------------------------
    def score(self, prefix: Prompt | list[int], continuations: list[str] | list[list[int]], *,
              unconditional: bool = False) -> list[ChoiceScore]:
        """Log-likelihood of each continuation after `prefix`; the prefix is computed once."""
        handles, pairs = self._submit_score(prefix, continuations, unconditional)
        return self._choice_scores(continuations, pairs, [h.wait() for h in handles])

    async def ascore(self, prefix: Prompt | list[int], continuations: list[str] | list[list[int]], *,
                     unconditional: bool = False) -> list[ChoiceScore]:
        """Async `score`: awaits without blocking the event loop; cancelling aborts the requests."""
        handles, pairs = await self._off_loop(lambda: self._submit_score(prefix, continuations, unconditional))
        return self._choice_scores(continuations, pairs, await self._await_all(handles))

    def _submit_score(self, prefix, continuations, unconditional: bool) -> tuple[list[RequestHandle], list[tuple[list[int], int]]]:
        """Submit the scoring requests: the shared prefix first (so every continuation hits it), then
        one per continuation, then (unconditional) each continuation alone. Their handles, in that order."""
        if not continuations:
            raise InvalidRequestError("score() needs at least one continuation")
        prefix_ids = self.requests.prompt_ids(prefix, None, None) if isinstance(prefix, str) else self.requests.prompt_ids(None, prefix, None)
        pairs = [self.requests.split_continuation(prefix, prefix_ids, c) for c in continuations]
        head = self.requests.request(prefix_ids, SamplingParams(max_new_tokens=0), stream=False)
        reqs = [self.requests.request(full, SamplingParams(max_new_tokens=0), stream=False, input_logprob_start=start)
                for full, start in pairs]
        if unconditional:
            reqs += [self.requests.request(full[start:], SamplingParams(max_new_tokens=0), stream=False, input_logprob_start=1)
                     for full, start in pairs]
        self.scheduler.submit_all([head] + reqs)
        return [r.handle for r in reqs], pairs

    def _choice_scores(self, continuations, pairs: list[tuple[list[int], int]],
                       outputs: list[GenerateOutput]) -> list[ChoiceScore]:
        results = []
        for i, (full, start) in enumerate(pairs):
            uncond = None
            if len(outputs) > len(pairs):
                uncond = [0.0] + list(outputs[len(pairs) + i].prompt_logprobs or [])
            text = continuations[i] if isinstance(continuations[i], str) else self.decode(full[start:])
            results.append(ChoiceScore(text=text, token_ids=full[start:],
                                       token_logprobs=list(outputs[i].prompt_logprobs or []),
                                       unconditional_logprobs=uncond))
        return results

    def next_token_logits(self, input_ids: list[int]) -> torch.Tensor:
        """Raw float32 logits [vocab] after `input_ids`, computing only what the radix cache lacks.

        The backend for token-by-token drivers such as Guidance: the sequence is inserted into the
        tree, so the next call (one token longer) computes one new token.
        """
        req = self.requests.request(self.requests.prompt_ids(None, input_ids, None), SamplingParams(max_new_tokens=0), stream=False)
        req.return_next_logits = True
        self.scheduler.submit(req)
        out = req.handle.wait()
        assert out.next_token_logits is not None
        return out.next_token_logits

    # ---- cache and lifecycle ---------------------------------------------------------------------
    def cache_stats(self) -> CacheStats:
        return self.scheduler.call(self.scheduler.cache_stats)  # type: ignore[return-value]

    def flush_cache(self) -> bool:
        """Drop every cached prefix in memory; False (and nothing dropped) while requests are in flight.
        The disk tier keeps its files (delete its directory to empty it)."""
        return bool(self.scheduler.call(self.scheduler.flush_cache))

    @property
    def is_shutdown(self) -> bool:
        return self.scheduler.is_stopped

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self._prep.shutdown(wait=False, cancel_futures=True)
        self.runner.shutdown()  # stops tensor-parallel worker processes

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


_shared_engines: dict[str, Engine] = {}
_shared_lock = threading.Lock()


def get_engine(model: str | None = None, **kwargs: Any) -> Engine:
    """The process-wide shared engine for `model` (created on first use), so every adapter and DSL
    program in one process shares one radix cache. `kwargs` apply only on creation."""
    key = str(model)
    with _shared_lock:
        engine = _shared_engines.get(key)
        if engine is None or engine.is_shutdown:
            engine = Engine(model, **kwargs)
            _shared_engines[key] = engine
        return engine
