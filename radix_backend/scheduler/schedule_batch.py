"""One step's batch: which requests compute how many tokens, and the forward that does it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model_executor.model_runner import ForwardInput
from .request import Req


@dataclass
class ScheduleBatch:
    reqs: list[Req] = field(default_factory=list)
    new_slots: list[torch.Tensor] = field(default_factory=list)  # KV slots for each request's new tokens
    extend_lens: list[int] = field(default_factory=list)  # new tokens per request (1 when decoding)
    logit_rows: list[int] = field(default_factory=list)  # logits rows each request gets from the forward

    def add(self, req: Req, slots: torch.Tensor, n: int) -> None:
        self.reqs.append(req)
        self.new_slots.append(slots)
        self.extend_lens.append(n)

    def __iter__(self):
        """(request, its new slots, its new token count, its logits rows), in batch order."""
        return zip(self.reqs, self.new_slots, self.extend_lens, self.logit_rows)

    def forward_input(self) -> ForwardInput:
        """The model input: every request's new tokens after its computed KV, and which positions'
        logits come back (fills `logit_rows`)."""
        input_ids: list[int] = []
        positions: list[int] = []
        kv_parts: list[torch.Tensor] = []
        logits_indices: list[int] = []
        offset = 0
        self.logit_rows = []
        for req, slots, n in zip(self.reqs, self.new_slots, self.extend_lens):
            start = req.kv.kv_len
            input_ids.extend(req.fill_ids[start:start + n])
            positions.extend(range(start, start + n))
            kv_parts.append(req.kv.slots)
            kv_parts.append(slots)
            rows = logit_positions(req, start, n)
            self.logit_rows.append(len(rows))
            logits_indices.extend(offset + (p - start) for p in rows)
            offset += n
        return ForwardInput(input_ids=input_ids, positions=positions, prefix_lens=[r.kv.kv_len for r in self.reqs],
                            extend_lens=self.extend_lens, kv_indices=torch.cat(kv_parts),
                            out_slots=torch.cat(self.new_slots), logits_indices=logits_indices)


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
