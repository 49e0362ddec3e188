"""Async DSL programs (`run_async`, `run_batch_async`, `async for` over a streamed variable) on a
backend double with real async methods: the same state as `run`, many programs waiting on one loop
without a thread each, streaming on the loop, cancellation reaching the backend's await, errors.
The same on SmolLM2 is in test_lang_engine.py."""

from __future__ import annotations

import asyncio
import threading

import pytest

import radix_backend.lang as sgl
from radix_backend.outputs import ChoiceScore, GenerateOutput, RequestMeta, StreamChunk


def _answer(prompt: str, max_new_tokens: int) -> str:
    return "" if max_new_tokens == 0 else f"<{len(prompt) % 97}>"


class AsyncBackend(sgl.BaseBackend):
    """Answers `<len(prompt) % 97>`; its async methods wait on `gate` (open unless closed) and count
    who is waiting, who was cancelled and which thread each call came from."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.waiting = 0
        self.cancelled = 0
        self.sync_calls = 0
        self.async_calls = 0
        self.threads: set[int] = set()

    def _out(self, prompt: str, max_new_tokens: int) -> GenerateOutput:
        text = _answer(prompt, max_new_tokens)
        return GenerateOutput(text, list(range(len(text))), "stop", RequestMeta(prompt_tokens=len(prompt),
                                                                                completion_tokens=len(text)))

    async def _wait(self) -> None:
        self.async_calls += 1
        self.threads.add(threading.get_ident())
        self.waiting += 1
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.waiting -= 1

    def generate(self, prompts, params):
        self.sync_calls += 1
        return [self._out(p, sp.max_new_tokens) for p, sp in zip(prompts, params)]

    async def agenerate(self, prompts, params):
        await self._wait()
        return [self._out(p, sp.max_new_tokens) for p, sp in zip(prompts, params)]

    def score(self, prefix, continuations, *, unconditional=False):
        self.sync_calls += 1
        return [ChoiceScore(c, [1], [-float(len(c))]) for c in continuations]

    async def ascore(self, prefix, continuations, *, unconditional=False):
        await self._wait()
        return [ChoiceScore(c, [1], [-float(len(c))]) for c in continuations]

    def cache_prefix(self, prefix):
        self.sync_calls += 1

    async def acache_prefix(self, prefix):
        await self._wait()

    async def agenerate_stream(self, prompt, params):
        await self._wait()
        text = _answer(prompt, params.max_new_tokens)
        for i, ch in enumerate(text):
            await asyncio.sleep(0.001)
            last = i == len(text) - 1
            yield StreamChunk(ch, [i], "stop" if last else None, RequestMeta(completion_tokens=len(text)) if last else None)


@sgl.function
def agent(s, topic):
    s += "Topic: " + topic + "\n"
    s += "Kind:" + sgl.select("kind", ["animal", "plant"])
    s += "\nAbout:" + sgl.gen("about", max_tokens=8)
    if s["about"].startswith("<"):  # a read in the middle of the body: it must wait for the model
        s += " (bracketed)"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"\nIdea {i}:" + sgl.gen("idea", max_tokens=4)
    forks.join()
    s += "\nEnd:" + sgl.gen("end", max_tokens=4)


def _view(state: sgl.ProgramState) -> tuple:
    return state.text(), state["kind"], state["about"], state["idea"], state["end"]


async def test_run_async_gives_the_same_state_as_run():
    backend = AsyncBackend()
    ref = agent.run(topic="cats", backend=backend)
    sync_calls = backend.sync_calls
    state = await agent.run_async(topic="cats", backend=backend)
    assert _view(state) == _view(ref)
    assert backend.sync_calls == sync_calls and backend.async_calls >= 5  # every model call awaited
    assert backend.threads == {threading.get_ident()}  # ... on this loop's thread


async def test_many_programs_wait_on_one_loop_without_a_thread_each():
    backend = AsyncBackend()
    backend.gate.clear()
    threads_before = threading.active_count()
    tasks = [asyncio.ensure_future(agent.run_async(topic=f"t{i}", backend=backend)) for i in range(64)]
    for _ in range(500):
        if backend.waiting == 64:
            break
        await asyncio.sleep(0.01)
    assert backend.waiting == 64 and threading.active_count() == threads_before
    backend.gate.set()
    states = await asyncio.gather(*tasks)
    refs = [agent.run(topic=f"t{i}", backend=backend) for i in range(64)]
    assert [_view(s) for s in states] == [_view(r) for r in refs]


async def test_run_batch_async_keeps_input_order_and_caps_concurrency():
    backend = AsyncBackend()
    seen = []

    @sgl.function
    def one(s, x):
        s += f"x={x}:" + sgl.gen("y", max_tokens=3)

    async def watch():
        while True:
            seen.append(backend.waiting)
            await asyncio.sleep(0)

    watcher = asyncio.ensure_future(watch())
    states = await one.run_batch_async([{"x": "a" * i} for i in range(20)], backend=backend, max_concurrency=4)
    watcher.cancel()
    assert [s["y"] for s in states] == [_answer(f"x={'a' * i}:", 3) for i in range(20)]
    assert max(seen) <= 4
    with pytest.raises(sgl.ProgramError, match="max_concurrency"):
        await one.run_batch_async([{"x": "a"}], backend=backend, max_concurrency=0)


async def test_streamed_run_async_is_read_with_async_for_on_the_loop():
    backend = AsyncBackend()

    @sgl.function
    def story(s):
        s += "Once" + sgl.gen("a", max_tokens=8) + " then" + sgl.gen("b", max_tokens=8)

    state = await story.run_async(stream=True, backend=backend)
    with pytest.raises(sgl.StreamUsageError, match="await state.wait"):
        state.text()  # would block the loop the program runs on
    with pytest.raises(sgl.StreamUsageError, match="text_async_iter"):
        state.text_iter("a")
    pieces = [p async for p in state.text_async_iter("a")]
    assert len(pieces) > 1 and "".join(pieces) == state["a"] == _answer("Once", 8)  # a finished variable reads
    metas = [m async for _, m in state.text_async_iter("b", return_meta_data=True)]
    assert metas[-1]["completion_tokens"] == len(_answer("Once<5> then", 8))
    await state.wait()
    assert state.text() == "Once" + state["a"] + " then" + state["b"]
    whole = [p async for p in state.text_async_iter()]
    assert "".join(whole) == state.text()


async def test_cancelling_the_awaiting_task_cancels_the_backend_call():
    backend = AsyncBackend()
    backend.gate.clear()
    task = asyncio.ensure_future(agent.run_async(topic="cats", backend=backend))
    while backend.waiting == 0:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backend.cancelled == 1 and backend.waiting == 0

    state = await agent.run_async(topic="dogs", stream=True, backend=backend)
    while backend.waiting == 0:
        await asyncio.sleep(0.01)
    waiter = asyncio.ensure_future(state.wait())
    await asyncio.sleep(0.01)
    waiter.cancel()  # cancelling the wait cancels a streamed program too
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert backend.cancelled == 2 and backend.waiting == 0


async def test_errors_reach_the_awaiting_caller():
    backend = AsyncBackend()

    @sgl.function
    def picky(s, x):
        s += "x" + sgl.gen("y", max_tokens=2)
        if x == "bad":
            raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        await picky.run_async(x="bad", backend=backend)
    with pytest.raises(ValueError, match="bad input") as info:
        await picky.run_batch_async([{"x": "ok"}, {"x": "bad"}], backend=backend)
    assert any("item 1" in note for note in getattr(info.value, "__notes__", []))
    state = await picky.run_async(x="bad", stream=True, backend=backend)
    with pytest.raises(ValueError, match="bad input"):
        await state.wait()


def test_async_def_programs_are_refused_with_the_way_to_await():
    with pytest.raises(sgl.ProgramError, match="run_async"):
        @sgl.function
        async def prog(s):
            s += "x"


async def test_default_async_twins_run_a_sync_backend_off_the_loop():
    """A backend with only the synchronous methods still runs under run_async (each call on a
    worker thread), streaming included."""

    class SyncOnly(sgl.BaseBackend):
        def generate(self, prompts, params):
            return [GenerateOutput(_answer(p, sp.max_new_tokens), [0], "stop", RequestMeta()) for p, sp in
                    zip(prompts, params)]

        def score(self, prefix, continuations, *, unconditional=False):
            return [ChoiceScore(c, [1], [-float(len(c))]) for c in continuations]

    backend = SyncOnly()
    assert _view(await agent.run_async(topic="cats", backend=backend)) == _view(agent.run(topic="cats", backend=backend))

    @sgl.function
    def story(s):
        s += "Once" + sgl.gen("a", max_tokens=8)

    state = await story.run_async(stream=True, backend=backend)
    assert "".join([p async for p in state.text_async_iter("a")]) == _answer("Once", 8)
