"""Switching a running engine's speculative decoding off and on, for tests that compare the two or
whose subject (retraction, say) needs plain decoding steps."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def speculation(engine: Any, enabled: bool) -> Iterator[None]:
    """While open, the engine's scheduler drafts (or not); set between steps, on its thread."""
    scheduler = engine.scheduler
    previous = scheduler.call(lambda: scheduler.speculative)
    scheduler.call(lambda: setattr(scheduler, "speculative", enabled))
    try:
        yield
    finally:
        scheduler.call(lambda: setattr(scheduler, "speculative", previous))
