"""Batched sampler: penalties, temperature, top-k / top-p / min-p, per-request seeds, logprobs.

Greedy rows take a plain argmax of the unmodified logits (bit-identical to HF greedy);
sampled rows are transformed together, then drawn one by one with each request's generator.
`sample_batch` adds logit bias, min-token suppression and grammar masks, and keeps a failing
row (a grammar error, say) from failing the rest of the batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels import native
from ..outputs import TokenLogprob
from ..sampling_params import SamplingParams


@dataclass
class SamplerRow:
    """What the sampler needs of one request for one step."""

    params: SamplingParams
    output_ids: list[int]
    prompt_ids: list[int]
    generator: torch.Generator | None
    suppressed: set[int] = field(default_factory=set)  # stop tokens not allowed yet (min_new_tokens)
    constraint: Any = None  # a scheduler.constrained.TokenConstraint masking the row

    @property
    def argmax_only(self) -> bool:
        """The pick is the plain argmax of the raw logits: greedy, and nothing below edits or reads
        them (penalties, logit bias, suppressed tokens, a grammar, logprobs)."""
        p = self.params
        return (p.is_greedy and not p.has_penalties and not p.logit_bias and not self.suppressed
                and self.constraint is None and not p.logprobs)


Picked = tuple[int, "TokenLogprob | None"]  # the token and, when asked for, its logprob entry
logger = logging.getLogger(__name__)


def sample_batch(raw: torch.Tensor, rows: list[SamplerRow]) -> list[Picked | BaseException]:
    """One pick per row of `raw` (left unchanged). The rows are sampled together; if that raises,
    once more row by row from the same logits and generator states, so only a row that fails
    gets its exception, and the others get exactly the tokens the batched call would have given."""
    states = {i: r.generator.get_state() for i, r in enumerate(rows) if r.generator is not None}
    try:
        return list(_sample_rows(raw, rows))
    except Exception as exc:  # noqa: BLE001 - isolate the faulty row below
        logger.warning("batched sampling failed (%s: %s); sampling its %d rows one by one",
                       type(exc).__name__, exc, len(rows))
    picked: list[Picked | BaseException] = []
    for i, row in enumerate(rows):
        if i in states:
            row.generator.set_state(states[i])
        try:
            picked.extend(_sample_rows(raw[i:i + 1], [row]))
        except Exception as row_exc:  # noqa: BLE001 - this row's fault only
            picked.append(row_exc)
    return picked


def _sample_rows(raw: torch.Tensor, rows: list[SamplerRow]) -> list[Picked]:
    short = {i: r.suppressed for i, r in enumerate(rows) if r.suppressed}
    biased = {i: r.params.logit_bias for i, r in enumerate(rows) if r.params.logit_bias}
    modifies = short or biased or any(r.constraint is not None or r.params.has_penalties for r in rows)
    work = raw.clone() if modifies else raw
    add_logit_bias(work, biased)
    suppress_tokens(work, short)
    if any(r.constraint is not None for r in rows):
        from . import constrained  # llguidance, loaded only when a request has a grammar

        constrained.mask_logits(work, [r.constraint for r in rows])
    tokens = sample(work, rows)
    lps: list[TokenLogprob | None] = [None] * len(rows)
    if any(r.params.logprobs for r in rows):
        lps = token_logprobs(raw, tokens, [r.params.top_logprobs for r in rows])
    return list(zip(tokens, lps))


def apply_penalties(logits: torch.Tensor, rows: list[SamplerRow]) -> None:
    """In place: repetition (HF-style, over prompt+output), frequency and presence (OpenAI-style, over output)."""
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long, device=logits.device)
            if seen.numel():
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if row.output_ids and (p.frequency_penalty or p.presence_penalty):
            ids = torch.tensor(row.output_ids, dtype=torch.long, device=logits.device)
            counts = torch.zeros(logits.shape[1], device=logits.device, dtype=logits.dtype)
            counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def add_logit_bias(logits: torch.Tensor, rows: dict[int, dict[int, float]]) -> None:
    """In place: row i's logits plus its bias per token id (ids beyond the vocabulary are skipped)."""
    vocab = logits.shape[1]
    for i, bias in rows.items():
        items = [(t, b) for t, b in bias.items() if t < vocab]
        if items:
            ids = torch.tensor([t for t, _ in items], dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor([b for _, b in items], dtype=logits.dtype, device=logits.device)


def suppress_tokens(logits: torch.Tensor, rows: dict[int, set[int]]) -> None:
    """In place: row i may not pick any of rows[i] (min_new_tokens keeps stop tokens out)."""
    vocab = logits.shape[1]
    for i, ids in rows.items():
        ids = sorted(t for t in ids if t < vocab)
        if ids:
            logits[i, torch.tensor(ids, dtype=torch.long, device=logits.device)] = float("-inf")


def _filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero out tokens outside top-k / nucleus / min-p, per row; rows renormalized by multinomial."""
    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[1], device=probs.device)[None, :]
    keep = ranks < top_k[:, None]
    cumulative = sorted_probs.cumsum(dim=-1)
    keep &= (cumulative - sorted_probs) < top_p[:, None]  # keep until mass reaches top_p (always >= 1 token)
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    keep[:, 0] = True
    sorted_probs = sorted_probs * keep
    return torch.zeros_like(probs).scatter_(1, sorted_idx, sorted_probs)


def greedy_picks(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (torch's: the first maximum, or the first NaN), natively for fp32 CPU
    logits (a batch-32 decode step's argmax took torch ~0.8 ms)."""
    if logits.dim() == 2 and logits.shape[1] > 0 and native.supports(logits):
        return native.argmax_rows(logits)
    return logits.argmax(dim=-1).tolist()


def sample(logits: torch.Tensor, rows: list[SamplerRow]) -> list[int]:
    """Pick one token per row; `logits` [B, V] float32 (already constraint-masked), modified in place."""
    if any(r.params.has_penalties for r in rows):
        apply_penalties(logits, rows)
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    if len(greedy) == len(rows):  # the common fast path: one argmax over the batch
        return greedy_picks(logits)
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    out = [0] * len(rows)
    if greedy:
        picks = greedy_picks(logits[greedy])
        for i, tok in zip(greedy, picks):
            out[i] = tok
    if sampled:
        sub = logits[sampled]
        params = [rows[i].params for i in sampled]
        temps = torch.tensor([p.temperature for p in params], device=sub.device, dtype=sub.dtype)
        probs = torch.softmax(sub / temps[:, None], dim=-1)
        vocab = probs.shape[1]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=sub.device)
        top_p = torch.tensor([p.top_p for p in params], device=sub.device, dtype=sub.dtype)
        min_p = torch.tensor([p.min_p for p in params], device=sub.device, dtype=sub.dtype)
        if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
            probs = _filter_probs(probs, top_k, top_p, min_p)
        for j, i in enumerate(sampled):
            out[i] = _draw(probs[j], rows[i].generator)
    return out


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from `probs`; a seeded row draws on its generator's device (the CPU), so the
    same seed gives the same token whether the logits came from the CPU or a GPU."""
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def token_logprobs(raw_logits: torch.Tensor, token_ids: list[int], top_n: list[int]) -> list[TokenLogprob]:
    """Logprobs of the chosen tokens under the model's raw distribution (as vLLM/OpenAI report them)."""
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    ids = torch.tensor(token_ids, device=raw_logits.device)
    chosen = logprobs.gather(1, ids[:, None]).squeeze(1).tolist()
    result = []
    max_top = max(top_n) if top_n else 0
    top_vals, top_idx = (logprobs.topk(max_top, dim=-1) if max_top else (None, None))
    for i, tok in enumerate(token_ids):
        top = []
        if top_n[i]:
            top = list(zip(top_idx[i, :top_n[i]].tolist(), top_vals[i, :top_n[i]].tolist()))
        result.append(TokenLogprob(token_id=tok, logprob=chosen[i], top=top))
    return result
