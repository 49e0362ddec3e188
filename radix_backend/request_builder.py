"""What a caller passed, turned into checked scheduler requests on the caller's thread.

Validation, tokenization, chat templating and constraint compilation happen here at submit time,
so bad input raises in the caller's thread (a typed error, a 4xx on the server) and never reaches
the scheduler. The engine owns one `RequestBuilder`.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from typing import Any

import torch

from .errors import InvalidRequestError, KVCacheTooSmallError, PromptTooLongError
from .sampling_params import SamplingParams, check_encodable
from .scheduler.request import Req, RequestHandle

Message = dict[str, Any]  # {"role": "system"|"user"|"assistant", "content": str}


def collect_eos_token_ids(model_config: Any, tokenizer: Any, checkpoint_path: Any) -> frozenset[int]:
    """Every token that ends a generation: the model config's, the tokenizer's and the checkpoint's
    generation config's (Llama 3 lists several)."""
    generation_config = None
    try:
        from transformers import GenerationConfig

        generation_config = GenerationConfig.from_pretrained(checkpoint_path, local_files_only=True)
    except Exception:  # noqa: BLE001 - a checkpoint without one (or a .gguf file)
        pass
    ids: set[int] = set()
    for source in (model_config.eos_token_id, tokenizer.eos_token_id,
                   getattr(generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return frozenset(ids)


class RequestBuilder:
    def __init__(self, tokenizer: Any, *, model_id: str, vocab_size: int, context_length: int, kv_capacity: int,
                 eos_token_ids: frozenset[int], seed: int) -> None:
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.kv_capacity = kv_capacity
        self.eos_token_ids = eos_token_ids
        self.seed = seed
        self._ids = itertools.count()
        self._compiler = None
        self._compiler_lock = threading.Lock()

    # ---- text ---------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        check_encodable(text, "prompt")  # a lone surrogate makes the tokenizer raise a TypeError
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        if not self.tokenizer.chat_template:
            raise InvalidRequestError(f"model {self.model_id} has no chat template; pass a plain prompt instead")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  tools=tools)

    @property
    def constraint_compiler(self):
        """The llguidance compiler, built on first use (constrained decoding is optional)."""
        with self._compiler_lock:
            if self._compiler is None:
                from .scheduler.constrained import ConstraintCompiler
                self._compiler = ConstraintCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
            return self._compiler

    # ---- requests -----------------------------------------------------------------------------
    def prompt_ids(self, prompt: Any, input_ids: Any, messages: Any) -> list[int]:
        """The prompt's token ids from exactly one of a text, token ids or chat messages."""
        given = sum(x is not None for x in (prompt, input_ids, messages))
        if given != 1:
            raise InvalidRequestError("pass exactly one of prompt, input_ids or messages")
        if messages is not None:
            prompt = self.apply_chat_template(messages)
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}")
            ids = self.encode(prompt)
        else:
            if not isinstance(input_ids, (list, tuple)) or not all(isinstance(t, int) for t in input_ids):
                raise InvalidRequestError("input_ids must be a list of ints")
            ids = list(input_ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"input_ids contain ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if not ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        return ids

    def request(self, prompt_ids: list[int], params: SamplingParams | None, stream: bool,
                input_logprob_start: int | None = None) -> Req:
        """A scheduler request: params checked (a copy: the scheduler may not see caller edits),
        the context window and the KV pool checked, the constraint compiled, the seed drawn."""
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        params = params.copy() if params is not None else SamplingParams()
        params.validate()
        outside = [t for t in (params.logit_bias or {}) if t >= self.vocab_size]
        if outside:
            raise InvalidRequestError(f"logit_bias names token ids outside the vocabulary [0, {self.vocab_size}): "
                                      f"{outside[:5]}")
        self._check_fits(len(prompt_ids), params.max_new_tokens)
        constraint = self.constraint_compiler.compile(params) if params.has_constraint else None
        rid = uuid.uuid4().hex
        generator = None
        if not params.is_greedy:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(params.seed if params.seed is not None else self.seed * 1_000_003 + next(self._ids))
        return Req(rid=rid, prompt_ids=prompt_ids, params=params, handle=RequestHandle(rid, stream),
                   eos_token_ids=self.eos_token_ids, max_total_tokens=self.context_length, constraint=constraint,
                   input_logprob_start=input_logprob_start, generator=generator)

    def _check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        window = self.context_length
        if prompt_len >= window:
            raise PromptTooLongError(
                f"prompt has {prompt_len} tokens but the model's context window is {window}; shorten the prompt")
        if prompt_len + max_new_tokens > window:  # a 400 as in vLLM/SGLang, not a clamp
            raise PromptTooLongError(
                f"this model's context window is {window} tokens, but {prompt_len} prompt tokens + "
                f"max_new_tokens {max_new_tokens} = {prompt_len + max_new_tokens}; lower "
                f"max_new_tokens to at most {window - prompt_len}")
        if prompt_len + max_new_tokens > self.kv_capacity:
            raise KVCacheTooSmallError(
                f"request needs {prompt_len + max_new_tokens} KV slots (prompt {prompt_len} + max_new_tokens) but the "
                f"pool has {self.kv_capacity}; raise kv_cache_tokens or lower max_new_tokens")

    def split_continuation(self, prefix: Any, prefix_ids: list[int], continuation: Any) -> tuple[list[int], int]:
        """Token ids of prefix+continuation and where the continuation's tokens start."""
        if isinstance(continuation, str):
            if not isinstance(prefix, str):
                full = prefix_ids + self.encode(continuation)
            else:
                full = self.encode(prefix + continuation)
        elif isinstance(continuation, list) and all(isinstance(t, int) for t in continuation):
            full = prefix_ids + list(continuation)
        else:
            raise InvalidRequestError("continuations must be strings or lists of token ids")
        start = 0
        while start < min(len(full), len(prefix_ids)) and full[start] == prefix_ids[start]:
            start += 1
        if start == len(full):
            raise InvalidRequestError(f"continuation {continuation!r} adds no tokens to the prefix")
        start = max(start, 1)
        return full, start

