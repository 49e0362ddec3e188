"""What the server's route modules share: the handlers' state, engine calls, streaming, errors.

The app (`app.py`) is assembled from `openai_api` and `native_api`, which use these. Requests go to the engine as `Job`s: `run_jobs` awaits them (and
cancels them when the client disconnects), `open_streams` + `sse_response` stream them as
server-sent events.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine_like import EngineLike
from ..errors import (ConstraintError, EngineShutdownError, InvalidRequestError, KVCacheTooSmallError,
                     PromptTooLongError, RequestAbortedError)
from ..outputs import GenerateOutput, RequestMeta, StreamChunk
from ..paths import public_model_name
from ..sampling_params import SamplingParams
from .guard import ServerLimits
from .metrics import RequestTracker, ServerMetrics
from .protocol import (ChatCompletionRequest, ErrorInfo, ErrorResponse, PromptTokensDetails, UsageInfo,
                              new_id)

logger = logging.getLogger("radix_backend.server")  # the server's logger (the errors it logs are its own)

DEFAULT_MODEL_PATH = "HuggingFaceTB/SmolLM2-135M-Instruct"
CLIENT_CLOSED_REQUEST = 499


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this server does not serve."""


class ClientDisconnected(RequestAbortedError):
    """The HTTP client went away before its response was ready (its requests were aborted)."""


# ============================================================================ errors


def error_json(status: int, message: str, err_type: str = "invalid_request_error", code: str | None = None,
           param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=code or status))
    return JSONResponse(body.model_dump(), status_code=status)


def error_response(exc: BaseException) -> JSONResponse:
    """Map a typed error to an OpenAI-style error body and HTTP status."""
    if isinstance(exc, ModelNotFoundError):
        return error_json(404, str(exc), code="model_not_found", param="model")
    if isinstance(exc, PromptTooLongError):
        return error_json(400, str(exc), code="context_length_exceeded", param="messages")
    if isinstance(exc, KVCacheTooSmallError):
        return error_json(400, str(exc), code="kv_cache_too_small")
    if isinstance(exc, ConstraintError):
        return error_json(400, str(exc), code="invalid_constraint", param="response_format")
    if isinstance(exc, InvalidRequestError):
        return error_json(400, str(exc))
    if isinstance(exc, EngineShutdownError):
        return error_json(503, str(exc), err_type="service_unavailable")
    if isinstance(exc, ClientDisconnected):  # nobody reads it; 499 (nginx's "client closed") counts it apart
        return error_json(CLIENT_CLOSED_REQUEST, str(exc), err_type="request_aborted", code="client_disconnected")
    if isinstance(exc, RequestAbortedError):
        return error_json(503, str(exc), err_type="request_aborted")
    error_id = uuid.uuid4().hex[:12]  # the details go to the log only: exception text can hold paths or data
    logger.error("internal error %s", error_id, exc_info=exc)
    return error_json(500, f"internal error (id {error_id}; the server log has the details)", err_type="internal_error")


# ============================================================================ handler state


