"""LangChain adapter: `RadixChatModel` (BaseChatModel) and `RadixLLM` (BaseLLM) on the radix engine.

`batch`/`abatch` hand all inputs to the engine in ONE `generate` call, so prompts sharing a
system prompt or few-shot prefix are prefilled once and served from the radix cache.
Structured output and tool calls are decoded under a JSON-schema constraint, so they always parse.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from operator import itemgetter
from typing import Any, Callable

from ._common import (
    ParsedToolReply,
    TOOL_CALL_MIN_TOKENS,
    ToolSpec,
    close_objects,
    Usage,
    message_text,
    parse_structured,
    parse_tool_reply,
    require,
    resolve_engine,
    sampling_params,
    schema_instructions,
    to_json_schema,
    with_system_text,
)

from radix_backend.tool_calls import choose_tools, constrain_to_tools, tool_call_json  # noqa: E402

require("langchain_core", "langchain", "langchain-core")

from langchain_core.callbacks import (  # noqa: E402
    AsyncCallbackManager,
    AsyncCallbackManagerForLLMRun,
    CallbackManager,
    CallbackManagerForLLMRun,
)
from langchain_core.globals import get_llm_cache  # noqa: E402
from langchain_core.language_models import BaseChatModel, BaseLLM, LanguageModelInput  # noqa: E402
from langchain_core.messages import (  # noqa: E402
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata  # noqa: E402
from langchain_core.outputs import (  # noqa: E402
    ChatGeneration,
    ChatGenerationChunk,
    ChatResult,
    Generation,
    GenerationChunk,
    LLMResult,
)
from langchain_core.runnables import (  # noqa: E402
    Runnable,
    RunnableConfig,
    RunnableLambda,
    RunnableMap,
    RunnablePassthrough,
)
from langchain_core.runnables.config import get_config_list  # noqa: E402
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field, model_validator  # noqa: E402

from radix_backend.engine_like import EngineLike  # noqa: E402
from radix_backend.errors import InvalidRequestError  # noqa: E402
from radix_backend.outputs import GenerateOutput  # noqa: E402
from radix_backend.sampling_params import SamplingParams  # noqa: E402

__all__ = ["RadixChatModel", "RadixLLM"]

_IGNORED_KWARGS = ("stream", "ls_structured_output_format", "structured_output_format")


class _EngineFields(BaseModel):
    """Construction and sampling defaults shared by the chat and the text-completion model."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: EngineLike | None = Field(default=None, exclude=True)
    """An existing `radix_backend.Engine` (or Router); when None, the process-shared engine of `model` is used."""
    model: str | None = None
    """Checkpoint path for `radix_backend.get_engine(model)`; None means the embedded SmolLM2."""
    max_tokens: int = 256
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    streaming: bool = False
    """When True, `invoke` streams internally so callbacks see every token."""
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Any other SamplingParams field (e.g. regex, json_schema, ignore_eos)."""

    @model_validator(mode="after")
    def _attach_engine(self) -> Any:
        self.engine = resolve_engine(self.engine, self.model)
        return self

    def _sampling_defaults(self) -> dict[str, Any]:
        return {"max_new_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "min_p": self.min_p, "frequency_penalty": self.frequency_penalty,
                "presence_penalty": self.presence_penalty, "repetition_penalty": self.repetition_penalty,
                "seed": self.seed, "stop": self.stop, **self.model_kwargs}

    def _params(self, stop: list[str] | None, kwargs: dict[str, Any]) -> SamplingParams:
        overrides = {k: v for k, v in kwargs.items() if k not in _IGNORED_KWARGS}
        self._check_model(overrides.pop("model", None))
        return sampling_params(self._sampling_defaults(), overrides, stop=stop)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model_id, **{k: v for k, v in self._sampling_defaults().items()
                                                            if v is not None}}

    @property
    def model_id(self) -> str:
        """The served model's name (the embedded one's HF id when `model` is None), for tracing."""
        return self.model or self.engine.model_id

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        """LangSmith's standard tracing params: provider, model name, temperature, max tokens, stop."""
        params = super()._get_ls_params(stop=stop, **kwargs)  # type: ignore[misc]
        params["ls_provider"] = "radix-backend"
        params["ls_model_name"] = kwargs.get("model") or self.model_id
        params["ls_max_tokens"] = kwargs.get("max_tokens", self.max_tokens)
        temperature = kwargs.get("temperature", self.temperature)
        if temperature is not None:
            params["ls_temperature"] = temperature
        stop = stop or self.stop
        if stop:
            params["ls_stop"] = stop
        return params

    def _check_model(self, requested: str | None) -> None:
        """A per-call `model=` must name the loaded model: one engine serves one model."""
        names = {self.model, self.model_id, self.engine.model_id} - {None}
        if requested is not None and requested not in names:
            raise InvalidRequestError(f"model {requested!r} is not loaded here; this engine serves {self.model_id!r} "
                                      "(create another RadixChatModel with model=... for a different checkpoint)")

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids by the served model's own tokenizer (LangChain's default downloads GPT-2's)."""
        return list(self.engine.encode(text))


