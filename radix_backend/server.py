"""OpenAI-compatible and SGLang-native HTTP server over one Engine (or a data-parallel router).

`create_app(engine)` builds a FastAPI app; `serve(...)` runs it with uvicorn; `ServerThread` runs
it in a background thread (tests, notebooks, the load benchmark). Every handler is async and
talks to the engine through `agenerate` / `astream`, so requests from all HTTP clients land in
the engine's one scheduler loop and share its radix cache.

A client that goes away aborts its requests: streams close the engine's async generator, and
non-streaming calls are cancelled when the connection drops (`_cancel_on_disconnect`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from .errors import (ConstraintError, EngineShutdownError, InvalidRequestError, KVCacheTooSmallError,
                     MissingDependencyError, PromptTooLongError, RadixBackendError, RequestAbortedError)
from .outputs import GenerateOutput, RequestMeta, StreamChunk, TokenLogprob
from .sampling_params import SamplingParams
from .server_protocol import (ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
                              ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatMessage, ChoiceLogprobs,
                              CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                              CompletionStreamResponse, DeltaMessage, ErrorInfo, ErrorResponse, GenerateReqInput,
                              ModelCard, ModelList, PromptTokensDetails, TokenLogprobOut, TopLogprob, UsageInfo,
                              new_id, sglang_finish_reason)

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as exc:  # pragma: no cover - the server extra installs them
    raise MissingDependencyError.for_extra("fastapi and uvicorn", "server") from exc

from .metrics import RequestTracker, ServerMetrics

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PATH = "HuggingFaceTB/SmolLM2-135M-Instruct"
# SGLang sampling_params keys that change nothing here (formatting / scheduling hints).
_SGLANG_IGNORED_KEYS = {"spaces_between_special_tokens", "no_stop_trim", "stream_interval", "custom_params",
                        "logit_bias"}
_SGLANG_RENAMED_KEYS = {"ebnf": "grammar", "sampling_seed": "seed"}


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this server does not serve."""


class ClientDisconnected(RequestAbortedError):
    """The HTTP client went away before its response was ready (its requests were aborted)."""


# ============================================================================ engine calls


@dataclass
class _Job:
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
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _run_jobs(request: Request, engine: Any, jobs: list[_Job], tracker: RequestTracker) -> list[GenerateOutput]:
    async def one(job: _Job) -> GenerateOutput:
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
    usage = _usage(outs, [j.group for j in jobs])
    tracker.finish(usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens)
    return outs


_DONE = object()


class _MergedStreams:
    """Runs one `astream` per job in its own task and yields (job index, chunk) as they come.

    Errors of a stream are re-raised to the consumer; `close()` cancels every task, which closes
    each engine generator and so aborts its request (synchronous, so it is safe inside a
    cancelled scope).
    """

    def __init__(self, engine: Any, jobs: Sequence[_Job]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.ensure_future(self._pump(i, engine, job)) for i, job in enumerate(jobs)]
        self._remaining = len(jobs)

    async def _pump(self, index: int, engine: Any, job: _Job) -> None:
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


def _sse(payload: Any) -> str:
    body = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {body}\n\n"


# ============================================================================ request -> SamplingParams


def _response_format_schema(req: ChatCompletionRequest | CompletionRequest) -> Any:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    spec = fmt.json_schema or {}
    schema = spec.get("schema", spec.get("schema_"))
    if schema is None:
        raise InvalidRequestError('response_format.json_schema.schema is required when type is "json_schema"')
    return schema


def _openai_params(req: ChatCompletionRequest | CompletionRequest, max_new_tokens: int, *, logprobs: bool,
                   top_logprobs: int) -> SamplingParams:
    schema = _response_format_schema(req)
    if schema is not None and req.json_schema is not None:
        raise InvalidRequestError("set either response_format or json_schema, not both")
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k, min_p=req.min_p, frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty, repetition_penalty=req.repetition_penalty, stop=req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
        seed=req.seed, logprobs=logprobs, top_logprobs=top_logprobs, regex=req.regex,
        json_schema=schema if schema is not None else req.json_schema, grammar=req.ebnf,
    )
    params.validate()
    return params


