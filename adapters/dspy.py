"""DSPy adapter: DSPy's engine contract on the radix engine, so `dspy.LM` runs in process.

`RadixLM()` is a `dspy.LM` whose engine is `RadixDSPyEngine` (DSPy 3.4's custom-engine interface:
`complete(Request) -> Response`, `stream`, `close`, and its async twin), on the process-shared
engine by default. DSPy programs send the same instructions, demos and fields again and again
(few-shot optimizers above all); the radix cache serves those prefixes, and usage reports them as
`cache_read_tokens`. A JSON schema in `response_format` (DSPy's JSONAdapter asks for one) is decoded
under that schema, so the reply always parses; function tools (DSPy's native function calling) decode
under the JSON schema of the allowed calls. Usage: `dspy.configure(lm=RadixLM())`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from ._common import Usage as TokenCounts, require, resolve_engine

require("dspy", "dspy")

import dspy  # noqa: E402
from dspy.clients.engines.base import validate_request  # noqa: E402
from dspy.lm15 import (FunctionTool, Message, Request, Response, StreamDeltaEvent, StreamEndEvent,  # noqa: E402
                       StreamStartEvent, TextDelta, TextPart, ToolCallDelta, ToolCallPart, ToolResultPart, Usage)

from radix_backend.engine_like import EngineLike  # noqa: E402
from radix_backend.errors import InvalidRequestError  # noqa: E402
from radix_backend.outputs import GenerateOutput, RequestMeta, StreamChunk  # noqa: E402
from radix_backend.paths import public_model_name  # noqa: E402
from radix_backend.sampling_params import SamplingParams  # noqa: E402
from radix_backend.tool_calls import (ToolSpec, choose_tools, constrain_to_tools,  # noqa: E402
                                      parse_complete_tool_reply, tool_call_json)

__all__ = ["RadixDSPyEngine", "AsyncRadixDSPyEngine", "RadixLM"]

DEFAULT_MAX_TOKENS = 512  # when neither the LM nor the call sets max_tokens
# Config fields DSPy may set that the engine honours; any other set field is refused by name.
_SUPPORTED_CONFIG = ("max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "frequency_penalty",
                     "presence_penalty", "response_format", "tool_choice")
_ROLES = {"user": "user", "assistant": "assistant", "developer": "system", "tool": "tool"}
SUPPORTED_PARAMS = frozenset(_SUPPORTED_CONFIG)


def _text_of(parts: Any, where: str) -> str:
    if isinstance(parts, str):
        return parts
    texts, calls = [], []
    for part in parts:
        if isinstance(part, TextPart):
            texts.append(part.text)
        elif isinstance(part, ToolCallPart):  # an earlier call, replayed in the JSON shape the model writes
            calls.append({"name": part.name, "arguments": dict(part.input)})
        elif isinstance(part, ToolResultPart):
            texts.append(_text_of(part.content, f"the result of tool call {part.id}"))
        else:
            raise InvalidRequestError(f"{where} holds a {type(part).__name__}; this engine takes text only")
    if calls:
        return tool_call_json(calls)
    return "".join(texts)


def chat_messages(request: Request) -> list[dict[str, str]]:
    """The request's system text and messages as the engine's {"role", "content"} dicts."""
    messages = []
    if request.system:
        messages.append({"role": "system", "content": _text_of(request.system, "the system prompt")})
    for message in request.messages:
        role = _ROLES.get(message.role)
        if role is None:
            raise InvalidRequestError(f"a {message.role!r} message is not supported by this engine")
        messages.append({"role": role, "content": _text_of(message.parts, f"a {message.role} message")})
    return messages


def tool_plan(request: Request) -> tuple[list[ToolSpec], bool, bool]:
    """(tools the reply may call, whether text is allowed, parallel calls) from the request's tools
    and its Config.tool_choice."""
    specs = []
    for tool in request.tools:
        if not isinstance(tool, FunctionTool):
            raise InvalidRequestError(f"tool {tool.name!r} is a provider built-in; this engine calls function tools")
        specs.append(ToolSpec(tool.name, tool.description or "", dict(tool.parameters)))
    choice = request.config.tool_choice
    if choice is None:
        return (*choose_tools(specs, "auto"), False)
    if choice.allowed:
        specs = [s for s in specs if s.name in choice.allowed]
    return (*choose_tools(specs, choice.mode), bool(choice.parallel))


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
    unsupported = [name for name in ("reasoning", "logprobs", "probabilities", "cache",
                                     "service_tier", "user_id", "store") if getattr(config, name) is not None]
    if config.extensions:
        unsupported += [f"extensions.{key}" for key in config.extensions]
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
        return Usage()  # unknown, not zero
    return Usage(**TokenCounts.from_meta(meta).as_input_output())


def _finish(reason: str | None, tool_calls: bool = False) -> str:
    return "length" if reason == "length" else ("tool_call" if tool_calls else "stop")


class _RadixEngineBase:
    """What both engines share: the radix engine, the model name, DSPy's capability hints."""

    supports_function_calling = True  # calls decode under the tools' JSON schema
    supports_reasoning = False
    supports_response_schema = True  # DSPy's JSONAdapter then asks for the signature's schema
    supported_params = SUPPORTED_PARAMS

    def __init__(self, engine: EngineLike | None = None, model: str | None = None, *,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.engine = resolve_engine(engine, model)
        self.model_name = public_model_name(self.engine.model_id)
        self.default_max_tokens = default_max_tokens

    def _prepare(self, request: Request) -> tuple[list[dict[str, str]], SamplingParams, bool]:
        """(messages, params, whether the reply is a constrained tool call)."""
        validate_request(request)
        messages, params = chat_messages(request), sampling_params(request, self.default_max_tokens)
        specs, allow_text, parallel = tool_plan(request)
        if not specs:
            return messages, params, False
        if params.json_schema is not None:
            raise InvalidRequestError("tools and a response_format cannot be combined in one request")
        messages, params = constrain_to_tools(messages, params, specs, allow_text=allow_text, parallel=parallel)
        return messages, params, True

    @staticmethod
    def _parts(text: str, finish_reason: str | None, tool_mode: bool) -> list[Any]:
        if not tool_mode:
            return [TextPart(text)]
        parsed = parse_complete_tool_reply(text, finish_reason)
        return ([TextPart(parsed.text)] if parsed.text else []) + [
            ToolCallPart(id=c["id"], name=c["name"], input=c["args"]) for c in parsed.calls]

    def _response(self, out: GenerateOutput, tool_mode: bool) -> Response:
        parts = self._parts(out.text, out.finish_reason, tool_mode)
        calls = any(isinstance(p, ToolCallPart) for p in parts)
        return Response(id=out.request_id or None, model=self.model_name, message=Message.assistant(parts),
                        finish_reason=_finish(out.finish_reason, calls), usage=_usage(out.meta))

    def _events(self, chunk: StreamChunk, tool_mode: bool, so_far: list[str]) -> list[Any]:
        """Text deltas token by token; in tool mode the calls as deltas once the JSON is complete."""
        if not tool_mode:
            events: list[Any] = [StreamDeltaEvent(delta=TextDelta(text=chunk.text))] if chunk.text else []
        else:
            so_far.append(chunk.text)
            events = []
        if chunk.finish_reason is None:
            return events
        calls = False
        if tool_mode:
            for i, part in enumerate(self._parts("".join(so_far), chunk.finish_reason, True)):
                if isinstance(part, ToolCallPart):
                    calls = True
                    events.append(StreamDeltaEvent(delta=ToolCallDelta(input=json.dumps(dict(part.input)),
                                                                       part_index=i, id=part.id, name=part.name)))
                else:
                    events.append(StreamDeltaEvent(delta=TextDelta(text=part.text)))
        events.append(StreamEndEvent(finish_reason=_finish(chunk.finish_reason, calls), usage=_usage(chunk.meta)))
        return events


class RadixDSPyEngine(_RadixEngineBase):
    """DSPy's sync engine contract. The radix engine is borrowed: `close()` leaves it running."""

    def complete(self, request: Request) -> Response:
        messages, params, tool_mode = self._prepare(request)
        return self._response(self.engine.generate(messages=messages, params=params), tool_mode)

    def stream(self, request: Request) -> Iterator[Any]:
        messages, params, tool_mode = self._prepare(request)
        yield StreamStartEvent(model=self.model_name)
        so_far: list[str] = []
        for chunk in self.engine.stream(messages=messages, params=params):
            yield from self._events(chunk, tool_mode, so_far)

    def close(self) -> None:
        pass


class AsyncRadixDSPyEngine(_RadixEngineBase):
    """DSPy's async engine contract (`lm.acall`, `dspy.asyncify` programs), on the engine's loop-safe calls."""

    async def complete(self, request: Request) -> Response:
        messages, params, tool_mode = self._prepare(request)
        return self._response(await self.engine.agenerate(messages=messages, params=params), tool_mode)

    async def stream(self, request: Request) -> AsyncIterator[Any]:
        messages, params, tool_mode = self._prepare(request)
        yield StreamStartEvent(model=self.model_name)
        so_far: list[str] = []
        async for chunk in self.engine.astream(messages=messages, params=params):
            for event in self._events(chunk, tool_mode, so_far):
                yield event

    async def aclose(self) -> None:
        pass


def RadixLM(engine: EngineLike | None = None, model: str | None = None, **lm_kwargs: Any) -> dspy.LM:
    """A `dspy.LM` on the radix engine (the process-shared one of `model` unless `engine` is given).
    `lm_kwargs` are dspy.LM's own (temperature, max_tokens, cache, ...)."""
    radix = resolve_engine(engine, model)
    name = f"radix-backend/{public_model_name(radix.model_id)}"
    return dspy.LM(name, engine=RadixDSPyEngine(radix), async_engine=AsyncRadixDSPyEngine(radix), **lm_kwargs)