def usage_metadata(usage: Usage) -> UsageMetadata:
    """LangChain usage record; `input_token_details.cache_read` = prompt tokens served from the radix cache."""
    return UsageMetadata(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                         total_tokens=usage.total_tokens, input_token_details={"cache_read": usage.cached_tokens})


def _sum_usage(outputs: Sequence[GenerateOutput]) -> dict[str, Any]:
    total = Usage(0, 0, 0)
    for out in outputs:
        u = Usage.from_meta(out.meta)
        total = Usage(total.prompt_tokens + u.prompt_tokens, total.completion_tokens + u.completion_tokens,
                      total.cached_tokens + u.cached_tokens)
    return total.as_openai()


def to_engine_message(message: BaseMessage) -> dict[str, Any]:
    """A LangChain message as the engine's {"role", "content"} dict."""
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": message_text(message.content)}
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": message_text(message.content)}
    if isinstance(message, AIMessage):
        if message.tool_calls:  # replay earlier calls in the same JSON shape the model produces
            calls = [{"name": c["name"], "arguments": c["args"]} for c in message.tool_calls]
            return {"role": "assistant", "content": tool_call_json(calls)}
        return {"role": "assistant", "content": message_text(message.content)}
    if isinstance(message, ToolMessage):
        return {"role": "tool", "content": message_text(message.content)}
    if isinstance(message, ChatMessage):
        return {"role": message.role, "content": message_text(message.content)}
    raise InvalidRequestError(f"unsupported message type {type(message).__name__}")


@dataclass
class _Prepared:
    """One chat request ready for the engine."""

    messages: list[dict[str, Any]]
    params: SamplingParams
    tool_mode: bool  # reply is a constrained tool-call JSON to parse


def _tool_specs(tools: list[dict[str, Any]], tool_choice: Any) -> tuple[list[ToolSpec], bool]:
    """(tools allowed in the reply, whether a plain-text reply is allowed) for a tool_choice."""
    specs = []
    for tool in tools:
        fn = convert_to_openai_tool(tool)["function"]
        specs.append(ToolSpec(fn["name"], fn.get("description", ""), fn.get("parameters") or {}))
    return choose_tools(specs, tool_choice)


def _ai_message(out: GenerateOutput, tool_mode: bool, model_name: str, chunk: bool = False) -> AIMessage:
    usage = usage_metadata(Usage.from_meta(out.meta))
    meta = {"finish_reason": out.finish_reason, "model_name": model_name}
    cls = AIMessageChunk if chunk else AIMessage
    if not tool_mode:
        return cls(content=out.text, usage_metadata=usage, response_metadata=meta)
    try:
        if out.finish_reason == "length":
            raise InvalidRequestError(
                f"the tool call was cut off after {out.meta.completion_tokens} tokens (max_tokens); raise max_tokens")
        parsed: ParsedToolReply = parse_tool_reply(out.text)
    except InvalidRequestError as exc:
        warnings.warn(f"RadixChatModel: invalid tool call: {exc}", stacklevel=3)
        return cls(content="", usage_metadata=usage, response_metadata=meta, invalid_tool_calls=[
            {"name": None, "args": out.text, "id": None, "error": str(exc), "type": "invalid_tool_call"}])
    if chunk:
        return AIMessageChunk(content=parsed.text, usage_metadata=usage, response_metadata=meta, tool_call_chunks=[
            {"name": c["name"], "args": json.dumps(c["args"]), "id": c["id"], "index": i, "type": "tool_call_chunk"}
            for i, c in enumerate(parsed.calls)])
    return AIMessage(content=parsed.text, usage_metadata=usage, response_metadata=meta,
                     tool_calls=[{**c, "type": "tool_call"} for c in parsed.calls])


