"""Switching a running engine's speculative decoding off and on, for tests that compare the two or
whose subject (retraction, say) needs plain decoding steps."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def speculation(engine: Any, enabled: bool) -> Iterator[None]:
    """While open, the engine's scheduler drafts (or not); set between steps, on its thread."""
    previous = engine.scheduler.set_speculative(enabled)
    try:
        yield
    finally:
        engine.scheduler.set_speculative(previous)
