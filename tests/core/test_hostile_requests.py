"""Requests that used to stall everyone: slow preparation on a shared event loop, huge or deeply
nested constraints. Each is now a 400 or runs off the loop; other work goes on meanwhile."""

from __future__ import annotations

import asyncio
import time

import pytest

from radix_backend import SamplingParams
from radix_backend.errors import ConstraintError, InvalidRequestError
from radix_backend.sampling_params import MAX_CHOICES, MAX_CONSTRAINT_CHARS


def test_async_preparation_runs_off_the_event_loop(tiny_engine, monkeypatch):
    """Tokenizing a 4 MB prompt or compiling a big grammar takes seconds; a server's event loop must
    keep answering other clients meanwhile."""
    real = tiny_engine.requests.prompt_ids

    def slow(*args, **kwargs):
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(tiny_engine.requests, "prompt_ids", slow)

    async def main() -> tuple[int, str]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.ensure_future(ticker())
        out = await tiny_engine.agenerate("Hello", SamplingParams(max_new_tokens=2, temperature=0))
        chunks = [c async for c in tiny_engine.astream("Hello", SamplingParams(max_new_tokens=2, temperature=0))]
        task.cancel()
        return ticks, out.text + "".join(c.text for c in chunks)

    ticks, text = asyncio.run(main())
    assert text and ticks > 40  # ~100 ticks in the 1 s of preparation; 0 if it blocked the loop


def test_a_caller_cancelled_during_preparation_leaves_no_request_running(tiny_engine, monkeypatch):
    real = tiny_engine.requests.prompt_ids
    monkeypatch.setattr(tiny_engine.requests, "prompt_ids", lambda *a, **k: (time.sleep(0.3), real(*a, **k))[1])

    async def main() -> None:
        task = asyncio.ensure_future(tiny_engine.agenerate("Hello", SamplingParams(max_new_tokens=2000, ignore_eos=True)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)  # the preparation finishes, submits, and is aborted at once

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while tiny_engine.scheduler.running or tiny_engine.scheduler.waiting:
        assert time.monotonic() < deadline, "the cancelled request kept running"
        time.sleep(0.05)


def test_oversized_constraints_are_refused_before_compiling():
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_CHOICES} strings"):
        SamplingParams(choices=[f"c{i}" for i in range(MAX_CHOICES + 1)]).validate()
    with pytest.raises(InvalidRequestError, match="characters; at most"):
        SamplingParams(regex="a" * (MAX_CONSTRAINT_CHARS + 1)).validate()
    SamplingParams(choices=[f"c{i}" for i in range(100)]).validate()


def test_a_deeply_nested_schema_is_a_constraint_error(tiny_engine):
    schema: dict = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(ConstraintError):
        tiny_engine.generate("Hi", SamplingParams(max_new_tokens=2, json_schema=schema))
    assert tiny_engine.generate("Hi", SamplingParams(max_new_tokens=2, temperature=0)).text is not None
