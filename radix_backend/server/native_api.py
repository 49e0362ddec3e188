"""The SGLang-native route: POST /generate (text or input_ids, batched, n samples, logprobs, streaming).

Part of `radix_backend.server`, which registers it with `add_native_routes`; SGLang's info
endpoints (/get_model_info, /get_server_info, /flush_cache) are served there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ..errors import InvalidRequestError
from ..outputs import GenerateOutput, sglang_finish_reason
from ..sampling_params import sglang_sampling_params
from .common import (chunk_as_output, iterate_streams, Job, open_streams, run_jobs, ServerState, sse_event,
                            sse_response)
from .metrics import RequestTracker
from .protocol import GenerateReqInput

def add_native_routes(app: FastAPI, state: ServerState) -> None:
    """Register SGLang's /generate on `app`, served from `state`."""
    engine = state.engine

    @app.post("/generate")
    async def generate(request: Request, req: GenerateReqInput) -> Any:
        jobs, specs = _sglang_jobs(req, state)
        state.check_limits(jobs)
        tracker = state.metrics.track("/generate")
        if req.stream:
            incremental = state.incremental_streaming_output if req.incremental_streaming_output is None \
                else req.incremental_streaming_output
            return await _stream_sglang(state, jobs, specs, tracker, incremental)
        outs = await run_jobs(request, engine, jobs, tracker)
        results = [await _sglang_result(state, job, spec, out, req.return_text_in_logprobs)
                   for job, spec, out in zip(jobs, specs, outs)]
        return results if (req.is_batch or len(results) > 1) else results[0]


# ============================================================================ request -> jobs


@dataclass
class _LogprobSpec:
    """Per-request logprob options of a /generate call."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    index: int = 0
    with_text: bool = False  # return_text_in_logprobs


def _sglang_jobs(req: GenerateReqInput, state: ServerState) -> tuple[list[Job], list[_LogprobSpec]]:
    if (req.text is None) == (req.input_ids is None):
        raise InvalidRequestError("set exactly one of text or input_ids")
    if req.text is not None:
        prompts = req.text if isinstance(req.text, list) else [req.text]
        inputs_list = [{"prompt": t} for t in prompts]
    else:
        ids = req.input_ids if req.is_batch else [req.input_ids]
        if not ids or not all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in ids):
            raise InvalidRequestError("input_ids must be a non-empty list of token ids or a list of such lists")
        inputs_list = [{"input_ids": list(x)} for x in ids]
    size = len(inputs_list)
    if size == 0:
        raise InvalidRequestError("text must not be an empty list")
    for name in ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num"):
        value = getattr(req, name)
        if isinstance(value, list) and len(value) != size:
            raise InvalidRequestError(f"{name} has {len(value)} entries but the batch has {size} prompts")
    jobs, specs = [], []
    for i, inputs in enumerate(inputs_list):
        params, n = sglang_sampling_params(req.item("sampling_params", i))
        state.check_n(n)
        want = bool(req.item("return_logprob", i))
        top = int(req.item("top_logprobs_num", i) or 0)
        if want:
            params = params.copy(logprobs=True, top_logprobs=top)
            params.validate()
        rid = req.item("rid", i)
        for j in range(n):
            job = Job(inputs=inputs, params=params, group=i)
            if rid is not None:
                job.rid = str(rid) if n == 1 else f"{rid}-{j}"
            jobs.append(job)
            specs.append(_LogprobSpec(want, int(req.item("logprob_start_len", i)), top, len(specs),
                                      req.return_text_in_logprobs))
    return jobs, specs


# ============================================================================ results


def _lp_entry(logprob: float | None, token_id: int, state: ServerState, with_text: bool) -> list[Any]:
    return [logprob, token_id, state.tok(token_id) if with_text else None]


async def _input_logprobs(state: ServerState, job: Job, start: int, with_text: bool) -> list[list[Any]]:
    """SGLang's input_token_logprobs from `start`: [logprob, id, text]; the first prompt token has None."""
    ids = job.inputs.get("input_ids") or state.engine.encode(job.inputs["prompt"])
    start = max(0, start)
    if start >= len(ids):
        return []
    entries: list[list[Any]] = []
    if start == 0:
        entries.append(_lp_entry(None, ids[0], state, with_text))
        start = 1
    if start < len(ids):
        scores = await asyncio.to_thread(state.engine.score, list(ids[:start]), [list(ids[start:])])
        entries += [_lp_entry(lp, t, state, with_text) for lp, t in zip(scores[0].token_logprobs, ids[start:])]
    return entries


