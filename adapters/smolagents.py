"""smolagents adapter: `CodeAgent(tools, model=RadixSmolModel())` runs agents on the in-process engine.

`RadixSmolModel` implements smolagents' `Model` (`generate`, `generate_stream`) on the process-shared
engine by default. An agent resends its long system prompt (tool descriptions, examples) and the
growing memory on every step; the radix cache computes them once.

Tool calls (`ToolCallingAgent`) decode under the JSON schema of the offered tools' calls
(`radix_backend.tool_calls`), so every call parses into `ChatMessage.tool_calls`; a
`response_format` JSON schema (`CodeAgent(use_structured_outputs_internally=True)`) decodes under
that schema; stop sequences end generation in the engine. An unset temperature runs greedy.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from ._common import require, resolve_engine, sampling_params

require("smolagents", "smolagents")

from smolagents.models import (  # noqa: E402
    ChatMessage,
    ChatMessageStreamDelta,
    ChatMessageToolCall,
    ChatMessageToolCallFunction,
    ChatMessageToolCallStreamDelta,
    MessageRole,
    Model,
)
from smolagents.monitoring import TokenUsage  # noqa: E402

from radix_backend.engine_like import EngineLike  # noqa: E402
from radix_backend.errors import InvalidRequestError  # noqa: E402
from radix_backend.outputs import GenerateOutput, RequestMeta  # noqa: E402
from radix_backend.paths import public_model_name  # noqa: E402
from radix_backend.sampling_params import SamplingParams  # noqa: E402
from radix_backend.tool_calls import (  # noqa: E402
    ToolSpec,
    choose_tools,
    close_objects,
    constrain_to_tools,
    parse_complete_tool_reply,
)

__all__ = ["RadixSmolModel"]

# a CodeAgent step writes a thought and a code block; an unset temperature runs greedy
GREEDY_DEFAULTS = {"max_tokens": 1024, "temperature": 0.0}


@dataclass
class Prepared:
    """One smolagents call ready for the engine."""

    messages: list[dict[str, Any]]
    params: SamplingParams
    tool_mode: bool  # the reply is a constrained tool-call JSON to parse


def _tool_specs(tools: list[dict[str, Any]]) -> list[ToolSpec]:
    return [ToolSpec(t["function"]["name"], t["function"].get("description", ""), t["function"]["parameters"])
            for t in tools]


def _response_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        if "schema" not in spec:
            raise InvalidRequestError("response_format json_schema has no 'schema'")
        return close_objects(spec["schema"])
    if kind == "json_object":
        return {"type": "object"}
    raise InvalidRequestError(f"response_format type {kind!r} is not supported; use json_schema or json_object")


def _holds_image(message: Any) -> bool:
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
    return isinstance(content, list) and any(isinstance(e, dict) and e.get("type") == "image" for e in content)


def _as_parts(message: Any) -> Any:
    """An OpenAI-style dict with string content in smolagents' own form (a list of text parts)."""
    if isinstance(message, dict) and isinstance(message.get("content"), str):
        return {**message, "content": [{"type": "text", "text": message["content"]}]}
    return message


def _usage(meta: RequestMeta | None) -> TokenUsage:
    return TokenUsage(input_tokens=meta.prompt_tokens if meta else 0, output_tokens=meta.completion_tokens if meta else 0)


def _tool_calls(text: str, finish_reason: str | None) -> tuple[str, list[ChatMessageToolCall]]:
    parsed = parse_complete_tool_reply(text, finish_reason)
    return parsed.text, [ChatMessageToolCall(function=ChatMessageToolCallFunction(name=c["name"], arguments=c["args"]),
                                             id=c["id"], type="function") for c in parsed.calls]


