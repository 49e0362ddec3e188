"""Haystack adapter: `RadixChatGenerator`, a Haystack chat generator component on the in-process engine.

Drop it into a pipeline or an `Agent` where `OpenAIChatGenerator` would go: `run` / `run_async` take
Haystack `ChatMessage`s (and `tools`), return `{"replies": [...]}`, stream through
`streaming_callback`, and serialize with the pipeline (`to_dict` / `from_dict`). All generators in
a process share one engine and one radix cache, so a RAG pipeline's fixed instructions and retrieved
passages, or an agent's growing history, are computed once.

Tool calls decode under the JSON schema of the offered tools' calls (`radix_backend.tool_calls`), so
they always parse into `ChatMessage.tool_calls`; `response_format` (a JSON schema or a pydantic
class) decodes under its schema. Usage in `meta["usage"]` reports the cache's hits as
`prompt_tokens_details.cached_tokens`. Generation kwargs the engine would ignore are refused by name.
"""

from __future__ import annotations

import json
from typing import Any

from ._common import Usage, require, resolve_engine, sampling_params, to_json_schema

require("haystack", "haystack", "haystack-ai")

from haystack import component, default_from_dict, default_to_dict  # noqa: E402
from haystack.dataclasses import ChatMessage, ChatRole, ComponentInfo, StreamingChunk, ToolCall  # noqa: E402
from haystack.dataclasses.streaming_chunk import ToolCallDelta, select_streaming_callback  # noqa: E402
from haystack.tools import deserialize_tools_or_toolset_inplace, flatten_tools_or_toolsets  # noqa: E402
from haystack.tools import serialize_tools_or_toolset  # noqa: E402
from haystack.utils import deserialize_callable, serialize_callable  # noqa: E402

from radix_backend.engine_like import EngineLike  # noqa: E402
from radix_backend.errors import InvalidRequestError  # noqa: E402
from radix_backend.outputs import GenerateOutput  # noqa: E402
from radix_backend.paths import public_model_name  # noqa: E402
from radix_backend.sampling_params import SamplingParams  # noqa: E402
from radix_backend.tool_calls import (ToolSpec, choose_tools, constrain_to_tools,  # noqa: E402
                                      parse_complete_tool_reply, tool_call_json)

__all__ = ["RadixChatGenerator"]

DEFAULT_MAX_TOKENS = 512
_CALL_KWARGS = ("response_format", "tool_choice", "parallel_tool_calls")  # shape the reply, not the sampler


def to_engine_message(message: ChatMessage) -> dict[str, str]:
    """A Haystack message as the engine's {"role", "content"} dict (tool calls in the model's JSON shape)."""
    if message.images or message.files:
        raise InvalidRequestError("this engine takes text messages only (no images or files)")
    if message.role == ChatRole.TOOL:
        result = message.tool_call_result
        if result is None or not isinstance(result.result, str):
            raise InvalidRequestError("a tool message needs a text tool_call_result")
        return {"role": "tool", "content": result.result}
    if message.role == ChatRole.ASSISTANT and message.tool_calls:
        calls = [{"name": c.tool_name, "arguments": c.arguments} for c in message.tool_calls]
        return {"role": "assistant", "content": tool_call_json(calls)}
    return {"role": message.role.value, "content": message.text or ""}


def _response_schema(response_format: Any) -> dict[str, Any] | None:
    if response_format is None:
        return None
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        spec = response_format.get("json_schema") or {}
        if "schema" not in spec:
            raise InvalidRequestError("response_format json_schema has no 'schema'")
        return to_json_schema(spec["schema"])[0]
    if isinstance(response_format, dict) and response_format.get("type") == "json_object":
        return {"type": "object"}
    return to_json_schema(response_format)[0]  # a pydantic class or a bare JSON schema


