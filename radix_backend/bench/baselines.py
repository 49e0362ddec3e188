"""Baselines the benchmarks compare against, built from the other projects' own code."""

from __future__ import annotations

from typing import Any


def guidance_transformers_baseline(model: Any, tokenizer: Any) -> Any:
    """guidance's own transformers backend (the comparison baseline), fixed for transformers >= 5.

    guidance 0.3.1 rewinds its single cached sequence with `DynamicCache.crop(kept_length)`;
    transformers 5 reads a positive argument as an error (it now means tokens to remove, negative).
    We translate the call on each cache object; everything else is guidance's code unchanged.
    """
    from guidance._schema import SamplingParams as GuidanceSamplingParams
    from guidance.models._base import Model
    from guidance.models._engine import EngineInterpreter
    from guidance.models._transformers import TransformersEngine

    class _AbsoluteCropEngine(TransformersEngine):
        def get_logits(self, token_ids: list[int], include_all_uncached_tokens: bool = False) -> Any:
            cache = self._past_key_values
            if cache is not None and hasattr(cache, "crop") and not getattr(cache, "_absolute_crop", False):
                relative_crop = cache.crop

                def crop(keep: int, _cache: Any = cache, _crop: Any = relative_crop) -> None:
                    _crop(keep - _cache.get_seq_length() if keep >= 0 else keep)

                cache.crop = crop
                cache._absolute_crop = True
            return super().get_logits(token_ids, include_all_uncached_tokens)

    from ..adapters.guidance import default_chat_template

    engine = _AbsoluteCropEngine(model, tokenizer, chat_template=default_chat_template(tokenizer),
                                 enable_monitoring=False, enable_token_probabilities=False, enable_top_k=False)
    return Model(interpreter=EngineInterpreter(engine), sampling_params=GuidanceSamplingParams(), echo=False)
