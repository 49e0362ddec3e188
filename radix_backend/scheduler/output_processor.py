"""What a step does with the forward's logits: each request takes its new KV and logits rows,
the sampled ones get their token, and everything that follows a token (grammar, text, stops)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
import torch

from ..mem_cache.kv_manager import KVManager
from ..outputs import SchedulerStats, TokenLogprob
from .request import Req
from .sampling import sample_batch
from .schedule_batch import ScheduleBatch

Detokenize = Callable[[Sequence[int], bool], str]  # (token ids, skip_special_tokens) -> text


class OutputProcessor:
    def __init__(self, kv: KVManager, stats: SchedulerStats, detokenize: Detokenize, *,
                 jump_forward: bool) -> None:
        self.kv = kv
        self.stats = stats
        self.detokenize_ids = detokenize
        self.jump_forward = jump_forward

    def process(self, batch: ScheduleBatch, logits: torch.Tensor) -> None:
        to_sample = self._commit(batch, logits)
        if to_sample:
            self._sample(to_sample, logits)

    def _commit(self, batch: ScheduleBatch, logits: torch.Tensor) -> list[tuple[Req, int]]:
        """Each request takes its new KV and its logits rows (scored prompt positions, next-token
        logits); returns the (request, row) pairs to sample from."""
        to_sample: list[tuple[Req, int]] = []
        row = 0
        for req, slots, n, count in batch:
            start = req.kv.kv_len
            req.kv.extend(slots)
            at_end = start + n == req.seq_len
            wants_sample = at_end and req.remaining_new_tokens > 0
            keeps_logits = at_end and req.return_next_logits
            n_input = count - (1 if wants_sample or keeps_logits else 0)
            if n_input:
                try:
                    req.record_input_logprobs(logits[row:row + n_input], start)
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    req.error = exc
            row += n_input
            if keeps_logits:
                req.next_logits = logits[row].clone()
            if wants_sample:
                to_sample.append((req, row))
            row += wants_sample or keeps_logits
            if not req.admitted_once:
                self._count_admission(req)
            finishing = at_end and req.remaining_new_tokens == 0  # max_new_tokens reached (or 0)
            if n > 1 and not finishing and req.kv.kv_len - req.kv.cached_len >= self.kv.page_size:
                # after a prefill (chunk) the prompt goes into the tree at once, so requests that
                # share it, waiting or yet to come, reuse it while this one is still decoding
                self.kv.cache(req.kv, req.computed_ids, finished=False)
            if finishing and not req.finished:
                req.finish_reason = "length"
        return to_sample

    def _count_admission(self, req: Req) -> None:
        req.admitted_once = True
        self.stats.prompt_tokens += len(req.prompt_ids)
        self.stats.cached_tokens += req.meta.cached_tokens
        req.meta.queue_time_s = time.perf_counter() - req.submit_time

    def _sample(self, items: list[tuple[Req, int]], logits: torch.Tensor) -> None:
        reqs = [r for r, _ in items]
        rows = [i for _, i in items]
        raw = logits if rows == list(range(logits.shape[0])) else logits[torch.tensor(rows, device=logits.device)]
        now = time.perf_counter()
        for req, picked in zip(reqs, sample_batch(raw, [r.sampler_row() for r in reqs])):
            if isinstance(picked, BaseException):
                req.error = picked
            else:
                self._take_token(req, *picked, now)
                self.stats.generated_tokens += 1

    def _take_token(self, req: Req, tok: int, lp: TokenLogprob | None, now: float) -> None:
        """Append a sampled token and run what follows it (grammar, detokenizing, stop checks); an
        error in any of them fails this request only."""
        if not req.output_ids:
            req.meta.first_token_time_s = now - req.submit_time
        req.meta.decode_steps += 1
        try:
            if req.params.logprobs:
                req.output_logprobs.append(lp)
            req.append_token(tok)
            if req.constraint is not None:
                from . import constrained

                constrained.advance(req, tok, jump_forward=self.jump_forward)
            self.detokenize(req)
        except Exception as exc:  # noqa: BLE001 - a grammar, tokenizer or stop-check error
            req.error = exc

    def detokenize(self, req: Req) -> None:
        req.detokenize(lambda ids: self.detokenize_ids(ids, req.params.skip_special_tokens))