@component
class RadixChatGenerator:
    """Haystack chat generator on the radix engine (the process-shared one unless `engine` is given).

    `model` picks another checkpoint for the shared engine's first creation, as `get_engine` does;
    `generation_kwargs` are defaults for every run (`max_tokens`, `temperature`, `stop`, ...,
    `response_format`, `tool_choice`); `tools` are offered on every run unless `run` passes its own.
    """

    def __init__(self, engine: EngineLike | None = None, *, model: str | None = None,
                 generation_kwargs: dict[str, Any] | None = None, streaming_callback: Any = None,
                 tools: Any = None) -> None:
        self._engine = engine
        self.model = model
        self.generation_kwargs = dict(generation_kwargs or {})
        self.streaming_callback = streaming_callback
        self.tools = tools
        self._split_kwargs(self.generation_kwargs)  # refuse unknown names at construction

    @property
    def engine(self) -> EngineLike:
        if self._engine is None:
            self._engine = resolve_engine(None, self.model)
        return self._engine

    def warm_up(self) -> None:
        """Load the shared engine now (pipelines call this before the first run)."""
        _ = self.engine

    def to_dict(self) -> dict[str, Any]:
        return default_to_dict(self, model=self.model, generation_kwargs=self.generation_kwargs,
                               streaming_callback=serialize_callable(self.streaming_callback)
                               if self.streaming_callback else None,
                               tools=serialize_tools_or_toolset(self.tools))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RadixChatGenerator:
        params = data.get("init_parameters", {})
        if params.get("streaming_callback"):
            params["streaming_callback"] = deserialize_callable(params["streaming_callback"])
        deserialize_tools_or_toolset_inplace(params, key="tools")
        return default_from_dict(cls, data)

    @staticmethod
    def _split_kwargs(kwargs: dict[str, Any]) -> tuple[SamplingParams, dict[str, Any]]:
        sampler = {k: v for k, v in kwargs.items() if k not in _CALL_KWARGS}
        if "max_completion_tokens" in sampler:
            sampler["max_tokens"] = sampler.pop("max_completion_tokens")
        if isinstance(sampler.get("stop"), str):
            sampler["stop"] = [sampler["stop"]]
        sampler.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
        sampler.setdefault("temperature", 0.0)  # an unset temperature runs greedy
        return sampling_params({}, sampler), {k: kwargs[k] for k in _CALL_KWARGS if k in kwargs}

    def _prepare(self, messages: list[ChatMessage] | str, generation_kwargs: dict[str, Any] | None,
                 tools: Any) -> tuple[list[dict[str, str]], SamplingParams, bool]:
        if isinstance(messages, str):
            messages = [ChatMessage.from_user(messages)]
        if not messages:
            raise InvalidRequestError("messages must not be empty")
        params, call = self._split_kwargs({**self.generation_kwargs, **(generation_kwargs or {})})
        engine_messages = [to_engine_message(m) for m in messages]
        offered = flatten_tools_or_toolsets(tools if tools is not None else self.tools)
        specs, allow_text = choose_tools([ToolSpec(t.name, t.description or "", t.parameters) for t in offered],
                                         call.get("tool_choice"))
        if specs:
            if call.get("response_format") is not None:
                raise InvalidRequestError("tools and response_format cannot be combined in one call")
            engine_messages, params = constrain_to_tools(engine_messages, params, specs, allow_text=allow_text,
                                                         parallel=bool(call.get("parallel_tool_calls")), stop=[])
            return engine_messages, params, True
        schema = _response_schema(call.get("response_format"))
        return engine_messages, (params if schema is None else params.copy(json_schema=schema)), False

    def _reply(self, text: str, finish_reason: str | None, usage: Usage, tool_mode: bool) -> ChatMessage:
        calls: list[ToolCall] = []
        if tool_mode:
            parsed = parse_complete_tool_reply(text, finish_reason)
            text, calls = parsed.text, [ToolCall(tool_name=c["name"], arguments=c["args"], id=c["id"])
                                        for c in parsed.calls]
        reason = "tool_calls" if calls else ("length" if finish_reason == "length" else "stop")
        meta = {"model": public_model_name(self.engine.model_id), "index": 0, "finish_reason": reason,
                "usage": usage.as_openai()}
        return ChatMessage.from_assistant(text=text or (None if calls else ""), tool_calls=calls, meta=meta)

    @component.output_types(replies=list[ChatMessage])
    def run(self, messages: list[ChatMessage] | str, streaming_callback: Any = None,
            generation_kwargs: dict[str, Any] | None = None, *, tools: Any = None,
            tools_strict: bool | None = None) -> dict[str, list[ChatMessage]]:
        """One reply to `messages` (`tools_strict` is accepted: tool calls are always schema-exact)."""
        engine_messages, params, tool_mode = self._prepare(messages, generation_kwargs, tools)
        callback = select_streaming_callback(self.streaming_callback, streaming_callback, requires_async=False)
        if callback is None:
            out: GenerateOutput = self.engine.generate(messages=engine_messages, params=params)
            return {"replies": [self._reply(out.text, out.finish_reason, Usage.from_meta(out.meta), tool_mode)]}
        stream = _Stream(self, tool_mode)
        for chunk in self.engine.stream(messages=engine_messages, params=params):
            for event in stream.feed(chunk):
                callback(event)
        return {"replies": [stream.reply()]}

    @component.output_types(replies=list[ChatMessage])
    async def run_async(self, messages: list[ChatMessage] | str, streaming_callback: Any = None,
                        generation_kwargs: dict[str, Any] | None = None, *, tools: Any = None,
                        tools_strict: bool | None = None) -> dict[str, list[ChatMessage]]:
        engine_messages, params, tool_mode = self._prepare(messages, generation_kwargs, tools)
        callback = select_streaming_callback(self.streaming_callback, streaming_callback, requires_async=True)
        if callback is None:
            out = await self.engine.agenerate(messages=engine_messages, params=params)
            return {"replies": [self._reply(out.text, out.finish_reason, Usage.from_meta(out.meta), tool_mode)]}
        stream = _Stream(self, tool_mode)
        async for chunk in self.engine.astream(messages=engine_messages, params=params):
            for event in stream.feed(chunk):
                await callback(event)
        return {"replies": [stream.reply()]}


