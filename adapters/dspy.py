"""DSPy adapter: DSPy's engine contract on the radix engine, so `dspy.LM` runs in process.

`RadixLM()` is a `dspy.LM` whose engine is `RadixDSPyEngine` (DSPy 3.4's custom-engine interface:
`complete(Request) -> Response`, `stream`, `close`, and its async twin), on the process-shared
engine by default. DSPy programs send the same instructions, demos and fields again and again
(few-shot optimizers above all); the radix cache serves those prefixes, and usage reports them as
`cache_read_tokens`. A JSON schema in `response_format` (DSPy's JSONAdapter asks for one) is decoded
under that schema, so the reply always parses. Usage: `dspy.configure(lm=RadixLM())`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from ._common import require, resolve_engine

require("dspy", "dspy")

import dspy  # noqa: E402
from dspy.clients.engines.base import validate_request  # noqa: E402
from dspy.lm15 import (Message, Request, Response, StreamDeltaEvent, StreamEndEvent, StreamStartEvent,  # noqa: E402
                       TextDelta, TextPart, Usage)

from radix_backend.engine_like import EngineLike  # noqa: E402
from radix_backend.errors import InvalidRequestError  # noqa: E402
from radix_backend.outputs import GenerateOutput, RequestMeta, StreamChunk  # noqa: E402
from radix_backend.paths import public_model_name  # noqa: E402
from radix_backend.sampling_params import SamplingParams  # noqa: E402

__all__ = ["RadixDSPyEngine", "AsyncRadixDSPyEngine", "RadixLM"]

DEFAULT_MAX_TOKENS = 512  # when neither the LM nor the call sets max_tokens
# Config fields DSPy may set that the engine honours; any other set field is refused by name.
_SUPPORTED_CONFIG = ("max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "frequency_penalty",
                     "presence_penalty", "response_format")
_ROLES = {"user": "user", "assistant": "assistant", "developer": "system"}
SUPPORTED_PARAMS = frozenset(_SUPPORTED_CONFIG)


def _text_of(parts: Any, where: str) -> str:
    if isinstance(parts, str):
        return parts
    texts = []
    for part in parts:
        if not isinstance(part, TextPart):
            raise InvalidRequestError(f"{where} holds a {type(part).__name__}; this engine takes text only")
        texts.append(part.text)
    return "".join(texts)


def chat_messages(request: Request) -> list[dict[str, str]]:
    """The request's system text and messages as the engine's {"role", "content"} dicts."""
    messages = []
    if request.system:
        messages.append({"role": "system", "content": _text_of(request.system, "the system prompt")})
    for message in request.messages:
        role = _ROLES.get(message.role)
        if role is None:
            raise InvalidRequestError(f"a {message.role!r} message: tool results need tool calling, which this "
                                      "engine does not offer through DSPy")
        messages.append({"role": role, "content": _text_of(message.parts, f"a {message.role} message")})
    return messages


def _json_schema(response_format: Any) -> Any:
    """The JSON schema to decode under, from an OpenAI-style response_format (None: free text)."""
    if response_format is None:
        return None
    if isinstance(response_format, type) and hasattr(response_format, "model_json_schema"):
        return response_format.model_json_schema()
    kind = response_format.get("type")
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":  # lm15's canonical shape: {"type", "schema", "name"?, "strict"?}
        if "schema" not in response_format:
            raise InvalidRequestError("response_format json_schema has no 'schema'")
        return response_format["schema"]
    if kind == "text":
        return None
    raise InvalidRequestError(f"response_format type {kind!r} is not supported; use json_schema or json_object")


def sampling_params(request: Request, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> SamplingParams:
    """The request's Config as SamplingParams; a set field the engine would ignore is an error."""
    config = request.config
    unsupported = [name for name in ("tool_choice", "reasoning", "logprobs", "probabilities", "cache",
                                     "service_tier", "user_id", "store") if getattr(config, name) is not None]
    if config.extensions:
        unsupported += [f"extensions.{key}" for key in config.extensions]
    if request.tools:
        unsupported.append("tools")
    if unsupported:
        raise InvalidRequestError(f"not supported by the radix DSPy engine: {', '.join(unsupported)}")
    params = SamplingParams(
        max_new_tokens=config.max_tokens or default_max_tokens,
        temperature=0.0 if config.temperature is None else config.temperature,
        top_p=1.0 if config.top_p is None else config.top_p, top_k=config.top_k or -1, stop=list(config.stop),
        seed=config.seed, frequency_penalty=config.frequency_penalty or 0.0,
        presence_penalty=config.presence_penalty or 0.0, json_schema=_json_schema(config.response_format))
    params.validate()
    return params