def _good_inputs(prepared: list[Any], return_exceptions: bool) -> tuple[list[int], list[Any]]:
    """Indices of the inputs that prepared cleanly, and a result list holding the others' exceptions
    (without return_exceptions the first one is raised)."""
    bad = [p for p in prepared if isinstance(p, Exception)]
    if bad and not return_exceptions:
        raise bad[0]
    return [i for i, p in enumerate(prepared) if not isinstance(p, Exception)], list(prepared)


def _structured_schema(schema: Any) -> tuple[dict[str, Any], str]:
    """(closed JSON schema, name) of any schema LangChain accepts. Classes go through LangChain's own
    converter, which also reads TypedDict `Annotated[..., "description"]` and pydantic v1 models."""
    if isinstance(schema, type):
        converted = convert_to_json_schema(schema)
        return close_objects(converted), str(converted.get("title") or schema.__name__)
    return to_json_schema(schema)


def _attempt(fn: Callable[[], Any]) -> Any:
    """fn() or the exception it raised (per-input results for batch(return_exceptions=True))."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - handed back to the caller as that input's result
        return exc


def _parse_structured(schema: Any, message: AIMessage) -> Any:
    return parse_structured(schema, message_text(message.content))


class RadixChatModel(_EngineFields, BaseChatModel):
    """LangChain chat model running on the radix engine (chat template applied by the engine)."""

    @property
    def _llm_type(self) -> str:
        return "radix-backend-chat"

    # -- request preparation -------------------------------------------------------------
    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> _Prepared:
        kwargs = dict(kwargs)
        instructions = kwargs.pop("structured_instructions", None)
        tools = kwargs.pop("tools", None)
        tool_choice = kwargs.pop("tool_choice", None)
        parallel = bool(kwargs.pop("parallel_tool_calls", False))
        engine_messages = [to_engine_message(m) for m in messages]
        if instructions:
            engine_messages = with_system_text(engine_messages, instructions)
        tool_mode = bool(tools) and tool_choice != "none"
        params = self._params(stop, kwargs)
        if tool_mode:
            specs, allow_text = _tool_specs(tools, tool_choice)
            engine_messages, params = constrain_to_tools(  # a whole call, not one cut at 100, unless max_tokens is set
                engine_messages, params, specs, allow_text=allow_text, parallel=parallel,
                min_tokens=0 if "max_tokens" in kwargs else TOOL_CALL_MIN_TOKENS)
        return _Prepared(engine_messages, params, tool_mode)

    def _result(self, out: GenerateOutput, tool_mode: bool) -> ChatResult:
        message = _ai_message(out, tool_mode, self.model_id)
        return ChatResult(generations=[ChatGeneration(message=message,
                                                      generation_info={"finish_reason": out.finish_reason})],
                          llm_output={"token_usage": _sum_usage([out]), "model_name": self.model_id})

    # -- single requests -------------------------------------------------------------------
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        req = self._prepare(messages, stop, kwargs)
        out = self.engine.generate(messages=req.messages, params=req.params)
        return self._result(out, req.tool_mode)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        req = self._prepare(messages, stop, kwargs)
        out = await self.engine.agenerate(messages=req.messages, params=req.params)
        return self._result(out, req.tool_mode)

    def _stream_chunk(self, chunk: Any, tool_mode: bool) -> ChatGenerationChunk:
        if chunk.finish_reason is None:
            return ChatGenerationChunk(message=AIMessageChunk(content=chunk.text))
        message = AIMessageChunk(content=chunk.text, chunk_position="last",
                                 usage_metadata=usage_metadata(Usage.from_meta(chunk.meta)),
                                 response_metadata={"finish_reason": chunk.finish_reason,
                                                    "model_name": self.model_id})
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": chunk.finish_reason})

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        # The base class reports each yielded chunk to on_llm_new_token.
        req = self._prepare(messages, stop, kwargs)
        if req.tool_mode:  # a tool call is only meaningful once complete
            out = self.engine.generate(messages=req.messages, params=req.params)
            yield ChatGenerationChunk(message=_ai_message(out, True, self.model_id, chunk=True),
                                      generation_info={"finish_reason": out.finish_reason})
            return
        for chunk in self.engine.stream(messages=req.messages, params=req.params):
            yield self._stream_chunk(chunk, False)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        req = self._prepare(messages, stop, kwargs)
        if req.tool_mode:
            out = await self.engine.agenerate(messages=req.messages, params=req.params)
            yield ChatGenerationChunk(message=_ai_message(out, True, self.model_id, chunk=True),
                                      generation_info={"finish_reason": out.finish_reason})
            return
        async for chunk in self.engine.astream(messages=req.messages, params=req.params):
            yield self._stream_chunk(chunk, False)

    # -- batches: one engine call ---------------------------------------------------------
    def _batchable(self, configs: list[RunnableConfig], kwargs: dict[str, Any], async_api: bool) -> bool:
        """One-call batching skips LangChain's per-call cache and streaming paths; use it only when
        neither is active, else fall back to the base (threaded invoke, still batched by the scheduler)."""
        if self.rate_limiter is not None:
            return False
        if self.cache is not False and (self.cache is not None or get_llm_cache() is not None):
            return False
        protocol_streaming = getattr(self, "_should_use_protocol_streaming", None)  # langchain-core >= 1.8
        for cfg in configs:
            manager = CallbackManager.configure(cfg.get("callbacks"), self.callbacks, self.verbose)
            if self._should_stream(async_api=async_api, run_manager=manager, **kwargs):
                return False
            if protocol_streaming is not None and protocol_streaming(async_api=async_api, run_manager=manager, **kwargs):
                return False
        return True

    def _start_kwargs(self, stop: list[str] | None, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        params = self._get_invocation_params(stop=stop, **kwargs)
        ls_params = self._get_ls_params(stop=stop, **kwargs)
        return params, ls_params

    def _finish(self, outs: Sequence[GenerateOutput], prepared: Sequence[_Prepared], run_ids: Sequence[Any]
                ) -> tuple[list[AIMessage], list[LLMResult]]:
        messages, results = [], []
        for out, req, run_id in zip(outs, prepared, run_ids):
            result = self._result(out, req.tool_mode)
            gen = result.generations[0]
            gen.message.id = f"lc_run--{run_id}"
            gen.message.response_metadata = {**(result.llm_output or {}), **gen.message.response_metadata}
            messages.append(gen.message)
            results.append(LLMResult(generations=[[gen]], llm_output=result.llm_output))
        return messages, results

    def _batch_inputs(self, inputs: list[LanguageModelInput], kwargs: dict[str, Any]) -> tuple[Any, list, Any, Any]:
        """What batch and abatch share: stop, message lists, invocation and tracing params."""
        stop = kwargs.pop("stop", None)
        for key in _IGNORED_KWARGS:
            kwargs.pop(key, None)
        message_lists = [self._convert_input(x).to_messages() for x in inputs]
        params, ls_params = self._start_kwargs(stop, kwargs)
        return stop, message_lists, params, ls_params

    def batch(self, inputs: list[LanguageModelInput], config: RunnableConfig | list[RunnableConfig] | None = None,
              *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        """All inputs go to the engine as one `generate` call (one scheduler batch sharing prefix KV)."""
        if not inputs:
            return []
        configs = get_config_list(config, len(inputs))
        if not self._batchable(configs, kwargs, async_api=False):
            return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        stop, message_lists, params, ls_params = self._batch_inputs(inputs, kwargs)
        run_managers = []
        for msgs, cfg in zip(message_lists, configs):
            manager = CallbackManager.configure(cfg.get("callbacks"), self.callbacks, self.verbose, cfg.get("tags"),
                                                self.tags, {**(cfg.get("metadata") or {}), **ls_params}, self.metadata)
            (rm,) = manager.on_chat_model_start(self._serialized, [msgs], invocation_params=params,
                                                options={"stop": stop}, name=cfg.get("run_name"),
                                                run_id=cfg.get("run_id"), batch_size=len(inputs))
            run_managers.append(rm)
        prepared = [_attempt(lambda m=m: self._prepare(m, stop, kwargs)) for m in message_lists]
        outs = self._generate_each(prepared, return_exceptions)
        return self._close_runs(outs, prepared, run_managers, return_exceptions)

    def _generate_each(self, prepared: list[Any], return_exceptions: bool) -> list[Any]:
        """One engine call for every prepared request. With return_exceptions a bad input fails
        alone: it is left out, and if the engine still refuses the batch each request runs by itself."""
        good, outs = _good_inputs(prepared, return_exceptions)
        try:
            batch = self.engine.generate(messages=[prepared[i].messages for i in good],
                                         params=[prepared[i].params for i in good]) if good else []
        except Exception:
            if not return_exceptions:
                raise
            batch = [_attempt(lambda p=prepared[i]: self.engine.generate(messages=p.messages, params=p.params))
                     for i in good]
        for i, out in zip(good, batch):
            outs[i] = out
        return outs

    async def _agenerate_each(self, prepared: list[Any], return_exceptions: bool) -> list[Any]:
        """Async form of `_generate_each`."""
        good, outs = _good_inputs(prepared, return_exceptions)
        try:
            batch = await self.engine.agenerate(messages=[prepared[i].messages for i in good],
                                                params=[prepared[i].params for i in good]) if good else []
        except Exception:
            if not return_exceptions:
                raise
            batch = []
            for i in good:
                try:
                    batch.append(await self.engine.agenerate(messages=prepared[i].messages, params=prepared[i].params))
                except Exception as exc:  # noqa: BLE001 - that input's result
                    batch.append(exc)
        for i, out in zip(good, batch):
            outs[i] = out
        return outs

    def _close_runs(self, outs: list[Any], prepared: list[Any], run_managers: list[Any],
                    return_exceptions: bool) -> list[Any]:
        """Report each run's end or error to its callbacks; the messages (or exceptions) in input order."""
        results: list[Any] = []
        for out, req, rm in zip(outs, prepared, run_managers):
            if isinstance(out, Exception):
                rm.on_llm_error(out)
                if not return_exceptions:
                    raise out
                results.append(out)
                continue
            (message,), (res,) = self._finish([out], [req], [rm.run_id])
            rm.on_llm_end(res)
            results.append(message)
        return results

    async def abatch(self, inputs: list[LanguageModelInput], config: RunnableConfig | list[RunnableConfig] | None = None,
                     *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        """Async form of `batch`: one `agenerate` call."""
        if not inputs:
            return []
        configs = get_config_list(config, len(inputs))
        if not self._batchable(configs, kwargs, async_api=True):
            return await super().abatch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        stop, message_lists, params, ls_params = self._batch_inputs(inputs, kwargs)
        run_managers = []
        for msgs, cfg in zip(message_lists, configs):
            manager = AsyncCallbackManager.configure(cfg.get("callbacks"), self.callbacks, self.verbose,
                                                     cfg.get("tags"), self.tags,
                                                     {**(cfg.get("metadata") or {}), **ls_params}, self.metadata)
            (rm,) = await manager.on_chat_model_start(self._serialized, [msgs], invocation_params=params,
                                                      options={"stop": stop}, name=cfg.get("run_name"),
                                                      run_id=cfg.get("run_id"), batch_size=len(inputs))
            run_managers.append(rm)
        prepared = [_attempt(lambda m=m: self._prepare(m, stop, kwargs)) for m in message_lists]
        outs = await self._agenerate_each(prepared, return_exceptions)
        results: list[Any] = []
        for out, req, rm in zip(outs, prepared, run_managers):
            if isinstance(out, Exception):
                await rm.on_llm_error(out)
                if not return_exceptions:
                    raise out
                results.append(out)
                continue
            (message,), (res,) = self._finish([out], [req], [rm.run_id])
            await rm.on_llm_end(res)
            results.append(message)
        return results

    # -- tools and structured output ----------------------------------------------------
    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable[..., Any] | Any], *,
                   tool_choice: str | dict | bool | None = None, parallel_tool_calls: bool = False,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools; replies are decoded under a JSON schema of the tools' calls and parsed into
        `AIMessage.tool_calls`. tool_choice: "auto" (default: a call or a plain answer), "any"/"required",
        a tool name, or "none"."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        return self.bind(tools=formatted, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, **kwargs)

    def with_structured_output(self, schema: dict[str, Any] | type, *, include_raw: bool = False,
                               method: str = "json_schema", **kwargs: Any) -> Runnable[LanguageModelInput, Any]:
        """Outputs decoded under `SamplingParams(json_schema=...)`; pydantic schemas return instances,
        JSON schema / TypedDict schemas return dicts. method="function_calling" goes through bind_tools."""
        kwargs.pop("strict", None)
        if kwargs:
            raise InvalidRequestError(f"with_structured_output got unsupported arguments {sorted(kwargs)}")
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw)
        if method not in ("json_schema", "json_mode"):
            raise InvalidRequestError(f"method must be 'json_schema' or 'function_calling', got {method!r}")
        json_schema, name = _structured_schema(schema)
        llm = self.bind(json_schema=json_schema, structured_instructions=schema_instructions(json_schema, name),
                        ls_structured_output_format={"kwargs": {"method": method}, "schema": schema})
        parser = RunnableLambda(partial(_parse_structured, schema))
        if not include_raw:
            return llm | parser
        parse_ok = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        parse_failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parse_ok.with_fallbacks([parse_failed], exception_key="parsing_error")


