"""LlamaIndex adapter: `RadixLlamaIndexLLM`, a chat LLM on the radix engine.

Query engines send the same system prompt, template and retrieved context again and again; the
engine serves those shared prefixes from its radix cache. Usage (with cached tokens) is in
`raw["usage"]` and `additional_kwargs`. `structured_predict` (and so `as_structured_llm`) decodes
under the output class's JSON schema, so the result always validates.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any, Type

import json
from dataclasses import dataclass

from ._common import (ToolSpec, Usage, constrain_to_tools, message_text, parse_tool_reply, require, resolve_engine,
                      sampling_params, to_json_schema)

require("llama_index.core", "llamaindex", "llama-index-core")

from llama_index.core.base.llms.types import (  # noqa: E402
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr  # noqa: E402
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback  # noqa: E402
from llama_index.core.llms.function_calling import FunctionCallingLLM  # noqa: E402
from llama_index.core.llms.llm import ToolSelection  # noqa: E402
from llama_index.core.prompts import BasePromptTemplate  # noqa: E402
from llama_index.core.types import Model  # noqa: E402

from radix_backend.engine_like import EngineLike  # noqa: E402
from radix_backend.errors import InvalidRequestError  # noqa: E402
from radix_backend.outputs import GenerateOutput, RequestMeta  # noqa: E402
from radix_backend.sampling_params import SamplingParams  # noqa: E402

__all__ = ["RadixLlamaIndexLLM"]

_ROLE = {MessageRole.SYSTEM: "system", MessageRole.DEVELOPER: "system", MessageRole.USER: "user",
         MessageRole.ASSISTANT: "assistant", MessageRole.MODEL: "assistant", MessageRole.CHATBOT: "assistant",
         MessageRole.TOOL: "tool", MessageRole.FUNCTION: "tool"}


def to_engine_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """LlamaIndex chat messages as the engine's {"role", "content"} dicts; an assistant turn that called
    tools is replayed as the JSON the model produced for it."""
    out = []
    for m in messages:
        text = "".join(getattr(b, "text", "") for b in m.blocks) if m.blocks else message_text(m.content)
        calls = m.additional_kwargs.get("tool_calls") if m.role == MessageRole.ASSISTANT else None
        if calls:
            replay = [{"name": c["name"], "arguments": c["args"]} for c in calls]
            text = json.dumps(replay[0] if len(replay) == 1 else replay)
        out.append({"role": _ROLE.get(m.role, str(m.role.value)), "content": text})
    return out


@dataclass
class _ChatRequest:
    """One chat call ready for the engine; `tool_mode`: the reply is a constrained tool-call JSON."""

    messages: list[dict[str, Any]]
    params: SamplingParams
    tool_mode: bool


def _usage_fields(meta: RequestMeta | None, finish_reason: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    usage = Usage.from_meta(meta)
    raw = {"usage": usage.as_openai(), "finish_reason": finish_reason}
    extra = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
             "total_tokens": usage.total_tokens, "cached_tokens": usage.cached_tokens, "finish_reason": finish_reason}
    return raw, extra


class RadixLlamaIndexLLM(FunctionCallingLLM):
    """LlamaIndex LLM backed by a radix_backend Engine (`engine=`) or the process-shared engine of `model`.

    A function-calling LLM: `chat_with_tools` (and so FunctionAgent, AgentWorkflow, ReActAgent) decodes
    the reply under a JSON schema of the tools' calls, so a call always names a tool and its arguments
    always fit the tool's schema."""

    model: str | None = Field(default=None, description="Checkpoint path; None = embedded SmolLM2.")
    max_new_tokens: int = Field(default=256, description="Tokens generated per call (metadata.num_output).")
    temperature: float = Field(default=0.0, description="0 = greedy.")
    context_window: int | None = Field(default=None, description="Defaults to the engine's context length.")
    sampling_kwargs: dict[str, Any] = Field(default_factory=dict, description="Other SamplingParams fields.")
    _engine: EngineLike = PrivateAttr(default=None)

    def __init__(self, engine: EngineLike | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._engine = resolve_engine(engine, self.model)

    @classmethod
    def class_name(cls) -> str:
        return "RadixLlamaIndexLLM"

    @property
    def engine(self) -> EngineLike:
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        window = self.context_window or self._engine.context_length
        return LLMMetadata(context_window=window, num_output=self.max_new_tokens, is_chat_model=True,
                           is_function_calling_model=True, model_name=self.model or "radix-backend")

    def _params(self, kwargs: dict[str, Any]) -> SamplingParams:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("formatted",)}
        defaults = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, **self.sampling_kwargs}
        return sampling_params(defaults, kwargs)

    def _prompt(self, prompt: str, formatted: bool) -> str:
        return prompt if formatted else self.completion_to_prompt(prompt)

    @staticmethod
    def _completion(out: GenerateOutput) -> CompletionResponse:
        raw, extra = _usage_fields(out.meta, out.finish_reason)
        return CompletionResponse(text=out.text, raw=raw, additional_kwargs=extra)

    def _chat_request(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> _ChatRequest:
        kwargs = dict(kwargs)
        tools = kwargs.pop("tools", None)
        required = bool(kwargs.pop("tool_required", False))
        parallel = bool(kwargs.pop("allow_parallel_tool_calls", False))
        engine_messages = to_engine_messages(messages)
        if not tools:
            return _ChatRequest(engine_messages, self._params(kwargs), False)
        specs = [ToolSpec(t.metadata.name, t.metadata.description, t.metadata.get_parameters_dict()) for t in tools]
        engine_messages, params = constrain_to_tools(engine_messages, self._params(kwargs), specs,
                                                     allow_text=not required, parallel=parallel)
        return _ChatRequest(engine_messages, params, True)

    @staticmethod
    def _chat(out: GenerateOutput, tool_mode: bool = False) -> ChatResponse:
        raw, extra = _usage_fields(out.meta, out.finish_reason)
        content = out.text
        if tool_mode:
            try:
                if out.finish_reason == "length":
                    raise InvalidRequestError("the tool call was cut off at max tokens; raise max_new_tokens")
                parsed = parse_tool_reply(out.text)
                content, extra["tool_calls"] = parsed.text, parsed.calls
            except InvalidRequestError as exc:
                content, extra["tool_calls"], extra["tool_call_error"] = "", [], str(exc)
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=content,
                                                additional_kwargs={"tool_calls": extra.get("tool_calls", [])}
                                                if tool_mode else {}),
                            raw=raw, additional_kwargs=extra)

    # -- function calling (LlamaIndex's FunctionCallingLLM) ---------------------------------
    def _prepare_chat_with_tools(self, tools: Sequence[Any], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                 **kwargs: Any) -> dict[str, Any]:
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(user_msg if isinstance(user_msg, ChatMessage) else ChatMessage(role=MessageRole.USER,
                                                                                           content=user_msg))
        return {"messages": messages, "tools": list(tools), "tool_required": tool_required,
                "allow_parallel_tool_calls": allow_parallel_tool_calls, **kwargs}

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        calls = response.message.additional_kwargs.get("tool_calls") or []
        if not calls and error_on_no_tool_call:
            reason = response.additional_kwargs.get("tool_call_error")
            raise ValueError(f"expected at least one tool call, got none{f' ({reason})' if reason else ''}")
        return [ToolSelection(tool_id=c["id"], tool_name=c["name"], tool_kwargs=c["args"]) for c in calls]

    # -- completion ---------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._completion(self._engine.generate(self._prompt(prompt, formatted), self._params(kwargs)))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        out = await self._engine.agenerate(self._prompt(prompt, formatted), self._params(kwargs))
        return self._completion(out)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        chunks = self._engine.stream(self._prompt(prompt, formatted), self._params(kwargs))

        def gen() -> Generator[CompletionResponse, None, None]:
            text = ""
            for c in chunks:
                text += c.text
                raw, extra = _usage_fields(c.meta, c.finish_reason) if c.finish_reason else (None, {})
                yield CompletionResponse(text=text, delta=c.text, raw=raw, additional_kwargs=extra)

        return gen()

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        chunks = self._engine.astream(self._prompt(prompt, formatted), self._params(kwargs))

        async def gen() -> AsyncGenerator[CompletionResponse, None]:
            text = ""
            async for c in chunks:
                text += c.text
                raw, extra = _usage_fields(c.meta, c.finish_reason) if c.finish_reason else (None, {})
                yield CompletionResponse(text=text, delta=c.text, raw=raw, additional_kwargs=extra)

        return gen()

    # -- chat (engine applies the model's chat template) ----------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        req = self._chat_request(messages, kwargs)
        return self._chat(self._engine.generate(messages=req.messages, params=req.params), req.tool_mode)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        req = self._chat_request(messages, kwargs)
        return self._chat(await self._engine.agenerate(messages=req.messages, params=req.params), req.tool_mode)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        req = self._chat_request(messages, kwargs)
        if req.tool_mode:  # a tool call is only meaningful once complete: one response
            response = self._chat(self._engine.generate(messages=req.messages, params=req.params), True)
            return iter([response])
        chunks = self._engine.stream(messages=req.messages, params=req.params)

        def gen() -> Generator[ChatResponse, None, None]:
            text = ""
            for c in chunks:
                text += c.text
                raw, extra = _usage_fields(c.meta, c.finish_reason) if c.finish_reason else (None, {})
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=c.text,
                                   raw=raw, additional_kwargs=extra)

        return gen()

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        req = self._chat_request(messages, kwargs)
        if req.tool_mode:
            response = self._chat(await self._engine.agenerate(messages=req.messages, params=req.params), True)

            async def one() -> AsyncGenerator[ChatResponse, None]:
                yield response

            return one()
        chunks = self._engine.astream(messages=req.messages, params=req.params)

        async def gen() -> AsyncGenerator[ChatResponse, None]:
            text = ""
            async for c in chunks:
                text += c.text
                raw, extra = _usage_fields(c.meta, c.finish_reason) if c.finish_reason else (None, {})
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=c.text,
                                   raw=raw, additional_kwargs=extra)

        return gen()

    # -- structured output: JSON-schema constrained decoding ------------------------------
    def _structured_messages(self, prompt: BasePromptTemplate, prompt_args: dict[str, Any]) -> list[ChatMessage]:
        return self._get_messages(prompt, **prompt_args)

    def structured_predict(self, output_cls: Type[Model], prompt: BasePromptTemplate,
                           llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Model:
        """Chat under `output_cls`'s JSON schema; the reply always parses into `output_cls`."""
        messages = self._structured_messages(prompt, prompt_args)
        response = self.chat(messages, json_schema=to_json_schema(output_cls)[0], **(llm_kwargs or {}))
        return output_cls.model_validate_json(response.message.content or "")

    async def astructured_predict(self, output_cls: Type[Model], prompt: BasePromptTemplate,
                                  llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Model:
        messages = self._structured_messages(prompt, prompt_args)
        response = await self.achat(messages, json_schema=to_json_schema(output_cls)[0], **(llm_kwargs or {}))
        return output_cls.model_validate_json(response.message.content or "")

    def stream_structured_predict(self, output_cls: Type[Model], prompt: BasePromptTemplate,
                                  llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Generator[Any, None, None]:
        """Yields partial objects (LlamaIndex's flexible model) as the constrained JSON streams in."""
        from llama_index.core.program.utils import process_streaming_objects

        messages = self._structured_messages(prompt, prompt_args)
        stream = self.stream_chat(messages, json_schema=to_json_schema(output_cls)[0], **(llm_kwargs or {}))
        current = None
        for response in stream:
            current = process_streaming_objects(response, output_cls, flexible_mode=True,
                                                cur_objects=None if current is None else [current])
            yield current

    async def astream_structured_predict(self, output_cls: Type[Model], prompt: BasePromptTemplate,
                                         llm_kwargs: dict[str, Any] | None = None,
                                         **prompt_args: Any) -> AsyncGenerator[Any, None]:
        from llama_index.core.program.utils import process_streaming_objects

        messages = self._structured_messages(prompt, prompt_args)
        stream = await self.astream_chat(messages, json_schema=to_json_schema(output_cls)[0], **(llm_kwargs or {}))

        async def gen() -> AsyncGenerator[Any, None]:
            current = None
            async for response in stream:
                current = process_streaming_objects(response, output_cls, flexible_mode=True,
                                                cur_objects=None if current is None else [current])
                yield current

        return gen()