def _sglang_params(raw: dict[str, Any] | None) -> tuple[SamplingParams, int]:
    """SGLang's sampling_params dict -> (SamplingParams, n)."""
    raw = dict(raw or {})
    n = raw.pop("n", 1)
    kwargs: dict[str, Any] = {}
    unknown = []
    fields = SamplingParams.__dataclass_fields__
    for key, value in raw.items():
        key = _SGLANG_RENAMED_KEYS.get(key, key)
        if key in _SGLANG_IGNORED_KEYS or value is None:
            continue
        if key == "min_new_tokens":
            if value:
                raise InvalidRequestError("sampling_params.min_new_tokens is not supported; remove it")
            continue
        if key not in fields:
            unknown.append(key)
            continue
        kwargs[key] = value
    if unknown:
        raise InvalidRequestError(f"unknown sampling_params keys {sorted(unknown)}; supported: {sorted(fields)}")
    if not isinstance(n, int) or n < 1:
        raise InvalidRequestError(f"sampling_params.n must be an int >= 1, got {n!r}")
    try:
        params = SamplingParams(**kwargs)
    except TypeError as exc:
        raise InvalidRequestError(f"bad sampling_params: {exc}") from exc
    params.validate()
    return params, n


# ============================================================================ output formatting


class _TokenText:
    """Token id -> its text, cached (logprob responses repeat the same tokens a lot)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.engine.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 200_000:
                self._cache[token_id] = text
        return text


def _completion_logprobs(lps: list[TokenLogprob] | None, tok: _TokenText, offset: int = 0) -> CompletionLogprobs | None:
    if lps is None:
        return None
    out = CompletionLogprobs()
    for lp in lps:
        text = tok(lp.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({tok(t): v for t, v in lp.top} if lp.top else None)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _chat_logprobs(lps: list[TokenLogprob] | None, tok: _TokenText) -> ChoiceLogprobs | None:
    if lps is None:
        return None
    content = []
    for lp in lps:
        text = tok(lp.token_id)
        top = [TopLogprob(token=tok(t), logprob=v, bytes=list(tok(t).encode())) for t, v in lp.top]
        content.append(TokenLogprobOut(token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top))
    return ChoiceLogprobs(content=content)


def _usage(outs: Sequence[GenerateOutput | None], groups: Sequence[int]) -> UsageInfo:
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


def _chunk_as_output(chunk: StreamChunk, text: str, token_ids: list[int]) -> GenerateOutput:
    return GenerateOutput(text=text, token_ids=token_ids, finish_reason=chunk.finish_reason or "abort",
                          meta=chunk.meta or RequestMeta(completion_tokens=len(token_ids)))


# ============================================================================ errors


def _error(status: int, message: str, err_type: str = "invalid_request_error", code: str | None = None,
           param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=code or status))
    return JSONResponse(body.model_dump(), status_code=status)


def error_response(exc: BaseException) -> JSONResponse:
    """Map a typed error to an OpenAI-style error body and HTTP status."""
    if isinstance(exc, ModelNotFoundError):
        return _error(404, str(exc), code="model_not_found", param="model")
    if isinstance(exc, PromptTooLongError):
        return _error(400, str(exc), code="context_length_exceeded", param="messages")
    if isinstance(exc, KVCacheTooSmallError):
        return _error(400, str(exc), code="kv_cache_too_small")
    if isinstance(exc, ConstraintError):
        return _error(400, str(exc), code="invalid_constraint", param="response_format")
    if isinstance(exc, InvalidRequestError):
        return _error(400, str(exc))
    if isinstance(exc, EngineShutdownError):
        return _error(503, str(exc), err_type="service_unavailable")
    if isinstance(exc, RequestAbortedError):
        return _error(503, str(exc), err_type="request_aborted")
    logger.exception("internal error", exc_info=exc)
    return _error(500, f"internal error: {type(exc).__name__}: {exc}", err_type="internal_error")


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        if err.get("type") == "json_invalid":
            return f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


# ============================================================================ metrics middleware


class _MetricsMiddleware:
    """Pure ASGI middleware (unlike BaseHTTPMiddleware it leaves streaming and disconnects alone)."""

    def __init__(self, app: Any, metrics: ServerMetrics, endpoints: set[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in self.endpoints else "other"
        status = {"code": 500}

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.count_request(endpoint, status["code"])


# ============================================================================ the app


class _Server:
    """The handlers' shared state: the engine, served model names, metrics."""

    def __init__(self, engine: Any, served_model_name: str | None, model_path: str | None) -> None:
        self.engine = engine
        self.model_path = model_path or getattr(engine, "model_path", None) or DEFAULT_MODEL_PATH
        self.model_name = served_model_name or getattr(engine, "model_name", None) or self.model_path
        self._kv_total: int | None = None
        self.metrics = ServerMetrics(engine)
        self.tok = _TokenText(engine)

    def check_model(self, model: str | None) -> str:
        if model in (self.model_name, self.model_path, "default"):
            return self.model_name
        raise ModelNotFoundError(f"model {model!r} is not served here; use {self.model_name!r} (see /v1/models)")

    # ------------------------------------------------------------------ prompts

    def prompt_len(self, inputs: dict[str, Any]) -> int:
        if "input_ids" in inputs:
            return len(inputs["input_ids"])
        text = inputs.get("prompt")
        if text is None:
            text = self.engine.apply_chat_template(inputs["messages"])
        return len(self.engine.encode(text))

    def max_new_tokens(self, requested: int | None, inputs: dict[str, Any]) -> int:
        """OpenAI semantics: no max_tokens means "until the context window is full"."""
        if requested is not None:
            if requested < 0:
                raise InvalidRequestError(f"max_tokens must be >= 0, got {requested}")
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
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.get("type") != "text":
                        raise InvalidRequestError(f"messages[{i}].content: only text parts are supported, "
                                                  f"got {part.get('type')!r}")
                    texts.append(str(part.get("text", "")))
                content = "".join(texts)
            messages.append({"role": m.role, "content": content or ""})
        if not messages:
            raise InvalidRequestError("messages must not be empty")
        return messages

    def expand(self, inputs_list: list[dict[str, Any]], params_list: list[SamplingParams], n: int) -> list[_Job]:
        if not 1 <= n <= 128:
            raise InvalidRequestError(f"n must be in [1, 128], got {n}")
        jobs = []
        for group, (inputs, params) in enumerate(zip(inputs_list, params_list)):
            for j in range(n):
                p = params if (n == 1 or params.seed is None) else params.copy(seed=params.seed + j)
                jobs.append(_Job(inputs=inputs, params=p, group=group))
        return jobs


