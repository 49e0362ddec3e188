"""pydantic-ai adapter: `Agent(RadixModel())` runs agents on the in-process radix engine.

`RadixModel` implements pydantic-ai's `Model` interface (`request`, `request_stream`,
`count_tokens`) on the process-shared engine by default, so agents share the radix cache with
every other framework in the process: an agent loop resends its instructions, tools and the whole
history on every step, and the cache serves all of it again. Usage reports the served prefix as
`cache_read_tokens`.

Tool calls and tool-mode structured output (`output_type=...`, pydantic-ai's default) decode under
the JSON schema of the allowed calls (`radix_backend.tool_calls`), so every call parses; native
structured output (`NativeOutput`) decodes under the output's own schema. Model settings the
engine would ignore (`logit_bias`, `extra_body`, ...) are refused by name. An unset temperature
runs greedy.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ._common import Usage, require, resolve_engine

require("pydantic_ai", "pydantic-ai", "pydantic-ai-slim")

from pydantic_ai import _utils  # noqa: E402
from pydantic_ai.messages import (  # noqa: E402
    ModelMessage,
    ModelRequest,
    ModelResponse,
    ModelResponsePart,
    ModelResponseStreamEvent,
    SystemPromptPart,
    TextContent,
    TextPart,
    ThinkingPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import (  # noqa: E402
    Model,
    ModelRequestParameters,
    StreamedResponse,
    _sendable_request_parts,
    check_allow_model_requests,
)
from pydantic_ai.models._tool_choice import resolve_tool_choice  # noqa: E402
from pydantic_ai.profiles import ModelProfile, ModelProfileSpec  # noqa: E402
from pydantic_ai.settings import ModelSettings  # noqa: E402
from pydantic_ai.usage import RequestUsage  # noqa: E402

from radix_backend.engine_like import EngineLike  # noqa: E402
from radix_backend.errors import InvalidRequestError  # noqa: E402
from radix_backend.outputs import GenerateOutput, RequestMeta  # noqa: E402
from radix_backend.paths import public_model_name  # noqa: E402
from radix_backend.sampling_params import SamplingParams  # noqa: E402
from radix_backend.tool_calls import (  # noqa: E402
    TOOL_CALL_MIN_TOKENS,
    ParsedToolReply,
    ToolSpec,
    close_objects,
    constrain_to_tools,
    parse_complete_tool_reply,
    tool_call_json,
    with_system_text,
)

__all__ = ["RadixModel", "RadixStreamedResponse"]

DEFAULT_MAX_TOKENS = 512  # when neither the model's settings nor the call set max_tokens
SYSTEM = "radix-backend"
# Settings an agent may set that this engine cannot honour; each is refused by name when set.
UNSUPPORTED_SETTINGS = ("logit_bias", "extra_body", "logprobs", "top_logprobs", "thinking")
PROFILE = ModelProfile(supports_tools=True, supports_json_schema_output=True, supports_json_object_output=True,
                       default_structured_output_mode="tool")


@dataclass
class Prepared:
    """One pydantic-ai request ready for the engine."""

    messages: list[dict[str, Any]]
    params: SamplingParams
    tool_mode: bool  # the reply is a constrained tool-call JSON to parse
    request_params: ModelRequestParameters  # as `Model.prepare_request` customized them


def chat_messages(model: Model, messages: list[ModelMessage],
                  request_params: ModelRequestParameters) -> list[dict[str, Any]]:
    """The history as the engine's {"role", "content"} dicts; the agent's instructions become
    system messages after any standing system prompt (so they stay in the cached prefix)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if isinstance(message, ModelRequest):
            out.extend(_request_messages(message))
        elif isinstance(message, ModelResponse):
            out.append(_response_message(message))
        else:
            raise InvalidRequestError(f"unsupported message type {type(message).__name__}")
    instructions = model._get_instruction_parts(messages, request_params) or []
    at = next((i for i, m in enumerate(out) if m["role"] != "system"), len(out))
    out[at:at] = [{"role": "system", "content": part.content} for part in instructions]
    return out


def _request_messages(message: ModelRequest) -> list[dict[str, Any]]:
    out = []
    for part in _sendable_request_parts(message.parts):
        if isinstance(part, SystemPromptPart):
            out.append({"role": "system", "content": part.content})
        elif isinstance(part, UserPromptPart):
            out.append({"role": "user", "content": _user_text(part.content)})
        elif isinstance(part, ToolReturnPart):
            text, files = part.model_response_str_and_user_content()
            if files:
                raise InvalidRequestError(f"tool {part.tool_name!r} returned files; this engine takes text only")
            out.append({"role": "tool", "content": text})
        else:
            raise InvalidRequestError(f"a request part of type {type(part).__name__} is not supported by this engine")
    return out


