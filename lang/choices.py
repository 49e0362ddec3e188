"""How `select` turns per-choice log-likelihoods into a decision (same methods as sglang.lang.choices).

Each method receives the `ChoiceScore`s from `Engine.score(prefix, choices)` (the prefix computed
once) and returns the chosen string plus the numbers it used, which end up in
`state.get_meta_info(name)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radix_backend.outputs import ChoiceScore


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def _entries(logprobs: list[float], token_ids: list[int]) -> list[tuple[float, int, str | None]]:
    """SGLang's (logprob, token id, text) entries; the interpreter fills in the text where it can."""
    return [(lp, t, None) for lp, t in zip(logprobs, token_ids)]


def _base_meta(scores: list[ChoiceScore]) -> dict[str, Any]:
    """The keys SGLang's select reports; output_token_logprobs is empty (choices are scored, not generated)."""
    return {
        "normalized_prompt_logprobs": [s.normalized_logprob for s in scores],
        "input_token_logprobs": [_entries(s.token_logprobs, s.token_ids) for s in scores],
        "output_token_logprobs": [[] for _ in scores],
    }


class ChoicesSamplingMethod:
    """Base class; `requires_unconditional_logprobs` asks the backend for prefix-free logprobs too."""

    requires_unconditional_logprobs: bool = False

    def __call__(self, choices: list[str], scores: list[ChoiceScore]) -> ChoicesDecision:
        raise NotImplementedError


class TokenLengthNormalized(ChoicesSamplingMethod):
    """Highest mean token logprob (SGLang's default)."""

    def __call__(self, choices: list[str], scores: list[ChoiceScore]) -> ChoicesDecision:
        meta = _base_meta(scores)
        best = int(np.argmax(meta["normalized_prompt_logprobs"]))
        return ChoicesDecision(choices[best], meta)


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Token-by-token greedy elimination: keep the choices with the best logprob at position j.

    A choice shorter than the longest is padded with its own mean logprob, so an option that is a
    prefix of a longer one competes fairly (as in SGLang).
    """

    def __call__(self, choices: list[str], scores: list[ChoiceScore]) -> ChoicesDecision:
        n = len(choices)
        width = max(1, max(len(s.token_logprobs) for s in scores))
        matrix = np.zeros((n, width))
        for i, s in enumerate(scores):
            lp = np.asarray(s.token_logprobs, dtype=np.float64)
            mean = float(lp.mean()) if lp.size else 0.0
            matrix[i, : lp.size] = lp
            matrix[i, lp.size :] = mean
        remaining = np.arange(n)
        for j in range(width):
            col = matrix[remaining, j]
            remaining = remaining[col == col.max()]
            if len(remaining) == 1:
                break
        meta = _base_meta(scores)
        meta["greedy_logprob_matrix"] = matrix.tolist()
        return ChoicesDecision(choices[int(remaining[0])], meta)


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """Highest mean of (conditional - unconditional) token logprobs: removes the prior of each choice."""

    requires_unconditional_logprobs = True

    def __call__(self, choices: list[str], scores: list[ChoiceScore]) -> ChoicesDecision:
        normalized = []
        for s in scores:
            if s.unconditional_logprobs is None:
                raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs from the backend")
            cond = np.asarray(s.token_logprobs, dtype=np.float64)
            uncond = np.asarray(s.unconditional_logprobs, dtype=np.float64)
            normalized.append(float((cond - uncond).mean()) if cond.size else 0.0)
        meta = _base_meta(scores)
        meta["unconditional_token_logprobs"] = [_entries(s.unconditional_logprobs or [], s.token_ids) for s in scores]
        meta["normalized_unconditional_prompt_logprobs"] = normalized
        return ChoicesDecision(choices[int(np.argmax(normalized))], meta)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