class _Stream:
    """One streamed reply: text chunks pass to the callback token by token; a tool call goes as one
    chunk once its JSON is complete. The reply is built once, from the finishing chunk."""

    def __init__(self, generator: RadixChatGenerator, tool_mode: bool) -> None:
        self.generator, self.tool_mode = generator, tool_mode
        self.info = ComponentInfo.from_component(generator)
        self.meta = {"model": public_model_name(generator.engine.model_id)}
        self.text: list[str] = []
        self.finished: ChatMessage | None = None

    def feed(self, chunk: Any) -> list[StreamingChunk]:
        first = not self.text
        self.text.append(chunk.text)
        if chunk.finish_reason is not None:
            self.finished = self.generator._reply("".join(self.text), chunk.finish_reason,
                                                  Usage.from_meta(chunk.meta), self.tool_mode)
        if not self.tool_mode:
            reason = self.finished.meta["finish_reason"] if self.finished is not None else None
            return [StreamingChunk(content=chunk.text, meta=self.meta, component_info=self.info, index=0, start=first,
                                   finish_reason=reason)]
        if self.finished is None:
            return []
        reply = self.finished
        deltas = [ToolCallDelta(index=i, tool_name=c.tool_name, arguments=json.dumps(c.arguments), id=c.id)
                  for i, c in enumerate(reply.tool_calls)]
        return [StreamingChunk(content=reply.text or "", meta=self.meta, component_info=self.info, index=0,
                               start=True, tool_calls=deltas or None, finish_reason=reply.meta["finish_reason"])]

    def reply(self) -> ChatMessage:
        if self.finished is None:  # a stream cut short: what it produced, without usage
            return self.generator._reply("".join(self.text), None, Usage.from_meta(None), self.tool_mode)
        return self.finished