def create_app(engine: Any, *, served_model_name: str | None = None, model_path: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (an Engine, or anything with its API such as the
    data-parallel `Router`). The engine is not shut down by the app; `serve()` does that."""
    state = _Server(engine, served_model_name, model_path)
    app = FastAPI(title="radix-backend", version="0.1.0")
    app.state.server = state
    endpoints = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/generate", "/health", "/metrics",
                 "/get_model_info", "/get_server_info", "/flush_cache"}
    app.add_middleware(_MetricsMiddleware, metrics=state.metrics, endpoints=endpoints)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), code=str(exc.status_code))

    @app.exception_handler(RadixBackendError)
    async def _on_error(_: Request, exc: RadixBackendError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _on_bug(_: Request, exc: Exception) -> JSONResponse:  # logged and re-raised by Starlette
        return error_response(exc)

    # ------------------------------------------------------------------ info endpoints

    @app.get("/health")
    async def health() -> JSONResponse:
        if getattr(engine, "is_shutdown", False):
            return _error(503, "engine is shut down", err_type="service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.model_name, root=state.model_path,
                                         max_model_len=engine.context_length)])

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
                "served_model_name": state.model_name, "max_context_length": engine.context_length}

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        stats = engine.cache_stats()
        return {"model_path": state.model_path, "served_model_name": state.model_name,
                "context_length": engine.context_length, "dp_size": len(getattr(engine, "replicas", [engine])),
                "cache_stats": {k: v for k, v in vars(stats).items()}, **state.metrics.snapshot()}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        ok = await asyncio.to_thread(engine.flush_cache)
        if ok:
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are running; retry when idle.\n", status_code=400)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    # ------------------------------------------------------------------ OpenAI: completions

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest) -> Any:
        model = state.check_model(req.model)
        if req.suffix:
            raise InvalidRequestError("suffix is not supported")
        if req.best_of not in (None, req.n):
            raise InvalidRequestError("best_of must equal n (or be omitted)")
        if req.echo and req.logprobs is not None:
            raise InvalidRequestError("echo together with logprobs is not supported")
        inputs_list = state.completion_inputs(req.prompt)
        want_lp = req.logprobs is not None
        params_list = [_openai_params(req, state.max_new_tokens(req.max_tokens, inp), logprobs=want_lp,
                                      top_logprobs=req.logprobs or 0) for inp in inputs_list]
        jobs = state.expand(inputs_list, params_list, req.n)
        echo = [_echo_text(engine, j.inputs) if req.echo else "" for j in jobs]
        tracker = state.metrics.track("/v1/completions")
        if req.stream:
            return await _stream_completion(state, jobs, model, req, echo, tracker)
        outs = await _run_jobs(request, engine, jobs, tracker)
        choices = [CompletionChoice(index=i, text=echo[i] + out.text, finish_reason=_openai_finish(out.finish_reason),
                                    matched_stop=out.meta.matched_stop,
                                    logprobs=_completion_logprobs(out.logprobs, state.tok) if want_lp else None)
                   for i, out in enumerate(outs)]
        return CompletionResponse(model=model, choices=choices, usage=_usage(outs, [j.group for j in jobs]))

    # ------------------------------------------------------------------ OpenAI: chat

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: ChatCompletionRequest) -> Any:
        model = state.check_model(req.model)
        if req.tools:
            raise InvalidRequestError("tools are not supported by this server")
        inputs = {"messages": state.chat_messages(req)}
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=true")
        params = _openai_params(req, state.max_new_tokens(requested, inputs), logprobs=req.logprobs, top_logprobs=top)
        jobs = state.expand([inputs], [params], req.n)
        tracker = state.metrics.track("/v1/chat/completions")
        if req.stream:
            return await _stream_chat(state, jobs, model, req, tracker)
        outs = await _run_jobs(request, engine, jobs, tracker)
        choices = [ChatCompletionChoice(index=i, message=ChatMessage(content=out.text),
                                        finish_reason=_openai_finish(out.finish_reason),
                                        matched_stop=out.meta.matched_stop,
                                        logprobs=_chat_logprobs(out.logprobs, state.tok) if req.logprobs else None)
                   for i, out in enumerate(outs)]
        return ChatCompletionResponse(model=model, choices=choices, usage=_usage(outs, [j.group for j in jobs]))

    # ------------------------------------------------------------------ SGLang native

    @app.post("/generate")
    async def generate(request: Request, req: GenerateReqInput) -> Any:
        jobs, specs = _sglang_jobs(req)
        tracker = state.metrics.track("/generate")
        if req.stream:
            return await _stream_sglang(state, jobs, specs, tracker)
        outs = await _run_jobs(request, engine, jobs, tracker)
        results = [await _sglang_result(state, job, spec, out, req.return_text_in_logprobs)
                   for job, spec, out in zip(jobs, specs, outs)]
        return results if (req.is_batch or len(results) > 1) else results[0]

    return app


def _openai_finish(reason: str | None) -> str | None:
    return None if reason is None else ("stop" if reason == "abort" else reason)


def _echo_text(engine: Any, inputs: dict[str, Any]) -> str:
    if "prompt" in inputs:
        return inputs["prompt"]
    return engine.decode(inputs["input_ids"], skip_special_tokens=False)


# ============================================================================ streaming


async def _open_streams(state: _Server, jobs: list[_Job]) -> tuple[_MergedStreams, tuple[int, StreamChunk] | None]:
    """Start the streams and wait for the first chunk, so submit-time errors (bad schema, prompt
    too long) still become 4xx responses instead of a broken event stream."""
    streams = _MergedStreams(state.engine, jobs)
    try:
        first = await streams.next()
    except BaseException:
        streams.close()
        raise
    return streams, first


async def _iterate(streams: _MergedStreams, first: tuple[int, StreamChunk] | None) -> AsyncIterator[tuple[int, StreamChunk]]:
    item = first
    while item is not None:
        yield item
        item = await streams.next()


def _stream_error_event(exc: BaseException) -> str:
    resp = error_response(exc)
    return f"data: {resp.body.decode()}\n\n"


async def _stream_completion(state: _Server, jobs: list[_Job], model: str, req: CompletionRequest, echo: list[str],
                             tracker: RequestTracker) -> StreamingResponse:
    streams, first = await _open_streams(state, jobs)
    rid, created = new_id("cmpl"), int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def body() -> AsyncIterator[str]:
        finals: list[GenerateOutput | None] = [None] * len(jobs)
        texts = [""] * len(jobs)
        ids: list[list[int]] = [[] for _ in jobs]
        offsets = [len(e) for e in echo]
        try:
            for i, e in enumerate(echo):
                if e:
                    yield _sse(CompletionStreamResponse(id=rid, created=created, model=model,
                                                        choices=[CompletionChoice(index=i, text=e)]))
            async for i, chunk in _iterate(streams, first):
                tracker.tokens(len(chunk.token_ids))
                texts[i] += chunk.text
                ids[i] += chunk.token_ids
                lps = _completion_logprobs(getattr(chunk, "logprobs", None), state.tok, offsets[i]) \
                    if req.logprobs is not None else None
                offsets[i] += len(chunk.text)
                if chunk.finish_reason is not None:
                    finals[i] = _chunk_as_output(chunk, texts[i], ids[i])
                if chunk.text or chunk.finish_reason is not None:
                    choice = CompletionChoice(index=i, text=chunk.text, logprobs=lps,
                                              finish_reason=_openai_finish(chunk.finish_reason))
                    yield _sse(CompletionStreamResponse(id=rid, created=created, model=model, choices=[choice]))
            if include_usage:
                yield _sse(CompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                    usage=_usage(finals, [j.group for j in jobs])))
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


async def _stream_chat(state: _Server, jobs: list[_Job], model: str, req: ChatCompletionRequest,
                       tracker: RequestTracker) -> StreamingResponse:
    streams, first = await _open_streams(state, jobs)
    rid, created = new_id("chatcmpl"), int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def event(i: int, delta: DeltaMessage, finish: str | None = None, logprobs: ChoiceLogprobs | None = None) -> str:
        choice = ChatCompletionStreamChoice(index=i, delta=delta, finish_reason=finish, logprobs=logprobs)
        return _sse(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[choice]))

    async def body() -> AsyncIterator[str]:
        finals: list[GenerateOutput | None] = [None] * len(jobs)
        texts = [""] * len(jobs)
        ids: list[list[int]] = [[] for _ in jobs]
        try:
            for i in range(len(jobs)):
                yield event(i, DeltaMessage(role="assistant", content=""))
            async for i, chunk in _iterate(streams, first):
                tracker.tokens(len(chunk.token_ids))
                texts[i] += chunk.text
                ids[i] += chunk.token_ids
                if chunk.text:
                    lps = _chat_logprobs(getattr(chunk, "logprobs", None), state.tok) if req.logprobs else None
                    yield event(i, DeltaMessage(content=chunk.text), logprobs=lps)
                if chunk.finish_reason is not None:
                    finals[i] = _chunk_as_output(chunk, texts[i], ids[i])
                    yield event(i, DeltaMessage(), finish=_openai_finish(chunk.finish_reason))
            if include_usage:
                yield _sse(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                        usage=_usage(finals, [j.group for j in jobs])))
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # noqa: BLE001
            yield _stream_error_event(exc)
            yield "data: [DONE]\n\n"
        finally:
            streams.close()
            _finish_stream_tracker(tracker, finals, jobs)

    return _ClosingStreamingResponse(body(), media_type="text/event-stream")


def _finish_stream_tracker(tracker: RequestTracker, finals: Sequence[GenerateOutput | None], jobs: Sequence[_Job]) -> None:
    usage = _usage(finals, [j.group for j in jobs])
    tracker.finish(usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens)


# ============================================================================ SGLang /generate


@dataclass
class _LogprobSpec:
    """Per-request logprob options of a /generate call."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    index: int = 0


def _sglang_jobs(req: GenerateReqInput) -> tuple[list[_Job], list[_LogprobSpec]]:
    if (req.text is None) == (req.input_ids is None):
        raise InvalidRequestError("set exactly one of text or input_ids")
    if req.text is not None:
        prompts = req.text if isinstance(req.text, list) else [req.text]
        inputs_list = [{"prompt": t} for t in prompts]
    else:
        ids = req.input_ids if req.is_batch else [req.input_ids]
        if not ids or not all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in ids):
            raise InvalidRequestError("input_ids must be a non-empty list of token ids or a list of such lists")
        inputs_list = [{"input_ids": list(x)} for x in ids]
    size = len(inputs_list)
    if size == 0:
        raise InvalidRequestError("text must not be an empty list")
    for name in ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num"):
        value = getattr(req, name)
        if isinstance(value, list) and len(value) != size:
            raise InvalidRequestError(f"{name} has {len(value)} entries but the batch has {size} prompts")
    jobs, specs = [], []
    for i, inputs in enumerate(inputs_list):
        params, n = _sglang_params(req.item("sampling_params", i))
        want = bool(req.item("return_logprob", i))
        top = int(req.item("top_logprobs_num", i) or 0)
        if want:
            params = params.copy(logprobs=True, top_logprobs=top)
            params.validate()
        rid = req.item("rid", i)
        for j in range(n):
            job = _Job(inputs=inputs, params=params, group=i)
            if rid is not None:
                job.rid = str(rid) if n == 1 else f"{rid}-{j}"
            jobs.append(job)
            specs.append(_LogprobSpec(want, int(req.item("logprob_start_len", i)), top, len(specs)))
    return jobs, specs


