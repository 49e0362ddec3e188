"""Incremental detokenizing: a request's output text kept up to date one token at a time."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Decode = Callable[[list[int]], str]


@dataclass
class IncrementalDetokenizer:
    """As in vLLM and SGLang: decode the tokens read last time (as context) with and without the
    new ones; the difference is the new text. Decoding with context keeps tokenizers that drop a
    leading space right, and the work per token stays constant (re-decoding the whole output each
    token is quadratic). A new tail ending in an incomplete UTF-8 character stays pending (not
    committed) until later tokens complete it."""

    text: str = ""  # committed text plus any pending tail
    committed: str = ""  # text of ids[:read_offset], final
    prefix_offset: int = 0  # ids[prefix_offset:read_offset] were decoded last time, as context
    read_offset: int = 0

    def update(self, ids: Sequence[int], decode: Decode) -> int:
        """Bring `text` up to date with `ids`; returns where text not seen before may start
        (the committed length before this call), so stop strings are searched from there."""
        context = decode(list(ids[self.prefix_offset:self.read_offset]))
        full = decode(list(ids[self.prefix_offset:]))
        new = full[len(context):]
        searched = len(self.committed)
        self.text = self.committed + new
        if new and not new.endswith("\ufffd"):
            self.committed = self.text
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return searched
