"""The SGLang-native route: POST /generate (text or input_ids, batched, n samples, logprobs, streaming).

Part of `radix_backend.server`, which registers it with `add_native_routes`; SGLang's info
endpoints (/get_model_info, /get_server_info, /flush_cache) are served there.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ..errors import InvalidRequestError
from ..outputs import GenerateOutput
from ..sampling_params import sglang_sampling_params
from ..sglang_meta import (finished_meta, LogprobEntry, LogprobOptions, prompt_logprob_pairs, prompt_logprob_split,
                           StreamMeta)
from .jobs import Job, run_jobs
from .state import ServerState
from .streaming import open_streams, sse_event
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
        results = [await _sglang_result(state, job, spec, out)
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


def _logprob_options(state: ServerState, spec: _LogprobSpec) -> LogprobOptions:
    texts = (lambda ids: [state.tok(t) for t in ids]) if spec.with_text else None
    return LogprobOptions(spec.return_logprob, spec.top_logprobs_num, texts)


async def _input_logprobs(state: ServerState, job: Job, spec: _LogprobSpec,
                          options: LogprobOptions) -> list[LogprobEntry]:
    """SGLang's input_token_logprobs from logprob_start_len (none for -1); the first prompt token has None."""
    if not spec.return_logprob or spec.logprob_start_len < 0:
        return []
    ids = job.inputs.get("input_ids") or state.engine.encode(job.inputs["prompt"])
    scored = None
    if (split := prompt_logprob_split(ids, spec.logprob_start_len)) is not None:
        context, tokens = split
        scored = (await state.engine.ascore(context, [tokens]))[0].token_logprobs
    return options.entries(prompt_logprob_pairs(ids, spec.logprob_start_len, scored))


async def _sglang_result(state: ServerState, job: Job, spec: _LogprobSpec, out: GenerateOutput) -> dict[str, Any]:
    options = _logprob_options(state, spec)
    meta = finished_meta(out, job.rid, options, await _input_logprobs(state, job, spec, options))
    return {"text": out.text, "output_ids": list(out.token_ids), "meta_info": meta, "index": spec.index}


async def _stream_sglang(state: ServerState, jobs: list[Job], specs: list[_LogprobSpec], tracker: RequestTracker,
                         incremental: bool) -> StreamingResponse:
    """SGLang's stream: `data: {"text", "output_ids", "meta_info"}` events, then [DONE]. Text and ids
    are cumulative, or only the new part with `incremental` (SGLang's --incremental-streaming-output);
    meta_info is `StreamMeta`'s."""
    session = await open_streams(state, jobs, tracker)
    metas = []
    for job, spec in zip(jobs, specs):
        options = _logprob_options(state, spec)
        metas.append(StreamMeta(job.rid, options, incremental, await _input_logprobs(state, job, spec, options)))

    async def events() -> AsyncGenerator[str, None]:
        async for i, chunk in session.chunks():
            info = metas[i].update(chunk)
            text = chunk.text if incremental else session.texts[i]
            out_ids = list(chunk.token_ids) if incremental else session.ids[i]
            yield sse_event({"text": text, "output_ids": out_ids, "meta_info": info, "index": specs[i].index})

    return session.response(events())
