"""The OpenAI-compatible routes: POST /v1/completions and /v1/chat/completions (streaming or not).

Part of `radix_backend.server`, which registers them with `add_openai_routes`; /v1/models is
served there with the other model-info endpoints.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ..errors import InvalidRequestError
from ..outputs import TokenLogprob
from ..sampling_params import SamplingParams
from ..tool_calls import with_system_text
from .jobs import Job, run_jobs, usage_info
from .state import ServerState, TokenText
from .streaming import open_streams, sse_event
from .metrics import RequestTracker
from .tools import tool_plan, tool_reply
from .protocol import (ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
                              ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatMessage, ChoiceLogprobs,
                              CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                              CompletionStreamResponse, DeltaMessage, TokenLogprobOut, TopLogprob, new_id)


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    """Register /v1/completions and /v1/chat/completions on `app`, served from `state`. What
    tokenizes or renders templates runs in worker threads (`asyncio.to_thread`): a 4 MB prompt takes
    seconds, and the event loop serves every other client meanwhile."""
    engine = state.engine

    # ------------------------------------------------------------------ completions

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest) -> Any:
        model = state.check_model(req.model)
        if req.suffix:
            raise InvalidRequestError("suffix is not supported")
        if req.best_of not in (None, req.n):
            raise InvalidRequestError("best_of must equal n (or be omitted)")
        if req.echo and req.logprobs is not None:
            raise InvalidRequestError("echo together with logprobs is not supported")
        want_lp = req.logprobs is not None

        def prepare() -> tuple[list[Job], list[str]]:  # tokenizes: off the event loop
            given = state.completion_inputs(req.prompt)
            echoes = [_echo_text(engine, inp) if req.echo else "" for inp in given]
            inputs_list = [state.tokenized(inp) for inp in given]
            params_list = [_openai_params(req, state.max_new_tokens(req.max_tokens, inp), logprobs=want_lp,
                                          top_logprobs=req.logprobs or 0) for inp in inputs_list]
            jobs = state.expand(inputs_list, params_list, req.n)
            return jobs, [echoes[j.group] for j in jobs]

        jobs, echo = await asyncio.to_thread(prepare)
        tracker = state.metrics.track("/v1/completions")
        if req.stream:
            return await _stream_completion(state, jobs, model, req, echo, tracker)
        outs = await run_jobs(request, engine, jobs, tracker)
        choices = [CompletionChoice(index=i, text=echo[i] + out.text, finish_reason=_openai_finish(out.finish_reason),
                                    matched_stop=out.meta.matched_stop,
                                    logprobs=_completion_logprobs(out.logprobs, state.tok) if want_lp else None)
                   for i, out in enumerate(outs)]
        return CompletionResponse(model=model, choices=choices, usage=usage_info(outs, jobs))

    # ------------------------------------------------------------------ chat

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: ChatCompletionRequest) -> Any:
        model = state.check_model(req.model)
        tools = tool_plan(req)
        messages = state.chat_messages(req)
        if tools is not None:
            if req.response_format is not None and req.response_format.type != "text" or req.json_schema is not None:
                raise InvalidRequestError("tools cannot be combined with response_format / json_schema")
            messages = with_system_text(messages, tools.instructions)
        inputs = {"messages": messages}
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=true")
        def prepare() -> list[Job]:  # applies the chat template and tokenizes, once: off the event loop
            ids = state.tokenized(inputs)
            params = _openai_params(req, state.max_new_tokens(requested, ids), logprobs=req.logprobs,
                                    top_logprobs=top, json_schema=tools.schema if tools is not None else None)
            return state.expand([ids], [params], req.n)

        jobs = await asyncio.to_thread(prepare)
        tracker = state.metrics.track("/v1/chat/completions")
        if req.stream:
            return await _stream_chat(state, jobs, model, req, tracker, with_tools=tools is not None)
        outs = await run_jobs(request, engine, jobs, tracker)
        choices = []
        for i, out in enumerate(outs):
            message, finish = ChatMessage(content=out.text), _openai_finish(out.finish_reason)
            if tools is not None:
                message, finish = tool_reply(out.text, finish)
            choices.append(ChatCompletionChoice(index=i, message=message, finish_reason=finish,
                                                matched_stop=out.meta.matched_stop,
                                                logprobs=_chat_logprobs(out.logprobs, state.tok) if req.logprobs else None))
        return ChatCompletionResponse(model=model, choices=choices, usage=usage_info(outs, jobs))


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
                   top_logprobs: int, json_schema: Any = None) -> SamplingParams:
    schema = json_schema if json_schema is not None else _response_format_schema(req)
    if schema is not None and req.json_schema is not None:
        raise InvalidRequestError("set either response_format or json_schema, not both")
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k, min_p=req.min_p, frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty, repetition_penalty=req.repetition_penalty, stop=req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
        logit_bias=req.logit_bias, min_new_tokens=req.min_tokens,
        seed=req.seed, logprobs=logprobs, top_logprobs=top_logprobs, regex=req.regex,
        json_schema=schema if schema is not None else req.json_schema, grammar=req.ebnf,
    )
    params.validate()
    return params


# ============================================================================ output formatting


def _openai_finish(reason: str | None) -> str | None:
    return None if reason is None else ("stop" if reason == "abort" else reason)


def _echo_text(engine: Any, inputs: dict[str, Any]) -> str:
    if "prompt" in inputs:
        return inputs["prompt"]
    return engine.decode(inputs["input_ids"], skip_special_tokens=False)


def _completion_logprobs(lps: list[TokenLogprob] | None, tok: TokenText, offset: int = 0) -> CompletionLogprobs | None:
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


def _chat_logprobs(lps: list[TokenLogprob] | None, tok: TokenText) -> ChoiceLogprobs | None:
    if lps is None:
        return None
    content = []
    for lp in lps:
        text = tok(lp.token_id)
        top = [TopLogprob(token=tok(t), logprob=v, bytes=list(tok(t).encode())) for t, v in lp.top]
        content.append(TokenLogprobOut(token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top))
    return ChoiceLogprobs(content=content)


# ============================================================================ streaming


async def _stream_completion(state: ServerState, jobs: list[Job], model: str, req: CompletionRequest, echo: list[str],
                             tracker: RequestTracker) -> StreamingResponse:
    session = await open_streams(state, jobs, tracker)
    rid, created = new_id("cmpl"), int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def events() -> AsyncGenerator[str, None]:
        offsets = [len(e) for e in echo]
        for i, e in enumerate(echo):
            if e:
                yield sse_event(CompletionStreamResponse(id=rid, created=created, model=model,
                                                    choices=[CompletionChoice(index=i, text=e)]))
        async for i, chunk in session.chunks():
            lps = _completion_logprobs(chunk.logprobs, state.tok, offsets[i]) if req.logprobs is not None else None
            offsets[i] += len(chunk.text)
            if chunk.text or chunk.finish_reason is not None:
                choice = CompletionChoice(index=i, text=chunk.text, logprobs=lps,
                                          finish_reason=_openai_finish(chunk.finish_reason))
                yield sse_event(CompletionStreamResponse(id=rid, created=created, model=model, choices=[choice]))
        if include_usage:
            yield sse_event(CompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                     usage=session.usage()))

    return session.response(events())


async def _stream_chat(state: ServerState, jobs: list[Job], model: str, req: ChatCompletionRequest,
                       tracker: RequestTracker, with_tools: bool = False) -> StreamingResponse:
    """Chat chunks as they come; with tools, a choice's text is held back until it finishes and then
    sent as one delta of tool_calls (or of content, when the model answered in text)."""
    session = await open_streams(state, jobs, tracker)
    rid, created = new_id("chatcmpl"), int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def event(i: int, delta: DeltaMessage, finish: str | None = None, logprobs: ChoiceLogprobs | None = None) -> str:
        choice = ChatCompletionStreamChoice(index=i, delta=delta, finish_reason=finish, logprobs=logprobs)
        return sse_event(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[choice]))

    async def events() -> AsyncGenerator[str, None]:
        for i in range(len(jobs)):
            yield event(i, DeltaMessage(role="assistant", content=""))
        async for i, chunk in session.chunks():
            lps = _chat_logprobs(chunk.logprobs, state.tok) if req.logprobs else None
            if chunk.text and not with_tools:
                yield event(i, DeltaMessage(content=chunk.text), logprobs=lps)
                lps = None
            if chunk.finish_reason is not None:  # a textless last token (EOS) keeps its logprob, as unstreamed
                finish = _openai_finish(chunk.finish_reason)
                if with_tools:
                    message, finish = tool_reply(session.texts[i], finish)
                    yield event(i, DeltaMessage(content=message.content, tool_calls=message.tool_calls))
                yield event(i, DeltaMessage(), finish=finish, logprobs=lps)
        if include_usage:
            yield sse_event(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                         usage=session.usage()))

    return session.response(events())