class RadixSmolModel(Model):
    """smolagents `Model` on the radix engine (the process-shared one unless `engine` is given).

    `model` picks another checkpoint for the shared engine's first creation, as `get_engine` does;
    further keyword arguments are default completion kwargs (`max_tokens`, `temperature`, ...,
    any `SamplingParams` field); an unknown one is an error.
    """

    def __init__(self, engine: EngineLike | None = None, *, model: str | None = None, **kwargs: Any) -> None:
        sampling_params(GREEDY_DEFAULTS, kwargs)  # an unknown name is an error now, not at the first call
        self.engine = resolve_engine(engine, model)
        super().__init__(flatten_messages_as_text=True, model_id=public_model_name(self.engine.model_id), **kwargs)

    @property
    def supports_stop_parameter(self) -> bool:
        return True

    def _prepare(self, messages: list[Any], stop_sequences: list[str] | None, response_format: dict[str, Any] | None,
                 tools_to_call_from: list[Any] | None, kwargs: dict[str, Any]) -> Prepared:
        if any(_holds_image(m) for m in messages):
            raise InvalidRequestError("this engine takes text messages only (no images)")
        messages = [_as_parts(m) for m in messages]
        completion = self._prepare_completion_kwargs(messages=messages, stop_sequences=stop_sequences,
                                                     tools_to_call_from=tools_to_call_from, **kwargs)
        engine_messages = [{"role": str(getattr(m["role"], "value", m["role"])), "content": m.get("content") or ""}
                           for m in completion.pop("messages")]
        stop = completion.pop("stop", None) or []
        tools, tool_choice = completion.pop("tools", None), completion.pop("tool_choice", None)
        params = sampling_params(GREEDY_DEFAULTS, {**completion, "json_schema": _response_schema(response_format)},
                                 stop=list(stop))
        specs, allow_text = choose_tools(_tool_specs(tools or []), tool_choice)
        if specs:
            if params.json_schema is not None:
                raise InvalidRequestError("tools and a response_format cannot be combined in one call")
            # smolagents' stop sequences ("Observation:") are for text steps; they must not cut a call
            engine_messages, params = constrain_to_tools(engine_messages, params, specs, allow_text=allow_text,
                                                         stop=[])
        params.validate()
        return Prepared(engine_messages, params, bool(specs))

    def generate(self, messages: list[Any], stop_sequences: list[str] | None = None,
                 response_format: dict[str, Any] | None = None, tools_to_call_from: list[Any] | None = None,
                 **kwargs: Any) -> ChatMessage:
        prepared = self._prepare(messages, stop_sequences, response_format, tools_to_call_from, kwargs)
        out: GenerateOutput = self.engine.generate(messages=prepared.messages, params=prepared.params)
        content, calls = (out.text, None) if not prepared.tool_mode else _tool_calls(out.text, out.finish_reason)
        return ChatMessage(role=MessageRole.ASSISTANT, content=content or None if calls else content,
                           tool_calls=calls or None, raw={"text": out.text, "finish_reason": out.finish_reason},
                           token_usage=_usage(out.meta))

    def generate_stream(self, messages: list[Any], stop_sequences: list[str] | None = None,
                        response_format: dict[str, Any] | None = None, tools_to_call_from: list[Any] | None = None,
                        **kwargs: Any) -> Generator[ChatMessageStreamDelta]:
        """Text token by token; a tool call once its constrained JSON is complete. Usage comes with
        the last delta."""
        prepared = self._prepare(messages, stop_sequences, response_format, tools_to_call_from, kwargs)
        text: list[str] = []
        for chunk in self.engine.stream(messages=prepared.messages, params=prepared.params):
            if prepared.tool_mode:
                text.append(chunk.text)
            elif chunk.text:
                yield ChatMessageStreamDelta(content=chunk.text)
            if chunk.finish_reason is not None:
                usage = _usage(chunk.meta)
                if not prepared.tool_mode:
                    yield ChatMessageStreamDelta(token_usage=usage)
                    continue
                content, calls = _tool_calls("".join(text), chunk.finish_reason)
                deltas = [ChatMessageToolCallStreamDelta(
                    index=i, id=c.id, type="function",
                    function=ChatMessageToolCallFunction(name=c.function.name, arguments=json.dumps(c.function.arguments)))
                    for i, c in enumerate(calls)]
                yield ChatMessageStreamDelta(content=content or None, tool_calls=deltas or None, token_usage=usage)