class ServerState:
    """The handlers' shared state: the engine, served model names, metrics."""

    def __init__(self, engine: EngineLike, served_model_name: str | None, model_path: str | None,
                 incremental_streaming_output: bool = False, limits: ServerLimits | None = None) -> None:
        self.engine = engine
        self.incremental_streaming_output = incremental_streaming_output
        self.limits = limits or ServerLimits()
        # the model as the user named it (HF id, or the name of its dir or .gguf), never a host path nor
        # the dequantized weights' cache path: SGLang's client picks its chat template from this name
        self.model_path = public_model_name(model_path or getattr(engine, "model_id", None)
                                            or getattr(engine, "model_path", None) or DEFAULT_MODEL_PATH)
        self.model_name = served_model_name or public_model_name(getattr(engine, "model_name", None) or self.model_path)
        # requests may still name the model as the server was started with it (vLLM clients send the path)
        self._accepted = {self.model_name, self.model_path, "default", model_path, getattr(engine, "model_name", None),
                          getattr(engine, "model_id", None)} - {None}
        self._kv_total: int | None = None
        self.metrics = ServerMetrics(engine)
        self.tok = TokenText(engine)

    def chat_template_info(self) -> dict[str, Any]:
        """The tokenizer's Jinja chat template and the special tokens it uses: a client renders chat
        prompts exactly as the server would without reading the checkpoint (whose path is not shown)."""
        tok = getattr(self.engine, "tokenizer", None)
        template = getattr(tok, "chat_template", None)
        if not isinstance(template, str):
            return {"chat_template": None}
        specials = {k: v for k, v in (getattr(tok, "special_tokens_map", None) or {}).items() if isinstance(v, str)}
        return {"chat_template": template, "special_tokens": specials}

    def check_model(self, model: str | None) -> str:
        if model in self._accepted:
            return self.model_name
        raise ModelNotFoundError(f"model {model!r} is not served here; use {self.model_name!r} (see /v1/models)")

    # ------------------------------------------------------------------ prompts

    def tokenized(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """`inputs` as token ids, tokenized once here: the length check and the engine then use the
        same ids (a long prompt is not tokenized twice)."""
        if "input_ids" in inputs:
            return inputs
        text = inputs["prompt"] if "prompt" in inputs else self.engine.apply_chat_template(inputs["messages"])
        return {"input_ids": self.engine.encode(text)}

    def prompt_len(self, inputs: dict[str, Any]) -> int:
        return len(self.tokenized(inputs)["input_ids"])

    def max_new_tokens(self, requested: int | None, inputs: dict[str, Any]) -> int:
        """OpenAI semantics: no max_tokens means "until the context window is full"."""
        if requested is not None:
            if requested < 0:
                raise InvalidRequestError(f"max_tokens must be >= 0, got {requested}")
            prompt_len = self.prompt_len(inputs)
            if prompt_len + requested > self.engine.context_length:  # a 400 naming the limit, as OpenAI and vLLM
                raise PromptTooLongError(
                    f"this model's maximum context length is {self.engine.context_length} tokens; the request asks for "
                    f"{prompt_len + requested} ({prompt_len} in the prompt, {requested} in max_tokens)")
            return requested
        limit = min(self.engine.context_length, self.kv_total())
        room = limit - self.prompt_len(inputs)
        if room < 1:
            raise PromptTooLongError(f"the prompt fills the {limit} tokens the model can hold (context window "
                                     f"{self.engine.context_length}, KV cache {self.kv_total()}); shorten it")
        return room

    def kv_total(self) -> int:
        """KV slots of the smallest replica (a request must fit one replica's pool)."""
        if self._kv_total is None:
            replicas = getattr(self.engine, "replicas", None) or [self.engine]
            self._kv_total = min(int(r.cache_stats().slots_total) for r in replicas)
        return self._kv_total

    @staticmethod
    def completion_inputs(prompt: Any) -> list[dict[str, Any]]:
        if isinstance(prompt, str):
            return [{"prompt": prompt}]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty")
        if all(isinstance(p, str) for p in prompt):
            return [{"prompt": p} for p in prompt]
        if all(isinstance(p, int) for p in prompt):
            return [{"input_ids": list(prompt)}]
        if all(isinstance(p, list) for p in prompt):
            if not all(p for p in prompt):
                raise InvalidRequestError("prompt token lists must not be empty")
            return [{"input_ids": list(p)} for p in prompt]
        raise InvalidRequestError("prompt must be a string, a list of strings, a list of token ids, "
                                  "or a list of token id lists")

    @staticmethod
    def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
        """OpenAI messages as the chat template's {"role", "content"} dicts. OpenAI's roles only (a 400
        otherwise; developer is system, function is tool); an assistant turn's earlier tool_calls are
        replayed as the JSON the model writes for a call ({"name", "arguments"}), as the adapters do."""
        messages = []
        for i, m in enumerate(req.messages):
            role = _ROLE_ALIASES.get(m.role, m.role)
            if role not in _CHAT_ROLES:
                raise InvalidRequestError(f"messages[{i}].role {m.role!r} is not one of "
                                          f"{', '.join(sorted(_CHAT_ROLES | set(_ROLE_ALIASES)))}")
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.get("type") != "text":
                        raise InvalidRequestError(f"messages[{i}].content: only text parts are supported, "
                                                  f"got {part.get('type')!r}")
                    texts.append(str(part.get("text", "")))
                content = "".join(texts)
            calls = (m.model_extra or {}).get("tool_calls") if role == "assistant" else None
            if calls and not content:
                content = _replayed_tool_calls(calls, i)
            messages.append({"role": role, "content": content or ""})
        if not messages:
            raise InvalidRequestError("messages must not be empty")
        return messages

    def expand(self, inputs_list: list[dict[str, Any]], params_list: list[SamplingParams], n: int) -> list[Job]:
        self.check_n(n)
        jobs = []
        for group, (inputs, params) in enumerate(zip(inputs_list, params_list)):
            for j in range(n):
                p = params if (n == 1 or params.seed is None) else params.copy(seed=(params.seed + j) % (1 << 63))
                jobs.append(Job(inputs=inputs, params=p, group=group))
        self.check_limits(jobs)
        return jobs

    def check_n(self, n: Any) -> None:
        """Samples per prompt: an int in [1, max_n] (checked before any job is built)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"n must be an int >= 1, got {n!r}")
        if n > self.limits.max_n:
            raise InvalidRequestError(f"n={n} exceeds this server's limit of {self.limits.max_n} samples per prompt "
                                      "(--max-n)")

    def check_limits(self, jobs: Sequence[Job]) -> None:
        """The jobs' token budgets together <= max_n_tokens (a 400 naming the limit and its flag),
        before anything reaches the engine."""
        total = sum(job.params.max_new_tokens for job in jobs)
        if total > self.limits.max_n_tokens:
            raise InvalidRequestError(f"this request asks for up to {total} new tokens (n x max_tokens over its prompts), "
                                      f"over this server's limit of {self.limits.max_n_tokens} (--max-n-tokens); "
                                      "lower n or max_tokens")


_CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
_ROLE_ALIASES = {"developer": "system", "function": "tool"}


def _replayed_tool_calls(calls: Any, index: int) -> str:
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              for c in calls):
        raise InvalidRequestError(f"{where} must be a list of {{'type': 'function', 'function': {{...}}}} objects")
    replayed = []
    for call in calls:
        fn = call["function"]
        arguments = fn.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{where}: arguments of {fn.get('name')!r} are not JSON: {exc}") from None
        replayed.append({"name": fn.get("name"), "arguments": arguments})
    return json.dumps(replayed[0] if len(replayed) == 1 else replayed)


class TokenText:
    """Token id -> its text, cached (logprob responses repeat the same tokens a lot)."""

    def __init__(self, engine: EngineLike) -> None:
        self.engine = engine
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.engine.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 200_000:
                self._cache[token_id] = text
        return text


# ============================================================================ engine calls


@dataclass
class Job:
    """One engine request: the prompt keyword (prompt= / input_ids= / messages=) and its params."""

    inputs: dict[str, Any]
    params: SamplingParams
    group: int = 0  # index of the prompt this sample belongs to (n > 1 gives several jobs per prompt)
    rid: str = field(default_factory=lambda: new_id("req"))


async def _cancel_on_disconnect(request: Request, awaitable: Awaitable[Any]) -> Any:
    """Await `awaitable`, cancelling it (which aborts the engine requests) if the client disconnects."""
    task = asyncio.ensure_future(awaitable)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    dropped = False
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            dropped = True
            task.cancel()
            # let the cancellation land (it aborts the engine requests) before leaving; a cancelled
            # gather() ends with a CancelledError *exception*, not as cancelled, so remember who did it
            await asyncio.gather(task, return_exceptions=True)
    if dropped:
        raise ClientDisconnected("the client disconnected; its requests were aborted")
    return task.result()


async def run_jobs(request: Request, engine: EngineLike, jobs: list[Job], tracker: RequestTracker) -> list[GenerateOutput]:
    async def one(job: Job) -> GenerateOutput:
        out = await engine.agenerate(**job.inputs, params=job.params)
        tracker.tokens(len(out.token_ids))
        return out

    tasks = [asyncio.ensure_future(one(j)) for j in jobs]
    try:
        outs = await _cancel_on_disconnect(request, asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:  # one failed (or the client left): abort the siblings too
            task.cancel()
        tracker.finish()
        raise
    usage = usage_info(outs, [j.group for j in jobs])
    tracker.finish(usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens)
    return outs


def usage_info(outs: Sequence[GenerateOutput | None], groups: Sequence[int]) -> UsageInfo:
    """Prompt tokens count once per prompt (not once per sample), completion tokens per sample."""
    prompt: dict[int, int] = {}
    cached: dict[int, int] = {}
    completion = 0
    for out, group in zip(outs, groups):
        if out is None:
            continue
        prompt[group] = max(prompt.get(group, 0), out.meta.prompt_tokens)
        cached[group] = max(cached.get(group, 0), out.meta.cached_tokens)
        completion += out.meta.completion_tokens or len(out.token_ids)
    p = sum(prompt.values())
    return UsageInfo(prompt_tokens=p, completion_tokens=completion, total_tokens=p + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())))


def chunk_as_output(chunk: StreamChunk, text: str, token_ids: list[int]) -> GenerateOutput:
    return GenerateOutput(text=text, token_ids=token_ids, finish_reason=chunk.finish_reason or "abort",
                          meta=chunk.meta or RequestMeta(completion_tokens=len(token_ids)))


# ============================================================================ streaming


_DONE = object()


class MergedStreams:
    """Runs one `astream` per job in its own task and yields (job index, chunk) as they come.

    Errors of a stream are re-raised to the consumer; `close()` cancels every task, which closes
    each engine generator and so aborts its request (synchronous, so it is safe inside a
    cancelled scope).
    """

    def __init__(self, engine: EngineLike, jobs: Sequence[Job]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.ensure_future(self._pump(i, engine, job)) for i, job in enumerate(jobs)]
        self._remaining = len(jobs)

    async def _pump(self, index: int, engine: EngineLike, job: Job) -> None:
        try:
            async with aclosing(engine.astream(**job.inputs, params=job.params)) as stream:
                async for chunk in stream:
                    self._queue.put_nowait((index, chunk))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._queue.put_nowait((index, exc))
        finally:
            self._queue.put_nowait((index, _DONE))

    async def next(self) -> tuple[int, StreamChunk] | None:
        """The next chunk of any stream, or None once all streams are done."""
        while self._remaining:
            index, item = await self._queue.get()
            if item is _DONE:
                self._remaining -= 1
                continue
            if isinstance(item, BaseException):
                self.close()
                raise item
            return index, item
        return None

    def close(self) -> None:
        for task in self._tasks:
            if not task.done():
                task.cancel()


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator (so a dropped client aborts now,
    not whenever the generator happens to be garbage-collected)."""

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


def sse_event(payload: Any) -> str:
    body = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {body}\n\n"


async def open_streams(state: ServerState, jobs: list[Job],
                       tracker: RequestTracker) -> tuple[MergedStreams, tuple[int, StreamChunk] | None]:
    """Start the streams and wait for the first chunk, so submit-time errors (bad schema, prompt
    too long) still become 4xx responses instead of a broken event stream (and leave no gauge raised)."""
    streams = MergedStreams(state.engine, jobs)
    try:
        first = await streams.next()
    except BaseException:
        streams.close()
        tracker.finish()
        raise
    return streams, first


async def iterate_streams(streams: MergedStreams, first: tuple[int, StreamChunk] | None) -> AsyncIterator[tuple[int, StreamChunk]]:
    item = first
    while item is not None:
        yield item
        item = await streams.next()


def _stream_error_event(exc: BaseException) -> str:
    resp = error_response(exc)
    return f"data: {resp.body.decode()}\n\n"


def _finish_stream_tracker(tracker: RequestTracker, finals: Sequence[GenerateOutput | None], jobs: Sequence[Job]) -> None:
    usage = usage_info(finals, [j.group for j in jobs])
    tracker.finish(usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens)


def sse_response(events: AsyncGenerator[str, None], streams: MergedStreams, tracker: RequestTracker,
                  finals: list[GenerateOutput | None], jobs: Sequence[Job]) -> StreamingResponse:
    """Stream `events` (SSE lines that fill `finals` as requests finish), then `data: [DONE]`.

    An error after the 200 status is sent is reported in-band: an error event, then [DONE]. A
    client that goes away (cancellation, or the generator closed) just ends the stream. Either way
    the engine streams are closed, aborting what is unfinished, and the tracker is finished with
    the usage of `finals`.
    """

    async def body() -> AsyncIterator[str]:
        try:
            async with aclosing(events):
                async for event in events:
                    yield event
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # noqa: BLE001 - reported in-band: the 200 status is already sent
            yield _stream_error_event(exc)
            yield "data: [DONE]\n\n"
        finally:
            streams.close()
            _finish_stream_tracker(tracker, finals, jobs)

    return _ClosingStreamingResponse(body(), media_type="text/event-stream")