async def _sglang_result(state: ServerState, job: Job, spec: _LogprobSpec, out: GenerateOutput,
                         with_text: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": job.rid,
        "finish_reason": sglang_finish_reason(out.finish_reason, out.meta.matched_stop, out.meta.completion_tokens),
        "prompt_tokens": out.meta.prompt_tokens,
        "completion_tokens": out.meta.completion_tokens or len(out.token_ids),
        "cached_tokens": out.meta.cached_tokens,
        "e2e_latency": out.meta.total_time_s,
    }
    if spec.return_logprob:
        lps = out.logprobs or []
        meta["output_token_logprobs"] = [_lp_entry(lp.logprob, lp.token_id, state, with_text) for lp in lps]
        meta["output_top_logprobs"] = [[_lp_entry(v, t, state, with_text) for t, v in lp.top] if spec.top_logprobs_num
                                       else None for lp in lps]
        if spec.logprob_start_len >= 0:
            inp = await _input_logprobs(state, job, spec.logprob_start_len, with_text)
            meta["input_token_logprobs"] = inp
            meta["input_top_logprobs"] = [None] * len(inp)
            known = [e[0] for e in inp if e[0] is not None]
            meta["normalized_prompt_logprob"] = sum(known) / max(1, len(known))
    return {"text": out.text, "output_ids": list(out.token_ids), "meta_info": meta, "index": spec.index}


async def _stream_sglang(state: ServerState, jobs: list[Job], specs: list[_LogprobSpec], tracker: RequestTracker,
                         incremental: bool) -> StreamingResponse:
    """SGLang's stream: `data: {"text", "output_ids", "meta_info"}` events, then [DONE]. Text, ids and
    output_token_logprobs are cumulative, or only the new part with `incremental` (SGLang's
    --incremental-streaming-output); meta_info's counts (completion_tokens,
    output_token_logprobs_length) are always running totals."""
    streams, first = await open_streams(state, jobs, tracker)
    finals: list[GenerateOutput | None] = [None] * len(jobs)

    async def events() -> AsyncGenerator[str, None]:
        texts = [""] * len(jobs)
        ids: list[list[int]] = [[] for _ in jobs]
        logprobs: list[list[list[Any]]] = [[] for _ in jobs]
        async for i, chunk in iterate_streams(streams, first):
            tracker.tokens(len(chunk.token_ids))
            texts[i] += chunk.text
            ids[i] += chunk.token_ids
            meta = chunk.meta
            finish = None
            if chunk.finish_reason is not None:
                finals[i] = chunk_as_output(chunk, texts[i], ids[i])
                finish = sglang_finish_reason(chunk.finish_reason, meta.matched_stop if meta else None, len(ids[i]))
            info: dict[str, Any] = {"id": jobs[i].rid, "finish_reason": finish,
                                    "prompt_tokens": meta.prompt_tokens if meta else None,
                                    "completion_tokens": len(ids[i]), "cached_tokens": meta.cached_tokens if meta else None}
            if specs[i].return_logprob:
                new = [_lp_entry(lp.logprob, lp.token_id, state, specs[i].with_text) for lp in chunk.logprobs or []]
                logprobs[i] += new
                info["output_token_logprobs"] = new if incremental else list(logprobs[i])
                info["output_token_logprobs_length"] = len(logprobs[i])
            text = chunk.text if incremental else texts[i]
            out_ids = list(chunk.token_ids) if incremental else ids[i]
            yield sse_event({"text": text, "output_ids": out_ids, "meta_info": info, "index": specs[i].index})

    return sse_response(events(), streams, tracker, finals, jobs)