def _lp_entry(logprob: float | None, token_id: int, state: _Server, with_text: bool) -> list[Any]:
    return [logprob, token_id, state.tok(token_id) if with_text else None]


async def _input_logprobs(state: _Server, job: _Job, start: int, with_text: bool) -> list[list[Any]]:
    """SGLang's input_token_logprobs from `start`: [logprob, id, text]; the first prompt token has None."""
    ids = job.inputs.get("input_ids") or state.engine.encode(job.inputs["prompt"])
    start = max(0, start)
    if start >= len(ids):
        return []
    entries: list[list[Any]] = []
    if start == 0:
        entries.append(_lp_entry(None, ids[0], state, with_text))
        start = 1
    if start < len(ids):
        scores = await asyncio.to_thread(state.engine.score, list(ids[:start]), [list(ids[start:])])
        entries += [_lp_entry(lp, t, state, with_text) for lp, t in zip(scores[0].token_logprobs, ids[start:])]
    return entries


async def _sglang_result(state: _Server, job: _Job, spec: _LogprobSpec, out: GenerateOutput,
                         with_text: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": job.rid,
        "finish_reason": sglang_finish_reason(out.finish_reason, out.meta.matched_stop, out.meta.completion_tokens),
        "prompt_tokens": out.meta.prompt_tokens,
        "completion_tokens": out.meta.completion_tokens or len(out.token_ids),
        "cached_tokens": out.meta.cached_tokens,
        "e2e_latency": out.meta.total_time_s,
    }
    if spec.return_logprob:
        lps = out.logprobs or []
        meta["output_token_logprobs"] = [_lp_entry(lp.logprob, lp.token_id, state, with_text) for lp in lps]
        meta["output_top_logprobs"] = [[_lp_entry(v, t, state, with_text) for t, v in lp.top] if spec.top_logprobs_num
                                       else None for lp in lps]
        if spec.logprob_start_len >= 0:
            inp = await _input_logprobs(state, job, spec.logprob_start_len, with_text)
            meta["input_token_logprobs"] = inp
            meta["input_top_logprobs"] = [None] * len(inp)
            known = [e[0] for e in inp if e[0] is not None]
            meta["normalized_prompt_logprob"] = sum(known) / max(1, len(known))
    return {"text": out.text, "output_ids": list(out.token_ids), "meta_info": meta, "index": spec.index}