def _usage(meta: RequestMeta | None) -> Usage:
    if meta is None:
        return Usage()
    return Usage(input_tokens=meta.prompt_tokens, output_tokens=meta.completion_tokens,
                 cache_read_tokens=meta.cached_tokens)


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


class _RadixEngineBase:
    """What both engines share: the radix engine, the model name, DSPy's capability hints."""

    supports_function_calling = False
    supports_reasoning = False
    supports_response_schema = True  # DSPy's JSONAdapter then asks for the signature's schema
    supported_params = SUPPORTED_PARAMS

    def __init__(self, engine: EngineLike | None = None, model: str | None = None, *,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.engine = resolve_engine(engine, model)
        self.model_name = public_model_name(self.engine.model_id)
        self.default_max_tokens = default_max_tokens

    def _prepare(self, request: Request) -> tuple[list[dict[str, str]], SamplingParams]:
        validate_request(request)
        return chat_messages(request), sampling_params(request, self.default_max_tokens)

    def _response(self, out: GenerateOutput) -> Response:
        return Response(id=out.request_id or None, model=self.model_name,
                        message=Message.assistant([TextPart(out.text)]), finish_reason=_finish(out.finish_reason),
                        usage=_usage(out.meta))

    def _events(self, chunk: StreamChunk) -> list[Any]:
        events: list[Any] = [StreamDeltaEvent(delta=TextDelta(text=chunk.text))] if chunk.text else []
        if chunk.finish_reason is not None:
            events.append(StreamEndEvent(finish_reason=_finish(chunk.finish_reason), usage=_usage(chunk.meta)))
        return events


class RadixDSPyEngine(_RadixEngineBase):
    """DSPy's sync engine contract. The radix engine is borrowed: `close()` leaves it running."""

    def complete(self, request: Request) -> Response:
        messages, params = self._prepare(request)
        return self._response(self.engine.generate(messages=messages, params=params))

    def stream(self, request: Request) -> Iterator[Any]:
        messages, params = self._prepare(request)
        yield StreamStartEvent(model=self.model_name)
        for chunk in self.engine.stream(messages=messages, params=params):
            yield from self._events(chunk)

    def close(self) -> None:
        pass


class AsyncRadixDSPyEngine(_RadixEngineBase):
    """DSPy's async engine contract (`lm.acall`, `dspy.asyncify` programs), on the engine's loop-safe calls."""

    async def complete(self, request: Request) -> Response:
        messages, params = self._prepare(request)
        return self._response(await self.engine.agenerate(messages=messages, params=params))

    async def stream(self, request: Request) -> AsyncIterator[Any]:
        messages, params = self._prepare(request)
        yield StreamStartEvent(model=self.model_name)
        async for chunk in self.engine.astream(messages=messages, params=params):
            for event in self._events(chunk):
                yield event

    async def aclose(self) -> None:
        pass


def RadixLM(engine: EngineLike | None = None, model: str | None = None, **lm_kwargs: Any) -> dspy.LM:
    """A `dspy.LM` on the radix engine (the process-shared one of `model` unless `engine` is given).
    `lm_kwargs` are dspy.LM's own (temperature, max_tokens, cache, ...)."""
    radix = resolve_engine(engine, model)
    name = f"radix-backend/{public_model_name(radix.model_id)}"
    return dspy.LM(name, engine=RadixDSPyEngine(radix), async_engine=AsyncRadixDSPyEngine(radix), **lm_kwargs)