def _user_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for item in content:
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, TextContent):
            texts.append(item.content)
        else:
            raise InvalidRequestError(f"a user prompt holds {type(item).__name__}; this engine takes text only")
    return "".join(texts)


def _response_message(message: ModelResponse) -> dict[str, Any]:
    """An earlier reply, its tool calls in the JSON shape the model produces (so replays match)."""
    texts, calls = [], []
    for part in message.parts:
        if isinstance(part, TextPart):
            texts.append(part.content)
        elif isinstance(part, ToolCallPart):
            calls.append({"name": part.tool_name, "arguments": part.args_as_dict()})
        elif not isinstance(part, ThinkingPart):  # the engine's models do not think aloud
            raise InvalidRequestError(f"a response part of type {type(part).__name__} is not supported")
    if calls:
        return {"role": "assistant", "content": tool_call_json(calls)}
    return {"role": "assistant", "content": "\n\n".join(texts)}


def tool_plan(settings: ModelSettings, request_params: ModelRequestParameters) -> tuple[list[ToolSpec], bool]:
    """(tools the reply may call, whether a plain-text reply is allowed), from pydantic-ai's own
    resolution of `tool_choice` against function and output tools."""
    choice = resolve_tool_choice(settings, request_params)
    defs = request_params.declared_tool_defs
    if choice == "none":
        return [], True
    names = set(defs)
    if isinstance(choice, tuple):
        choice, names = choice
    specs = [ToolSpec(d.name, d.description or "", d.parameters_json_schema) for n, d in defs.items() if n in names]
    return specs, choice == "auto"


def sampling_params(settings: ModelSettings, default_max_tokens: int) -> SamplingParams:
    """The settings as SamplingParams; a set setting the engine would ignore is an error."""
    unsupported = [name for name in UNSUPPORTED_SETTINGS if settings.get(name) not in (None, {}, [])]
    if unsupported:
        raise InvalidRequestError(f"model settings not supported by the radix engine: {', '.join(unsupported)}")
    temperature = settings.get("temperature")
    params = SamplingParams(
        max_new_tokens=settings.get("max_tokens") or default_max_tokens,
        temperature=0.0 if temperature is None else temperature, top_p=settings.get("top_p", 1.0),
        seed=settings.get("seed"), stop=list(settings.get("stop_sequences") or []),
        presence_penalty=settings.get("presence_penalty", 0.0), frequency_penalty=settings.get("frequency_penalty", 0.0))
    params.validate()
    return params


def usage(meta: RequestMeta | None) -> RequestUsage:
    return RequestUsage(**Usage.from_meta(meta).as_input_output())


def finish_reason(reason: str | None, tool_calls: bool) -> str:
    if reason == "length":
        return "length"
    return "tool_call" if tool_calls else "stop"


def reply_parts(text: str, tool_mode: bool, reason: str | None) -> list[ModelResponsePart]:
    """The engine's reply as response parts: text, or the constrained JSON's tool calls."""
    if not tool_mode:
        return [TextPart(text)] if text else []
    parsed: ParsedToolReply = parse_complete_tool_reply(text, reason)
    parts: list[ModelResponsePart] = [TextPart(parsed.text)] if parsed.text else []
    parts += [ToolCallPart(c["name"], c["args"], tool_call_id=c["id"]) for c in parsed.calls]
    return parts


