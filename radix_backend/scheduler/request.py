"""Per-request state inside the scheduler, and the handle through which results reach callers.

The scheduler thread owns `Req`; callers hold a `RequestHandle` and read results from it
(blocking, or from an asyncio loop) without touching scheduler state.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..mem_cache.kv_manager import RequestSlots
from ..outputs import FinishReason, GenerateOutput, RequestMeta, StreamChunk, TokenLogprob
from ..sampling_params import SamplingParams
from ..stop_regex import StopRegexWatch
from .detokenizer import Decode, IncrementalDetokenizer
from .sampling import SamplerRow
from .speculative import SpecState

_DONE = object()


class RequestHandle:
    """Delivers stream chunks and the final output (or an exception) from the scheduler thread."""

    def __init__(self, rid: str, stream: bool) -> None:
        self.rid = rid
        self.stream = stream
        self._sync: queue.SimpleQueue | None = None
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Queue] | None = None
        self._buffer: list[Any] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.result: GenerateOutput | None = None
        self.error: BaseException | None = None

    # -- producer side (scheduler thread) ---------------------------------------------------
    def _put(self, item: Any) -> None:
        with self._lock:
            if self._async is not None:
                loop, q = self._async
                try:
                    loop.call_soon_threadsafe(q.put_nowait, item)
                except RuntimeError:  # the consumer's loop is closed: nobody is listening
                    pass
            elif self._sync is not None:
                self._sync.put(item)
            else:
                self._buffer.append(item)

    def push_chunk(self, chunk: StreamChunk) -> None:
        if self.stream:
            self._put(chunk)

    def finish(self, output: GenerateOutput) -> None:
        self.result = output
        self._done.set()
        self._put(_DONE)

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._done.set()
        self._put(_DONE)

    # -- consumer side ----------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> GenerateOutput:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.rid} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def _attach_sync(self) -> queue.SimpleQueue:
        with self._lock:
            self._sync = queue.SimpleQueue()
            for item in self._buffer:
                self._sync.put(item)
            self._buffer.clear()
            return self._sync

    def _attach_async(self) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._async = (loop, q)
            for item in self._buffer:
                q.put_nowait(item)
            self._buffer.clear()
        return q

    def iter_chunks(self):
        q = self._attach_sync()
        while True:
            item = q.get()
            if item is _DONE:
                if self.error is not None:
                    raise self.error
                return
            yield item

    async def aiter_chunks(self):
        q = self._attach_async()
        while True:
            item = await q.get()
            if item is _DONE:
                if self.error is not None:
                    raise self.error
                return
            yield item

    async def await_result(self) -> GenerateOutput:
        q = self._attach_async()
        while not self.done:
            if await q.get() is _DONE:
                break
        return self.wait(0)


def _held_back(text: str, end: int, stop: str) -> int:
    """The length of the longest proper prefix of `stop` that `text[:end]` ends with (it may yet
    become the stop string). Candidates are the tail's occurrences of the stop's first character,
    earliest first, so each costs one bounded comparison and the text is never copied whole."""
    i = text.find(stop[0], max(0, end - len(stop) + 1), end)
    while i != -1:
        if stop.startswith(text[i:end]):
            return end - i
        i = text.find(stop[0], i + 1, end)
    return 0


@dataclass(eq=False)  # identity semantics: the scheduler keeps requests in lists
class Req:
    """A request as the scheduler sees it: what was asked, what came out so far, and two
    sub-records, the KV it holds (`kv`) and its incremental text (`detok`)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    handle: RequestHandle
    eos_token_ids: frozenset[int]
    max_total_tokens: int  # context window
    constraint: Any = None  # radix_backend.scheduler.constrained.TokenConstraint or None
    input_logprob_start: int | None = None  # score(): logprobs of prompt tokens from here on
    return_next_logits: bool = False  # next_token_logits(): keep the logits after the last token
    next_logits: torch.Tensor | None = None
    output_ids: list[int] = field(default_factory=list)
    kv: RequestSlots = field(default_factory=RequestSlots)
    admitted_once: bool = False
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    input_logprobs: list[float] = field(default_factory=list)
    generator: torch.Generator | None = None
    detok: IncrementalDetokenizer = field(default_factory=IncrementalDetokenizer)
    stop_check_from: int = 0  # text before this was produced below min_new_tokens: stop regexes skip it
    stop_regexes: StopRegexWatch | None = None  # linear-time matchers, made once stops may count
    _final: RequestMeta | None = None  # the finished request's accounting, taken once (final_meta)
    sent_text_len: int = 0
    sent_token_len: int = 0
    meta: RequestMeta = field(default_factory=RequestMeta)
    submit_time: float = field(default_factory=time.perf_counter)
    error: BaseException | None = None
    spec: SpecState = field(default_factory=SpecState)  # speculative decoding: context index, acceptance

    @property
    def text(self) -> str:
        return self.detok.text

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def computed_ids(self) -> list[int]:
        """The tokens whose KV the request holds (`kv.slots[i]` is token i's)."""
        return self.fill_ids[:self.kv.kv_len]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending_tokens(self) -> int:
        """Tokens whose KV is not computed yet."""
        return self.seq_len - self.kv.kv_len

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.params.max_new_tokens - len(self.output_ids))

    @property
    def max_prefix_len(self) -> int:
        """Longest prefix that may come from the cache: the last token (and any token whose
        logits we must return) has to be recomputed."""
        limit = self.seq_len - 1
        if self.input_logprob_start is not None and self.kv.kv_len < self.input_logprob_start:
            limit = min(limit, max(0, self.input_logprob_start - 1))
        return max(0, limit)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def sampler_row(self) -> SamplerRow:
        """What the sampler needs of this request for its next token."""
        return SamplerRow(self.params, self.output_ids, self.prompt_ids, self.generator,
                          suppressed=self.stop_token_ids if self.below_min_tokens else set(),
                          constraint=self.constraint)

    @property
    def picks_by_argmax(self) -> bool:
        """Its next tokens are the plain argmax of the model's logits (`SamplerRow.argmax_only`) and it
        keeps no logits, so the LM head may compute only what decides the argmax (kernels/head_screen.py)."""
        return not self.return_next_logits and self.sampler_row().argmax_only

    def record_input_logprobs(self, rows: torch.Tensor, start: int) -> None:
        """Append the logprobs of the prompt tokens that `rows` (logits from position
        max(start, input_logprob_start - 1) on) predict."""
        first = max(start, self.input_logprob_start - 1)  # type: ignore[operator]
        targets = self.prompt_ids[first + 1:first + 1 + rows.shape[0]]
        lp = torch.log_softmax(rows.float(), dim=-1)
        self.input_logprobs.extend(lp.gather(1, torch.tensor(targets, device=lp.device)[:, None]).squeeze(1).tolist())

    # -- finishing rules ----------------------------------------------------------------------
    def append_token(self, token: int) -> None:
        self.output_ids.append(token)
        self.check_token_stop(token)

    @property
    def stop_token_ids(self) -> set[int]:
        """Tokens that finish the request when sampled: EOS (unless ignored) and `stop_token_ids`."""
        eos = set() if self.params.ignore_eos else set(self.eos_token_ids)
        return eos | set(self.params.stop_token_ids)

    @property
    def below_min_tokens(self) -> bool:
        """Fewer outputs than `min_new_tokens`: stop tokens, strings and regexes do not count yet."""
        return len(self.output_ids) < self.params.min_new_tokens

    def check_token_stop(self, token: int) -> None:
        """Finish on EOS / stop ids / length / context after appending `token`."""
        p = self.params
        stops_count = len(self.output_ids) > p.min_new_tokens  # `token` is not one of the first min_new_tokens
        if stops_count and not p.ignore_eos and token in self.eos_token_ids:
            self.finish_reason, self.matched_stop = "stop", token
        elif stops_count and token in p.stop_token_ids:
            self.finish_reason, self.matched_stop = "stop", token
        elif len(self.output_ids) >= p.max_new_tokens or self.seq_len >= self.max_total_tokens:
            self.finish_reason = "length"

    def detokenize(self, decode: Decode) -> None:
        """Bring `text` up to date with `output_ids` and apply stop strings (cut before the stop)."""
        if isinstance(self.matched_stop, str):
            return  # stopped at a stop string or regex already; later tokens are not text
        searched = self.detok.update(self.output_ids, decode)
        if self.below_min_tokens:
            self.stop_check_from = len(self.text)  # text so far never stops the request
            return
        for stop in self.params.stop:
            idx = self.text.find(stop, max(0, searched - len(stop) + 1))
            if idx != -1:
                self.detok.text = self.text[:idx + len(stop) if self.params.no_stop_trim else idx]
                if self.finish_reason is None or self.finish_reason == "length":
                    self.finish_reason, self.matched_stop = "stop", stop
                return
        if self.params.stop_regex:  # over committed text only: a pending tail may still change
            if self.stop_regexes is None:
                self.stop_regexes = StopRegexWatch(self.params.stop_regex, start=self.stop_check_from)
            pattern = self.stop_regexes.first_match(self.detok.committed)
            if pattern is not None and (self.finish_reason is None or self.finish_reason == "length"):
                self.finish_reason, self.matched_stop = "stop", pattern

    def stream_safe_len(self) -> int:
        """How much of `text` can be sent: never half a multi-byte char or a possible stop prefix."""
        if self.finished:
            return len(self.text)
        end = len(self.text)
        while end > 0 and self.text[end - 1] == "\ufffd":
            end -= 1
        for stop in self.params.stop:
            end -= _held_back(self.text, end, stop)
        return max(end, self.sent_text_len)

    def take_stream_chunk(self) -> StreamChunk | None:
        end = self.stream_safe_len()
        delta = self.text[self.sent_text_len:end]
        tokens = self.output_ids[self.sent_token_len:]
        if not delta and not self.finished:
            return None
        logprobs = self.output_logprobs[self.sent_token_len:] if self.params.logprobs else None
        self.sent_text_len = end
        self.sent_token_len = len(self.output_ids)
        return StreamChunk(text=delta, token_ids=tokens, finish_reason=self.finish_reason,
                           meta=self.final_meta() if self.finished else None, logprobs=logprobs)

    def final_meta(self) -> RequestMeta:
        """The finished request's accounting, counts filled in, as a copy of its own: the scheduler
        keeps writing `self.meta` while a consumer thread may already read what it was handed. Taken
        once, so the last stream chunk and the output report the same figures."""
        if self._final is None:
            self.meta.prompt_tokens = len(self.prompt_ids)
            self.meta.completion_tokens = len(self.output_ids)
            self.meta.total_time_s = time.perf_counter() - self.submit_time
            self.meta.matched_stop = self.matched_stop
            self._final = replace(self.meta)
        return self._final

    def build_output(self) -> GenerateOutput:
        logprobs = self.output_logprobs if self.params.logprobs else None
        return GenerateOutput(text=self.text, token_ids=list(self.output_ids), finish_reason=self.finish_reason or "abort",
                              meta=self.final_meta(), logprobs=logprobs, request_id=self.rid,
                              prompt_logprobs=list(self.input_logprobs) if self.input_logprob_start is not None else None,
                              next_token_logits=self.next_logits)
