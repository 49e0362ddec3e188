"""Guidance backend: guidance programs (gen / select / json / roles / captures) on the radix engine.

Guidance drives decoding itself: its llguidance parser computes each token mask and asks the
backend for next-token logits of the whole token sequence so far. Guidance's transformers
backend keeps ONE cached sequence; ours calls `Engine.next_token_logits(ids)`, which matches the
sequence against the radix tree, computes only the unmatched suffix and inserts it, so every
program and call in the process (and LangChain / LlamaIndex / DSL requests) share KV.
"""

from __future__ import annotations

import weakref
from typing import Any

from ._common import require, resolve_engine

require("guidance", "guidance")

import numpy as np  # noqa: E402
from guidance._schema import SamplingParams as GuidanceSamplingParams  # noqa: E402
from guidance.chat import ChatMLTemplate, ChatTemplate  # noqa: E402
from guidance.models._base import Model  # noqa: E402
from guidance.models._engine import Engine as GuidanceEngine  # noqa: E402
from guidance.models._engine import EngineInterpreter, LogitsOutput  # noqa: E402
from guidance.models._transformers import TransformersTokenizer  # noqa: E402

from radix_backend.utils import common_prefix_len  # noqa: E402
from radix_backend.engine_like import LogitsEngine  # noqa: E402
from radix_backend.errors import InvalidRequestError, PromptTooLongError  # noqa: E402

__all__ = ["RadixGuidance", "RadixGuidanceEngine"]

_TOKENIZERS: "weakref.WeakKeyDictionary[Any, TransformersTokenizer]" = weakref.WeakKeyDictionary()


def default_chat_template(hf_tokenizer: Any) -> str | type[ChatTemplate] | None:
    """ChatML models (SmolLM2, Qwen...) get guidance's ChatML class; others their HF jinja string."""
    template = getattr(hf_tokenizer, "chat_template", None)
    if isinstance(template, str) and "<|im_start|>" in template:
        return ChatMLTemplate
    return template if isinstance(template, str) else None


def _guidance_tokenizer(hf_tokenizer: Any, chat_template: Any) -> TransformersTokenizer:
    """Building the llguidance token table takes ~0.5 s; reuse it per HF tokenizer."""
    if chat_template is not None:
        return TransformersTokenizer(hf_tokenizer, chat_template=chat_template)
    try:
        cached = _TOKENIZERS.get(hf_tokenizer)
    except TypeError:  # not weak-referenceable
        return TransformersTokenizer(hf_tokenizer, chat_template=default_chat_template(hf_tokenizer))
    if cached is None:
        cached = TransformersTokenizer(hf_tokenizer, chat_template=default_chat_template(hf_tokenizer))
        _TOKENIZERS[hf_tokenizer] = cached
    return cached


class RadixGuidanceEngine(GuidanceEngine):
    """guidance Engine whose logits come from the radix engine's `next_token_logits`."""

    def __init__(self, engine: LogitsEngine, *, chat_template: Any = None, enable_backtrack: bool = True,
                 enable_ff_tokens: bool = True, enable_monitoring: bool = False,
                 enable_token_probabilities: bool = False, enable_top_k: bool = False, top_k: int = 5) -> None:
        if not callable(getattr(engine, "next_token_logits", None)):
            raise InvalidRequestError(
                f"{type(engine).__name__} has no next_token_logits(input_ids); the guidance backend needs an "
                "engine version that exposes it")
        tokenizer = _guidance_tokenizer(engine.tokenizer, chat_template)
        super().__init__(tokenizer, enable_backtrack=enable_backtrack, enable_ff_tokens=enable_ff_tokens,
                         enable_monitoring=enable_monitoring, enable_token_probabilities=enable_token_probabilities,
                         enable_top_k=enable_top_k, top_k=top_k)
        self.engine = engine
        self._vocab_size = int(tokenizer._vocab_size)
        self._last: tuple[list[int], np.ndarray | None] = ([], None)  # one tuple: swapped atomically

    def get_logits(self, token_ids: list[int], include_all_uncached_tokens: bool = False) -> LogitsOutput:
        """Next-token logits of `token_ids`, shape (1, vocab).

        Only the last row is returned even when all uncached rows are asked for: guidance then
        just skips probabilities of fast-forwarded tokens (its code allows fewer rows).
        `n_cached` (guidance's usage accounting only) counts the tokens shared with this
        backend's previous call; the radix tree usually serves more (any earlier program), which
        `engine.cache_stats()` reports. Asking the engine per token would cost a scheduler round trip.
        """
        if not token_ids:
            raise InvalidRequestError("guidance asked for logits of an empty token sequence")
        limit = int(getattr(self.engine, "context_length", 0) or 0)
        if limit and len(token_ids) >= limit:
            raise PromptTooLongError(
                f"guidance program is {len(token_ids)} tokens, the model's context is {limit}; shorten the program")
        last_ids, last_logits = self._last
        if last_logits is not None and token_ids == last_ids:
            return {"logits": last_logits, "n_tokens": len(token_ids), "n_cached": len(token_ids)}
        shared = common_prefix_len(token_ids, last_ids) if last_ids else 0
        logits = self.engine.next_token_logits(list(token_ids))
        row = logits.detach().float().cpu().numpy().reshape(-1)[: self._vocab_size][None, :]
        self._last = (list(token_ids), row)
        return {"logits": row, "n_tokens": len(token_ids), "n_cached": min(shared, len(token_ids) - 1)}


class RadixGuidance(Model):
    """A guidance Model on the radix engine: `lm = RadixGuidance(); lm += "Q: ..." + gen("a", max_tokens=8)`.

    Pass `engine=` an Engine, or `model=` a checkpoint path (the process-shared engine is used).
    """

    def __init__(self, engine: LogitsEngine | None = None, model: str | None = None, *, echo: bool = False,
                 chat_template: Any = None, sampling_params: GuidanceSamplingParams | None = None,
                 enable_backtrack: bool = True, enable_ff_tokens: bool = True) -> None:
        radix_engine = resolve_engine(engine, model)
        guidance_engine = RadixGuidanceEngine(radix_engine, chat_template=chat_template,
                                              enable_backtrack=enable_backtrack, enable_ff_tokens=enable_ff_tokens,
                                              enable_token_probabilities=echo, enable_top_k=echo)
        super().__init__(interpreter=EngineInterpreter(guidance_engine),
                         sampling_params=sampling_params or GuidanceSamplingParams(), echo=echo)

    @property
    def radix_engine(self) -> LogitsEngine:
        """The radix engine underneath (for cache_stats and sharing with other adapters).
        (`lm.engine` stays guidance's own: the RadixGuidanceEngine.)"""
        return self._interpreter.engine.engine