async def _stream_sglang(state: _Server, jobs: list[_Job], specs: list[_LogprobSpec],
                         tracker: RequestTracker) -> StreamingResponse:
    """SGLang streams cumulative text (`data: {"text": <all so far>, "meta_info": ...}`), then [DONE]."""
    streams, first = await _open_streams(state, jobs)

    async def body() -> AsyncIterator[str]:
        finals: list[GenerateOutput | None] = [None] * len(jobs)
        texts = [""] * len(jobs)
        ids: list[list[int]] = [[] for _ in jobs]
        try:
            async for i, chunk in _iterate(streams, first):
                tracker.tokens(len(chunk.token_ids))
                texts[i] += chunk.text
                ids[i] += chunk.token_ids
                meta = chunk.meta
                finish = None
                if chunk.finish_reason is not None:
                    finals[i] = _chunk_as_output(chunk, texts[i], ids[i])
                    finish = sglang_finish_reason(chunk.finish_reason, meta.matched_stop if meta else None, len(ids[i]))
                info = {"id": jobs[i].rid, "finish_reason": finish,
                        "prompt_tokens": meta.prompt_tokens if meta else None,
                        "completion_tokens": len(ids[i]), "cached_tokens": meta.cached_tokens if meta else None}
                yield _sse({"text": texts[i], "output_ids": ids[i], "meta_info": info, "index": specs[i].index})
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # noqa: BLE001
            yield _stream_error_event(exc)
            yield "data: [DONE]\n\n"
        finally:
            streams.close()
            _finish_stream_tracker(tracker, finals, jobs)

    return _ClosingStreamingResponse(body(), media_type="text/event-stream")


