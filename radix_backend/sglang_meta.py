"""SGLang's `meta_info` of a generation, built one way for every path that reports it.

The server's /generate, the offline `sgl.Engine` API and DSL programs run in process all use these
builders, so a program sees the same keys whether it runs here or through SGLang's own client
against our server (SGLang's RuntimeEndpoint hands the server's meta_info to the program as is).
Logprob entries are SGLang's `(logprob, token_id, text)` triples; text is None unless
`return_text_in_logprobs`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .outputs import GenerateOutput, RequestMeta, StreamChunk, TokenLogprob

LogprobEntry = tuple[float | None, int, str | None]
TokenTexts = Callable[[list[int]], list[str]]


def sglang_finish_reason(finish_reason: str, matched: str | int | None, completion_tokens: int,
                         message: str | None = None) -> dict[str, Any]:
    """SGLang's `meta_info.finish_reason`: {"type": "stop", "matched": ...} / {"type": "length", "length": n}."""
    if finish_reason == "length":
        return {"type": "length", "length": completion_tokens}
    if finish_reason == "abort":
        return {"type": "abort", "message": message or "aborted"}
    return {"type": "stop", "matched": matched}


@dataclass(frozen=True)
class LogprobOptions:
    """What a request asked to see of its logprobs (SGLang's return_logprob, top_logprobs_num,
    return_text_in_logprobs; `token_texts` renders ids when text is wanted)."""

    return_logprob: bool = False
    top_logprobs_num: int = 0
    token_texts: TokenTexts | None = None

    def entries(self, pairs: Sequence[tuple[float | None, int]]) -> list[LogprobEntry]:
        texts: Sequence[str | None] = self.token_texts([t for _, t in pairs]) if self.token_texts and pairs \
            else [None] * len(pairs)
        return [(lp, t, text) for (lp, t), text in zip(pairs, texts)]

    def output_logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict[str, list[Any]]:
        """output_token_logprobs (and output_top_logprobs when top_logprobs_num) of these tokens."""
        out: dict[str, list[Any]] = {"output_token_logprobs": self.entries([(lp.logprob, lp.token_id) for lp in logprobs])}
        if self.top_logprobs_num:
            out["output_top_logprobs"] = [self.entries([(v, t) for t, v in lp.top]) for lp in logprobs]
        return out

    def input_logprobs(self, entries: list[LogprobEntry]) -> dict[str, list[Any]]:
        """input_token_logprobs from gen's logprob_start_len (empty without one, as in SGLang; the first
        prompt token's logprob is None). Top lists of prompt tokens are not computed: None each."""
        out: dict[str, list[Any]] = {"input_token_logprobs": entries}
        if self.top_logprobs_num:
            out["input_top_logprobs"] = [None] * len(entries)
        return out


def prompt_logprob_split(ids: Sequence[int], start: int) -> tuple[list[int], list[int]] | None:
    """What to score for the prompt logprobs from `start` (>= 0): (context, tokens), the tokens from
    max(start, 1) on (the first prompt token has no logprob); None when no token is left to score."""
    first = max(start, 1)
    return (list(ids[:first]), list(ids[first:])) if first < len(ids) else None


def prompt_logprob_pairs(ids: Sequence[int], start: int,
                         scored: Sequence[float] | None) -> list[tuple[float | None, int]]:
    """(logprob, id) of each prompt token from `start`: None for the first prompt token, then `scored`,
    the logprobs of `prompt_logprob_split`'s tokens."""
    pairs: list[tuple[float | None, int]] = [(None, ids[0])] if start == 0 and ids else []
    return pairs + list(zip(scored or [], ids[max(start, 1):]))


def finished_meta(out: GenerateOutput, rid: str, options: LogprobOptions,
                  input_entries: list[LogprobEntry] | None = None) -> dict[str, Any]:
    """meta_info of a finished, non-streamed generation."""
    m = out.meta
    completion = m.completion_tokens or len(out.token_ids)
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": sglang_finish_reason(out.finish_reason, m.matched_stop, completion),
        "prompt_tokens": m.prompt_tokens,
        "completion_tokens": completion,
        "cached_tokens": m.cached_tokens,
        "e2e_latency": m.total_time_s,
    }
    if options.return_logprob:
        meta.update(options.input_logprobs(input_entries or []))
        meta.update(options.output_logprobs(out.logprobs or []))
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
    return meta


class StreamMeta:
    """meta_info of each event of a streamed generation. Counts (completion_tokens,
    output_token_logprobs_length) are running totals; the output logprob lists are all so far, or
    only this chunk's when `incremental` (SGLang's incremental streaming output). The last event also
    carries finish_reason and e2e_latency, so its keys are those of a non-streamed reply."""

    def __init__(self, rid: str, options: LogprobOptions, incremental: bool = False,
                 input_entries: list[LogprobEntry] | None = None) -> None:
        self.rid, self.options, self.incremental = rid, options, incremental
        self.input_entries = input_entries or []
        self.completion_tokens = 0
        self.logprobs: dict[str, list[Any]] = {}
        self.meta: RequestMeta | None = None

    def update(self, chunk: StreamChunk) -> dict[str, Any]:
        """The meta_info of the event that carries `chunk`."""
        self.completion_tokens += len(chunk.token_ids)
        self.meta = chunk.meta or self.meta
        m = self.meta
        info: dict[str, Any] = {"id": self.rid, "finish_reason": None,
                                "prompt_tokens": m.prompt_tokens if m else None,
                                "completion_tokens": self.completion_tokens,
                                "cached_tokens": m.cached_tokens if m else None}
        if chunk.finish_reason is not None:
            info["finish_reason"] = sglang_finish_reason(chunk.finish_reason, m.matched_stop if m else None,
                                                         self.completion_tokens)
            info["e2e_latency"] = m.total_time_s if m else None
        if self.options.return_logprob:
            info.update(self.options.input_logprobs(self.input_entries))
            for key, items in self.options.output_logprobs(chunk.logprobs or []).items():
                so_far = self.logprobs.setdefault(key, [])
                so_far += items
                info[key] = items if self.incremental else list(so_far)
            info["output_token_logprobs_length"] = len(self.logprobs["output_token_logprobs"])
        return info


def finish_from_sglang(meta: dict[str, Any]) -> tuple[str, Any]:
    """(finish reason, matched stop) of a meta_info's `finish_reason` (the inverse of `sglang_finish_reason`)."""
    fr = meta.get("finish_reason") or {}
    if isinstance(fr, str):
        return fr, None
    return fr.get("type", "stop"), fr.get("matched")


def output_from_sglang(obj: dict[str, Any]) -> GenerateOutput:
    """A GenerateOutput from one `/generate` result (`text`, `output_ids`, `meta_info`): what
    `finished_meta` wrote, read back (SGLang's client reads the same keys)."""
    meta = obj.get("meta_info", {})
    reason, matched = finish_from_sglang(meta)
    lps = meta.get("output_token_logprobs")
    return GenerateOutput(
        text=obj.get("text", ""),
        token_ids=list(obj.get("output_ids") or []),
        finish_reason=reason,  # type: ignore[arg-type]
        meta=RequestMeta(prompt_tokens=meta.get("prompt_tokens") or 0, cached_tokens=meta.get("cached_tokens") or 0,
                         completion_tokens=meta.get("completion_tokens") or 0,
                         total_time_s=meta.get("e2e_latency") or 0.0, matched_stop=matched),
        logprobs=[TokenLogprob(token_id=e[1], logprob=e[0]) for e in lps] if lps else None,
        request_id=str(meta.get("id") or ""),
    )
