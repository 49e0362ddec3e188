"""Runs a program's synchronous body under asyncio without a thread per program.

DSL programs are plain functions (`s += gen(...)`, `if s["x"] == ...`), and a variable read must
block until the model has answered. Under `run_async` the body runs in a greenlet on the event
loop's thread: where it needs the backend, `call` hands the backend's coroutine to the task that
drives the greenlet, which awaits it and resumes the body with the result. So a thousand awaiting
programs cost a thousand small greenlets, not threads, and the loop keeps serving meanwhile.
(SQLAlchemy runs its synchronous core under asyncio the same way.) Outside a program greenlet,
`call` is the plain synchronous call.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

from greenlet import getcurrent, greenlet

T = TypeVar("T")


class _ProgramGreenlet(greenlet):
    """A program body's greenlet; `driver` is the greenlet of the task awaiting on its behalf."""

    def __init__(self, fn: Callable[..., Any], driver: greenlet) -> None:
        super().__init__(fn, driver)
        self.driver = driver


def in_program_greenlet() -> bool:
    return isinstance(getcurrent(), _ProgramGreenlet)


def wait_for(awaitable: Awaitable[T]) -> T:
    """From a program greenlet: the result of `awaitable`, awaited by the driving task."""
    current = getcurrent()
    if not isinstance(current, _ProgramGreenlet):
        raise RuntimeError("wait_for() outside a program run by run_async")
    return current.driver.switch(awaitable)


async def run_in_greenlet(fn: Callable[..., T], *args: Any) -> T:
    """Run `fn(*args)` in a program greenlet, awaiting whatever it waits for; its result or error.
    Cancelling the caller raises CancelledError inside `fn` where it waits (its requests abort)."""
    body = _ProgramGreenlet(fn, getcurrent())
    pending = body.switch(*args)
    while not body.dead:
        try:
            value = await pending
        except BaseException:
            pending = body.throw(*sys.exc_info())
        else:
            pending = body.switch(value)
    return pending


def call(backend: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """`backend.<name>(...)`; in a program greenlet, its async twin `a<name>` awaited instead."""
    if in_program_greenlet():
        return wait_for(getattr(backend, "a" + name)(*args, **kwargs))
    return getattr(backend, name)(*args, **kwargs)


def iterate(make_sync: Callable[[], Iterator[T]], make_async: Callable[[], AsyncIterator[T]]) -> Iterator[T]:
    """Items of a stream: the sync iterator, or in a program greenlet the async one, each item awaited."""
    if not in_program_greenlet():
        yield from make_sync()
        return
    stream = make_async()
    try:
        while True:
            try:
                item = wait_for(stream.__anext__())
            except StopAsyncIteration:
                return
            yield item
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            wait_for(aclose())