# ============================================================================ running it


class ServerThread:
    """Runs an app with uvicorn in a daemon thread on 127.0.0.1 (port 0 picks a free port).

    Usage: `with ServerThread(create_app(engine)) as srv: OpenAI(base_url=srv.url + "/v1")`.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self.host = host
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, loop="asyncio", lifespan="off",
                                timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="radix-backend-server", daemon=True)
        self.port = port

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def build_engine(model: str | None = None, *, dp_size: int = 1, router_policy: str = "cache_aware",
                 **engine_kwargs: Any) -> Any:
    """One Engine, or `dp_size` Engines behind a cache-aware data-parallel router."""
    if dp_size < 1:
        raise InvalidRequestError(f"dp_size must be >= 1, got {dp_size}")
    if dp_size == 1:
        from .engine import Engine

        return Engine(model, **engine_kwargs)
    from .router import Router

    return Router.from_model(model, dp_size=dp_size, policy=router_policy, **engine_kwargs)


def serve(model: str | None = None, *, host: str = "127.0.0.1", port: int = 30000, dp_size: int = 1,
          router_policy: str = "cache_aware", served_model_name: str | None = None, log_level: str = "info",
          **engine_kwargs: Any) -> None:
    """Load the model (dp_size replicas), serve it until interrupted, then shut the engines down."""
    engine = build_engine(model, dp_size=dp_size, router_policy=router_policy, **engine_kwargs)
    try:
        app = create_app(engine, served_model_name=served_model_name, model_path=model)
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30)
    finally:
        engine.shutdown()


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of `radix-backend serve` (the CLI wires `run_serve` to them)."""
    parser.add_argument("--model", default=None, help="HF checkpoint dir or .gguf file (default: embedded SmolLM2-135M)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (one process each)")
    parser.add_argument("--dp-size", type=int, default=1, help="data-parallel replicas behind a cache-aware router")
    parser.add_argument("--router-policy", choices=["cache_aware", "round_robin", "shortest_queue"],
                        default="cache_aware")
    parser.add_argument("--served-model-name", default=None, help="model id reported by /v1/models")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--mem-fraction", type=float, default=None)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--schedule-policy", default="lpm", choices=["lpm", "dfs-weight", "fcfs"])
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--chunked-prefill-tokens", type=int, default=2048)
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-level", default="info")
    return parser


_ENGINE_ARGS = ("device", "dtype", "kv_cache_tokens", "mem_fraction", "page_size", "schedule_policy",
                "attention_backend", "max_running_requests", "chunked_prefill_tokens", "disable_radix_cache", "seed", "tp_size")


def run_serve(args: argparse.Namespace) -> None:
    serve(args.model, host=args.host, port=args.port, dp_size=args.dp_size, router_policy=args.router_policy,
          served_model_name=args.served_model_name, log_level=args.log_level,
          **{name: getattr(args, name) for name in _ENGINE_ARGS})


def main(argv: list[str] | None = None) -> None:
    """`python -m radix_backend.server --model ...` (same flags as `radix-backend serve`)."""
    run_serve(add_serve_args(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv))


if __name__ == "__main__":
    main()
