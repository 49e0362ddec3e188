"""What the route handlers share: the served model's names, limits, metrics and the engine (`ServerState`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..engine_like import EngineLike
from ..errors import InvalidRequestError, PromptTooLongError
from ..paths import public_model_name
from ..sampling_params import SamplingParams
from ..tool_calls import tool_call_json
from .guard import ServerLimits
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest
from .http_errors import ModelNotFoundError
from .jobs import Job

class ServerState:
    """The handlers' shared state: the engine, served model names, metrics."""

    def __init__(self, engine: EngineLike, served_model_name: str | None, model_path: str | None,
                 incremental_streaming_output: bool = False, limits: ServerLimits | None = None) -> None:
        self.engine = engine
        self.incremental_streaming_output = incremental_streaming_output
        self.limits = limits or ServerLimits()
        # SGLang's `model_path`: the model as the user named it (HF id, or the name of its dir or .gguf),
        # never a host path; SGLang's client picks its chat template from this name
        self.model_path = public_model_name(model_path or engine.model_id)
        self.model_name = served_model_name or self.model_path  # what /v1/models lists, as in SGLang and vLLM
        # requests may still name the model as the server was started with it (vLLM clients send the path)
        self._accepted = {self.model_name, self.model_path, "default", model_path, engine.model_id} - {None}
        self.metrics = ServerMetrics(engine)
        self.tok = TokenText(engine)

    def chat_template_info(self) -> dict[str, Any]:
        """The tokenizer's Jinja chat template and the special tokens it uses: a client renders chat
        prompts exactly as the server would without reading the checkpoint (whose path is not shown)."""
        tok = self.engine.tokenizer
        template = getattr(tok, "chat_template", None)
        if not isinstance(template, str):
            return {"chat_template": None}
        specials = {k: v for k, v in (getattr(tok, "special_tokens_map", None) or {}).items() if isinstance(v, str)}
        return {"chat_template": template, "special_tokens": specials}

    def check_model(self, model: str | None) -> str:
        if model in self._accepted:
            return self.model_name
        raise ModelNotFoundError(f"model {model!r} is not served here; use {self.model_name!r} (see /v1/models)")

    # ------------------------------------------------------------------ prompts

    def tokenized(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """`inputs` as token ids, tokenized once here: the length check and the engine then use the
        same ids (a long prompt is not tokenized twice)."""
        if "input_ids" in inputs:
            return inputs
        text = inputs["prompt"] if "prompt" in inputs else self.engine.apply_chat_template(inputs["messages"])
        return {"input_ids": self.engine.encode(text)}

    def prompt_len(self, inputs: dict[str, Any]) -> int:
        return len(self.tokenized(inputs)["input_ids"])

    def max_new_tokens(self, requested: int | None, inputs: dict[str, Any]) -> int:
        """OpenAI semantics: no max_tokens means "until the context window is full"."""
        if requested is not None:
            if requested < 0:
                raise InvalidRequestError(f"max_tokens must be >= 0, got {requested}")
            prompt_len = self.prompt_len(inputs)
            if prompt_len + requested > self.engine.context_length:  # a 400 naming the limit, as OpenAI and vLLM
                raise PromptTooLongError(
                    f"this model's maximum context length is {self.engine.context_length} tokens; the request asks for "
                    f"{prompt_len + requested} ({prompt_len} in the prompt, {requested} in max_tokens)")
            return requested
        limit = min(self.engine.context_length, self.kv_total())
        room = limit - self.prompt_len(inputs)
        if room < 1:
            raise PromptTooLongError(f"the prompt fills the {limit} tokens the model can hold (context window "
                                     f"{self.engine.context_length}, KV cache {self.kv_total()}); shorten it")
        return room

    def kv_total(self) -> int:
        return self.engine.kv_capacity

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
        """OpenAI messages as the chat template's {"role", "content"} dicts. OpenAI's roles only (a 400
        otherwise; developer is system, function is tool); an assistant turn's earlier tool_calls are
        replayed as the JSON the model writes for a call ({"name", "arguments"}), as the adapters do."""
        messages = []
        for i, m in enumerate(req.messages):
            role = _ROLE_ALIASES.get(m.role, m.role)
            if role not in _CHAT_ROLES:
                raise InvalidRequestError(f"messages[{i}].role {m.role!r} is not one of "
                                          f"{', '.join(sorted(_CHAT_ROLES | set(_ROLE_ALIASES)))}")
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.get("type") != "text":
                        raise InvalidRequestError(f"messages[{i}].content: only text parts are supported, "
                                                  f"got {part.get('type')!r}")
                    texts.append(str(part.get("text", "")))
                content = "".join(texts)
            calls = (m.model_extra or {}).get("tool_calls") if role == "assistant" else None
            if calls and not content:
                content = _replayed_tool_calls(calls, i)
            messages.append({"role": role, "content": content or ""})
        if not messages:
            raise InvalidRequestError("messages must not be empty")
        return messages

    def expand(self, inputs_list: list[dict[str, Any]], params_list: list[SamplingParams], n: int) -> list[Job]:
        self.check_n(n)
        jobs = []
        for group, (inputs, params) in enumerate(zip(inputs_list, params_list)):
            for j in range(n):
                p = params if (n == 1 or params.seed is None) else params.copy(seed=(params.seed + j) % (1 << 63))
                jobs.append(Job(inputs=inputs, params=p, group=group))
        self.check_limits(jobs)
        return jobs

    def check_n(self, n: Any) -> None:
        """Samples per prompt: an int in [1, max_n] (checked before any job is built)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"n must be an int >= 1, got {n!r}")
        if n > self.limits.max_n:
            raise InvalidRequestError(f"n={n} exceeds this server's limit of {self.limits.max_n} samples per prompt "
                                      "(--max-n)")

    def check_limits(self, jobs: Sequence[Job]) -> None:
        """The jobs' token budgets together <= max_n_tokens (a 400 naming the limit and its flag),
        before anything reaches the engine."""
        total = sum(job.params.max_new_tokens for job in jobs)
        if total > self.limits.max_n_tokens:
            raise InvalidRequestError(f"this request asks for up to {total} new tokens (n x max_tokens over its prompts), "
                                      f"over this server's limit of {self.limits.max_n_tokens} (--max-n-tokens); "
                                      "lower n or max_tokens")


_CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
_ROLE_ALIASES = {"developer": "system", "function": "tool"}


def _replayed_tool_calls(calls: Any, index: int) -> str:
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              for c in calls):
        raise InvalidRequestError(f"{where} must be a list of {{'type': 'function', 'function': {{...}}}} objects")
    replayed = []
    for call in calls:
        fn = call["function"]
        arguments = fn.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{where}: arguments of {fn.get('name')!r} are not JSON: {exc}") from None
        replayed.append({"name": fn.get("name"), "arguments": arguments})
    return tool_call_json(replayed)


class TokenText:
    """Token id -> its text, cached (logprob responses repeat the same tokens a lot)."""

    def __init__(self, engine: EngineLike) -> None:
        self.engine = engine
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.engine.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 200_000:
                self._cache[token_id] = text
        return text