class RadixLLM(_EngineFields, BaseLLM):
    """LangChain text-completion model on the radix engine (prompt used verbatim, no chat template).

    BaseLLM already turns `batch` into one `_generate(prompts)` call, which becomes one engine call.
    """

    @property
    def _llm_type(self) -> str:
        return "radix-backend"

    def _llm_result(self, outs: Sequence[GenerateOutput]) -> LLMResult:
        generations = [[Generation(text=o.text, generation_info={
            "finish_reason": o.finish_reason, "usage": Usage.from_meta(o.meta).as_openai()})] for o in outs]
        return LLMResult(generations=generations,
                         llm_output={"token_usage": _sum_usage(outs), "model_name": self.model_id})

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        params = self._params(stop, kwargs)
        if self.streaming:  # token callbacks need the streaming path, one prompt at a time
            outs = [self._collect(self._stream(p, stop, run_manager, **kwargs)) for p in prompts]
            return self._llm_result(outs)
        outs = self.engine.generate(list(prompts), [params] * len(prompts))
        return self._llm_result(outs)

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        params = self._params(stop, kwargs)
        outs = await self.engine.agenerate(list(prompts), [params] * len(prompts))
        return self._llm_result(outs)

    @staticmethod
    def _collect(chunks: Iterator[GenerationChunk]) -> GenerateOutput:
        from radix_backend.outputs import RequestMeta

        text, info = "", {}
        for c in chunks:
            text += c.text
            info = c.generation_info or info
        u = info.get("usage") or {}
        meta = RequestMeta(prompt_tokens=u.get("prompt_tokens", 0), cached_tokens=u.get("cached_tokens", 0),
                           completion_tokens=u.get("completion_tokens", 0))
        return GenerateOutput(text=text, token_ids=[], finish_reason=info.get("finish_reason", "stop"), meta=meta)

    @staticmethod
    def _chunk(chunk: Any) -> GenerationChunk:
        info = None
        if chunk.finish_reason is not None:
            info = {"finish_reason": chunk.finish_reason, "usage": Usage.from_meta(chunk.meta).as_openai()}
        return GenerationChunk(text=chunk.text, generation_info=info)

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[GenerationChunk]:
        for chunk in self.engine.stream(prompt, self._params(stop, kwargs)):
            gen = self._chunk(chunk)
            if run_manager is not None:
                run_manager.on_llm_new_token(gen.text, chunk=gen)
            yield gen

    async def _astream(self, prompt: str, stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        async for chunk in self.engine.astream(prompt, self._params(stop, kwargs)):
            gen = self._chunk(chunk)
            if run_manager is not None:
                await run_manager.on_llm_new_token(gen.text, chunk=gen)
            yield gen
