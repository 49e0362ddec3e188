"""One step's batch: which requests compute how many tokens, and the forward that does it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model_executor.model_runner import ForwardInput
from .request import Req
from .speculative import Draft


@dataclass
class ScheduleBatch:
    reqs: list[Req] = field(default_factory=list)
    new_slots: list[torch.Tensor] = field(default_factory=list)  # KV slots for each request's new tokens
    extend_lens: list[int] = field(default_factory=list)  # new tokens per request (1 when decoding)
    logit_rows: list[int] = field(default_factory=list)  # logits rows each request gets from the forward
    drafts: list[Draft | None] = field(default_factory=list)  # speculative tokens verified after a decode token

    def add(self, req: Req, slots: torch.Tensor, n: int) -> None:
        """`req` computes its next `n` tokens into `slots`."""
        self.reqs.append(req)
        self.new_slots.append(slots)
        self.extend_lens.append(n)
        self.drafts.append(None)

    def add_draft(self, index: int, draft: Draft, slots: torch.Tensor) -> None:
        """Request `index`, decoding one token, also verifies `draft` (its tokens' KV in `slots`)."""
        self.new_slots[index] = torch.cat([self.new_slots[index], slots])
        self.extend_lens[index] += len(draft.tokens)
        self.drafts[index] = draft

    def __iter__(self):
        """(request, its new slots, its new token count, its logits rows, its draft), in batch order."""
        return zip(self.reqs, self.new_slots, self.extend_lens, self.logit_rows, self.drafts)

    def forward_input(self) -> ForwardInput:
        """The model input: every request's new tokens after its computed KV, and which positions'
        logits come back (fills `logit_rows`). A drafted request's tokens are separate decode rows,
        row j attending to the request's KV and rows 0..j, so any attention backend serves them as
        a decode step (and an invariant one gives each row the bits a plain decode step would)."""
        input_ids: list[int] = []
        positions: list[int] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        kv_parts: list[torch.Tensor] = []
        logits_indices: list[int] = []
        argmax_rows: list[int] = []  # logits rows only picked from by argmax
        offset = 0
        self.logit_rows = []
        for req, slots, n, draft in zip(self.reqs, self.new_slots, self.extend_lens, self.drafts):
            start = req.kv.kv_len
            if draft is not None:
                input_ids.extend(req.fill_ids[start:start + 1] + draft.tokens)
                positions.extend(range(start, start + n))
                for j in range(n):
                    prefix_lens.append(start + j)
                    extend_lens.append(1)
                    kv_parts.append(req.kv.slots)
                    kv_parts.append(slots[:j + 1])
                self.logit_rows.append(n)
                if req.picks_by_argmax:
                    argmax_rows.extend(range(len(logits_indices), len(logits_indices) + n))
                logits_indices.extend(range(offset, offset + n))
                offset += n
                continue
            input_ids.extend(req.fill_ids[start:start + n])
            positions.extend(range(start, start + n))
            prefix_lens.append(start)
            extend_lens.append(n)
            kv_parts.append(req.kv.slots)
            kv_parts.append(slots)
            rows = logit_positions(req, start, n)
            self.logit_rows.append(len(rows))
            if rows and rows[-1] == req.seq_len - 1 and req.remaining_new_tokens > 0 and req.picks_by_argmax:
                argmax_rows.append(len(logits_indices) + len(rows) - 1)  # the row it samples from
            logits_indices.extend(offset + (p - start) for p in rows)
            offset += n
        return ForwardInput(input_ids=input_ids, positions=positions, prefix_lens=prefix_lens,
                            extend_lens=extend_lens, kv_indices=torch.cat(kv_parts),
                            out_slots=torch.cat(self.new_slots), logits_indices=logits_indices,
                            argmax_rows=argmax_rows)


def logit_positions(req: Req, start: int, n: int) -> list[int]:
    """Sequence positions whose logits `req` needs when it computes tokens [start, start + n):
    prompt positions it scores, then the last one if a token is sampled or its logits returned."""
    rows: list[int] = []
    if req.input_logprob_start is not None:
        lo = max(start, req.input_logprob_start - 1)
        hi = min(start + n, len(req.prompt_ids) - 1)
        rows.extend(range(lo, hi))
    if start + n == req.seq_len and (req.remaining_new_tokens > 0 or req.return_next_logits):
        rows.append(start + n - 1)
    return rows
