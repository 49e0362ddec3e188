"""Streaming jobs as server-sent events: `open_streams` starts them as a `StreamSession`, whose
`chunks()` merges their chunks (keeping each choice's text, ids and final output) and whose
`response()` sends the events, closes the streams and finishes the request's metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from fastapi.responses import StreamingResponse

from ..engine_like import EngineLike
from ..outputs import GenerateOutput, StreamChunk
from .metrics import RequestTracker
from .http_errors import error_response
from .jobs import Job, chunk_as_output, finish_tracker, usage_info
from .protocol import UsageInfo
from .state import ServerState


_DONE = object()


class MergedStreams:
    """Runs one `astream` per job in its own task and yields (job index, chunk) as they come.

    Errors of a stream are re-raised to the consumer; `close()` cancels every task, which closes
    each engine generator and so aborts its request (synchronous, so it is safe inside a
    cancelled scope).
    """

    def __init__(self, engine: EngineLike, jobs: Sequence[Job]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.ensure_future(self._pump(i, engine, job)) for i, job in enumerate(jobs)]
        self._remaining = len(jobs)

    async def _pump(self, index: int, engine: EngineLike, job: Job) -> None:
        try:
            async with aclosing(engine.astream(**job.inputs, params=job.params)) as stream:
                async for chunk in stream:
                    self._queue.put_nowait((index, chunk))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._queue.put_nowait((index, exc))
        finally:
            self._queue.put_nowait((index, _DONE))

    async def next(self) -> tuple[int, StreamChunk] | None:
        """The next chunk of any stream, or None once all streams are done."""
        while self._remaining:
            index, item = await self._queue.get()
            if item is _DONE:
                self._remaining -= 1
                continue
            if isinstance(item, BaseException):
                self.close()
                raise item
            return index, item
        return None

    def close(self) -> None:
        for task in self._tasks:
            if not task.done():
                task.cancel()


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator (so a dropped client aborts now,
    not whenever the generator happens to be garbage-collected)."""

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


def sse_event(payload: Any) -> str:
    body = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {body}\n\n"


class StreamSession:
    """One streamed request's jobs: their merged chunks, each choice's text and token ids so far,
    and its output once it finishes (`finals`, for the usage)."""

    def __init__(self, streams: MergedStreams, first: tuple[int, StreamChunk] | None, tracker: RequestTracker,
                 jobs: Sequence[Job]) -> None:
        self.streams, self._first, self.tracker, self.jobs = streams, first, tracker, jobs
        self.texts = [""] * len(jobs)
        self.ids: list[list[int]] = [[] for _ in jobs]
        self.finals: list[GenerateOutput | None] = [None] * len(jobs)

    async def chunks(self) -> AsyncIterator[tuple[int, StreamChunk]]:
        """(choice index, chunk) as they come; `texts`, `ids` and `finals` already hold the chunk."""
        item = self._first
        while item is not None:
            i, chunk = item
            self.tracker.tokens(len(chunk.token_ids))
            self.texts[i] += chunk.text
            self.ids[i] += chunk.token_ids
            if chunk.finish_reason is not None:
                self.finals[i] = chunk_as_output(chunk, self.texts[i], self.ids[i])
            yield item
            item = await self.streams.next()

    def usage(self) -> UsageInfo:
        return usage_info(self.finals, self.jobs)

    def response(self, events: AsyncGenerator[str, None]) -> StreamingResponse:
        """Stream `events` (SSE lines, sent as `chunks()` fills the session), then `data: [DONE]`.

        An error after the 200 status is sent is reported in-band: an error event, then [DONE]. A
        client that goes away (cancellation, or the generator closed) just ends the stream. Either
        way the engine streams are closed, aborting what is unfinished, and the tracker is finished
        with the usage of `finals`.
        """

        async def body() -> AsyncIterator[str]:
            try:
                async with aclosing(events):
                    async for event in events:
                        yield event
                yield "data: [DONE]\n\n"
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as exc:  # noqa: BLE001 - reported in-band: the 200 status is already sent
                yield _stream_error_event(exc)
                yield "data: [DONE]\n\n"
            finally:
                self.streams.close()
                finish_tracker(self.tracker, self.finals, self.jobs)

        return _ClosingStreamingResponse(body(), media_type="text/event-stream")


async def open_streams(state: ServerState, jobs: list[Job], tracker: RequestTracker) -> StreamSession:
    """Start the streams and wait for the first chunk, so submit-time errors (bad schema, prompt
    too long) still become 4xx responses instead of a broken event stream (and leave no gauge raised)."""
    streams = MergedStreams(state.engine, jobs)
    try:
        first = await streams.next()
    except BaseException:
        streams.close()
        tracker.finish()
        raise
    return StreamSession(streams, first, tracker, jobs)


def _stream_error_event(exc: BaseException) -> str:
    resp = error_response(exc)
    return f"data: {resp.body.decode()}\n\n"
