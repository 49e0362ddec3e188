"""Wire formats of the HTTP server: OpenAI-compatible and SGLang-native request/response models.

Request models accept (and ignore) unknown fields, as OpenAI's own server does, so newer clients
that send extra knobs keep working; response models carry exactly the fields clients read.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# ----------------------------------------------------------------------------- shared pieces


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class _Request(BaseModel):
    # strict: a string where a number or bool belongs is a 400, not silently coerced ("7" -> 7)
    model_config = ConfigDict(extra="allow", protected_namespaces=(), strict=True)


class StreamOptions(BaseModel):
    include_usage: bool = False


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ResponseFormat(BaseModel):
    """OpenAI `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None


class _SamplingFields(_Request):
    """Knobs shared by both OpenAI endpoints; the SGLang/vLLM extras follow OpenAI's."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    user: str | None = None
    # Extras (SGLang / vLLM names).
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON keys are) -> bias in [-100, 100]
    min_tokens: int = 0  # vLLM's name of min_new_tokens
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    response_format: ResponseFormat | None = None


# ----------------------------------------------------------------------------- /v1/completions


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: str | int | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ----------------------------------------------------------------------------- /v1/chat/completions


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "auto" | "required" | "none" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # None: one call per reply (small models keep to one)


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(BaseModel):
    index: int | None = None  # position in the reply's calls (streamed deltas need it)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None = None


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ----------------------------------------------------------------------------- /v1/models


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "radix-backend"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ----------------------------------------------------------------------------- SGLang-native /generate


class GenerateReqInput(_Request):
    """SGLang's `GenerateReqInput`: exactly one of `text` / `input_ids`, single or batch.

    `sampling_params` is SGLang's dict (max_new_tokens, temperature, stop, regex, json_schema, ...);
    logprob fields follow SGLang: `logprob_start_len` -1 means "output logprobs only".
    """

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    incremental_streaming_output: bool | None = None  # None: the server's --incremental-streaming-output

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def batch_size(self) -> int:
        if not self.is_batch:
            return 1
        return len(self.text if self.text is not None else self.input_ids)  # type: ignore[arg-type]

    def item(self, field: str, i: int) -> Any:
        """Per-request value of a field that may be given once for the batch or once per request."""
        value = getattr(self, field)
        return value[i] if isinstance(value, list) else value