class RadixModel(Model):
    """pydantic-ai `Model` on the radix engine (the process-shared one unless `engine` is given).

    `model` picks another checkpoint for the shared engine's first creation, as `get_engine` does.
    """

    def __init__(self, engine: EngineLike | None = None, *, model: str | None = None,
                 settings: ModelSettings | None = None, profile: ModelProfileSpec | None = None,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        super().__init__(settings=settings, profile=profile or PROFILE)
        self.engine = resolve_engine(engine, model)
        self.default_max_tokens = default_max_tokens

    @property
    def model_name(self) -> str:
        return public_model_name(self.engine.model_id)

    @property
    def system(self) -> str:
        return SYSTEM

    def _prepare(self, messages: list[ModelMessage], settings: ModelSettings | None,
                 request_params: ModelRequestParameters) -> Prepared:
        check_allow_model_requests()
        settings, request_params = self.prepare_request(settings, request_params)
        settings = settings or {}
        params = sampling_params(settings, self.default_max_tokens)
        engine_messages = chat_messages(self, messages, request_params)
        specs, allow_text = tool_plan(settings, request_params)
        if specs:
            engine_messages, params = constrain_to_tools(
                engine_messages, params, specs, allow_text=allow_text,
                parallel=bool(settings.get("parallel_tool_calls", False)),
                min_tokens=TOOL_CALL_MIN_TOKENS if settings.get("max_tokens") is None else 0)
            return Prepared(engine_messages, params, True, request_params)
        if request_params.output_mode == "native" and request_params.output_object is not None:
            params = params.copy(json_schema=close_objects(request_params.output_object.json_schema))
        elif request_params.output_mode == "prompted" and request_params.prompted_output_instructions:
            engine_messages = with_system_text(engine_messages, request_params.prompted_output_instructions)
        return Prepared(engine_messages, params, False, request_params)

    async def request(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                      model_request_parameters: ModelRequestParameters) -> ModelResponse:
        prepared = self._prepare(messages, model_settings, model_request_parameters)
        out: GenerateOutput = await self.engine.agenerate(messages=prepared.messages, params=prepared.params)
        parts = reply_parts(out.text, prepared.tool_mode, out.finish_reason)
        return ModelResponse(parts=parts, usage=usage(out.meta), model_name=self.model_name,
                             provider_name=SYSTEM, provider_response_id=out.request_id or None,
                             finish_reason=finish_reason(out.finish_reason, any(isinstance(p, ToolCallPart)
                                                                                for p in parts)))

    @asynccontextmanager
    async def request_stream(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                             model_request_parameters: ModelRequestParameters,
                             run_context: Any = None) -> AsyncGenerator[StreamedResponse]:
        prepared = self._prepare(messages, model_settings, model_request_parameters)
        chunks = self.engine.astream(messages=prepared.messages, params=prepared.params)
        response = RadixStreamedResponse(model_request_parameters=prepared.request_params,
                                         _model_name=self.model_name, _chunks=chunks, _tool_mode=prepared.tool_mode)
        try:
            yield response
        finally:
            await response.close_stream()

    async def count_tokens(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                           model_request_parameters: ModelRequestParameters) -> RequestUsage:
        """Prompt tokens of the request as the engine would see it (the chat template applied)."""
        prepared = self._prepare(messages, model_settings, model_request_parameters)
        prompt = self.engine.apply_chat_template(prepared.messages)
        return RequestUsage(input_tokens=len(self.engine.encode(prompt)))


@dataclass
class RadixStreamedResponse(StreamedResponse):
    """Text streams token by token; a tool-mode reply is only meaningful whole, so its calls are
    emitted once the constrained JSON is complete."""

    _model_name: str = ""
    _chunks: Any = None
    _tool_mode: bool = False
    _timestamp: datetime = field(default_factory=_utils.now_utc)

    async def _get_event_iterator(self) -> AsyncIterator[ModelResponseStreamEvent]:
        text, last = [], None
        async for chunk in self._chunks:
            last = chunk
            if not chunk.text:
                continue
            if self._tool_mode:
                text.append(chunk.text)
            else:
                for event in self._parts_manager.handle_text_delta(vendor_part_id="content", content=chunk.text):
                    yield event
        reason = last.finish_reason if last is not None else None
        self._usage = usage(last.meta if last is not None else None)
        calls = False
        if self._tool_mode:
            for i, part in enumerate(reply_parts("".join(text), True, reason)):
                if isinstance(part, ToolCallPart):
                    calls = True
                    yield self._parts_manager.handle_tool_call_part(
                        vendor_part_id=i, tool_name=part.tool_name, args=part.args, tool_call_id=part.tool_call_id)
                else:
                    for event in self._parts_manager.handle_text_delta(vendor_part_id="content", content=part.content):
                        yield event
        self.finish_reason = finish_reason(reason, calls)

    async def close_stream(self) -> None:
        aclose = getattr(self._chunks, "aclose", None)
        if aclose is not None:
            await aclose()

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def provider_name(self) -> str:
        return SYSTEM

    @property
    def provider_url(self) -> None:
        return None

    @property
    def timestamp(self) -> datetime:
        return self._timestamp
