"""Requests to the engine as `Job`s: `run_jobs` awaits them and aborts them when the client
disconnects; usage of their outputs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ..engine_like import EngineLike
from ..outputs import GenerateOutput, RequestMeta, StreamChunk
from ..sampling_params import SamplingParams
from .metrics import RequestTracker
from .protocol import PromptTokensDetails, UsageInfo, new_id
from .http_errors import ClientDisconnected


@dataclass
class Job:
    """One engine request: the prompt keyword (prompt= / input_ids= / messages=) and its params."""

    inputs: dict[str, Any]
    params: SamplingParams
    group: int = 0  # index of the prompt this sample belongs to (n > 1 gives several jobs per prompt)
    rid: str = field(default_factory=lambda: new_id("req"))


async def _cancel_on_disconnect(request: Request, awaitable: Awaitable[Any]) -> Any:
    """Await `awaitable`, cancelling it (which aborts the engine requests) if the client disconnects."""
    task = asyncio.ensure_future(awaitable)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    dropped = False
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            dropped = True
            task.cancel()
            # let the cancellation land (it aborts the engine requests) before leaving; a cancelled
            # gather() ends with a CancelledError *exception*, not as cancelled, so remember who did it
            await asyncio.gather(task, return_exceptions=True)
    if dropped:
        raise ClientDisconnected("the client disconnected; its requests were aborted")
    return task.result()


async def run_jobs(request: Request, engine: EngineLike, jobs: list[Job], tracker: RequestTracker) -> list[GenerateOutput]:
    async def one(job: Job) -> GenerateOutput:
        out = await engine.agenerate(**job.inputs, params=job.params)
        tracker.tokens(len(out.token_ids))
        return out

    tasks = [asyncio.ensure_future(one(j)) for j in jobs]
    try:
        outs = await _cancel_on_disconnect(request, asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:  # one failed (or the client left): abort the siblings too
            task.cancel()
        tracker.finish()
        raise
    finish_tracker(tracker, outs, jobs)
    return outs


def finish_tracker(tracker: RequestTracker, outs: Sequence[GenerateOutput | None], jobs: Sequence[Job]) -> None:
    """Close the request's metrics with the usage of the outputs it got (None: a job that did not finish)."""
    usage = usage_info(outs, jobs)
    tracker.finish(usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens)


def usage_info(outs: Sequence[GenerateOutput | None], jobs: Sequence[Job]) -> UsageInfo:
    """Prompt tokens count once per prompt (not once per sample), completion tokens per sample."""
    prompt: dict[int, int] = {}
    cached: dict[int, int] = {}
    completion = 0
    for out, job in zip(outs, jobs):
        group = job.group
        if out is None:
            continue
        prompt[group] = max(prompt.get(group, 0), out.meta.prompt_tokens)
        cached[group] = max(cached.get(group, 0), out.meta.cached_tokens)
        completion += out.meta.completion_tokens or len(out.token_ids)
    p = sum(prompt.values())
    return UsageInfo(prompt_tokens=p, completion_tokens=completion, total_tokens=p + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())))


def chunk_as_output(chunk: StreamChunk, text: str, token_ids: list[int]) -> GenerateOutput:
    return GenerateOutput(text=text, token_ids=token_ids, finish_reason=chunk.finish_reason or "abort",
                          meta=chunk.meta or RequestMeta(completion_tokens=len(token_ids)))
