"""What a step does with the forward's logits: each request takes its new KV and logits rows,
the sampled ones get their token, and everything that follows a token (grammar, text, stops)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..mem_cache.kv_manager import KVManager
from ..outputs import SchedulerStats, TokenLogprob
from ..utils import common_prefix_len
from .request import Req
from .sampling import greedy_picks, sample_batch
from .schedule_batch import ScheduleBatch
from .speculative import Draft, DraftStats

Detokenize = Callable[[Sequence[int], bool], str]  # (token ids, skip_special_tokens) -> text


@dataclass(eq=False)
class _Pick:
    """A request that samples this step: from logits row `row`, or, drafted, from rows `row`,
    `row + 1`, ... while the sampled tokens equal its draft's."""

    req: Req
    row: int
    draft: Draft | None = None
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))  # drafted: its rows' KV


class OutputProcessor:
    def __init__(self, kv: KVManager, stats: SchedulerStats, detokenize: Detokenize, *,
                 jump_forward: bool, draft_stats: DraftStats) -> None:
        self.kv = kv
        self.draft_stats = draft_stats
        self.stats = stats
        self.detokenize_ids = detokenize
        self.jump_forward = jump_forward

    def process(self, batch: ScheduleBatch, logits: torch.Tensor) -> None:
        to_sample = self._commit(batch, logits)
        if to_sample:
            self._sample(to_sample, logits)
            for pick in to_sample:
                if pick.draft is not None:
                    self._keep_verified(pick)

    def _commit(self, batch: ScheduleBatch, logits: torch.Tensor) -> list[_Pick]:
        """Each request takes its new KV and its logits rows (scored prompt positions, next-token
        logits); returns who samples from which rows. A drafted request's KV waits for its
        verification (`_keep_verified`)."""
        to_sample: list[_Pick] = []
        row = 0
        for req, slots, n, count, draft in batch:
            if not req.admitted_once:
                self._count_admission(req)
            if draft is not None:  # a decode token (maybe a prompt's last) and its draft
                to_sample.append(_Pick(req, row, draft, slots))
                row += count
                continue
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
                to_sample.append(_Pick(req, row))
            row += wants_sample or keeps_logits
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

    def _sample(self, picks: list[_Pick], logits: torch.Tensor) -> None:
        """Sample every request's next token; a drafted request samples its next row too, and so
        on, while each sampled token equals its draft's token there (then the next row's logits
        are the ones plain decoding would compute next). Each round samples all such rows at once."""
        now = time.perf_counter()
        greedy = self._argmax_of_rows(picks, logits)
        depth = 0
        while picks:
            before = [p.req.seq_len for p in picks]
            taken = self._sample_rows([p.req for p in picks], [p.row + depth for p in picks], logits, now, greedy)
            picks = [p for p, tok, n in zip(picks, taken, before)
                     if p.draft is not None and depth < len(p.draft.tokens) and tok == p.draft.tokens[depth]
                     and p.req.error is None and not p.req.finished and p.req.seq_len == n + 1]
            depth += 1

    @staticmethod
    def _argmax_of_rows(picks: list[_Pick], logits: torch.Tensor) -> dict[int, int]:
        """The argmax of each logits row that a request picking by plain argmax may take this step
        (its row and its draft's rows), by row, taken at once per run of adjacent rows: a round of
        drafted rows then gathers and scans nothing (a batch-8 step spent ~0.2 ms doing so)."""
        rows = sorted(row for p in picks if p.req.sampler_row().argmax_only
                      for row in range(p.row, p.row + 1 + (len(p.draft.tokens) if p.draft is not None else 0)))
        greedy: dict[int, int] = {}
        for _, run in itertools.groupby(enumerate(rows), key=lambda i_row: i_row[1] - i_row[0]):
            run_rows = [row for _, row in run]
            greedy.update(zip(run_rows, greedy_picks(logits[run_rows[0]:run_rows[-1] + 1])))
        return greedy

    def _sample_rows(self, reqs: list[Req], rows: list[int], logits: torch.Tensor, now: float,
                     greedy: dict[int, int]) -> list[int | None]:
        """Each request samples one token from its logits row and takes it; returns the tokens
        (None where sampling failed: that request's error is set). A row in `greedy` whose request
        still picks by plain argmax takes that token; the others are sampled together."""
        taken: list[int | None] = [None] * len(reqs)
        rest: list[int] = []
        for k, (req, row) in enumerate(zip(reqs, rows)):
            if row in greedy and req.sampler_row().argmax_only:
                taken[k] = greedy[row]
                self._take_token(req, greedy[row], None, now)
                self.stats.generated_tokens += 1
            else:
                rest.append(k)
        if not rest:
            return taken
        rest_rows = [rows[k] for k in rest]
        raw = logits if rest_rows == list(range(logits.shape[0])) else logits[torch.tensor(rest_rows, device=logits.device)]
        for k, picked in zip(rest, sample_batch(raw, [reqs[k].sampler_row() for k in rest])):
            req = reqs[k]
            if isinstance(picked, BaseException):
                req.error = picked
            else:
                self._take_token(req, *picked, now)
                self.stats.generated_tokens += 1
                taken[k] = picked[0]
        return taken

    def _keep_verified(self, pick: _Pick) -> None:
        """After verification: the request keeps the KV of its rows whose input tokens are its
        tokens (the decode token and the accepted draft tokens); the other rows' slots are freed."""
        req, draft = pick.req, pick.draft
        start = req.kv.kv_len
        actual = req.fill_ids[start + 1:start + 1 + len(draft.tokens)]
        # the last token stays pending (its logits give the next one) unless it is the decode token
        # itself (no token was taken: the request failed); grammar-forced tokens may extend a match
        accepted = max(0, min(common_prefix_len(draft.tokens, actual), req.seq_len - start - 2))
        req.kv.extend(pick.slots[:accepted + 1])
        self.kv.free_after(pick.slots, accepted + 1)
        req.spec.record(draft.kind, len(draft.tokens), accepted, self.draft_stats)
        self.stats.spec_verified_steps += 1
        self.stats.spec_draft_tokens += len(draft.tokens)
        self.stats.spec_accepted_tokens += accepted

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
