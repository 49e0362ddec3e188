"""The scheduler's mailbox: other threads post requests, aborts and calls; the scheduler thread
takes them between steps, so it alone ever touches scheduler state."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class Inbox:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    # ---- any thread -------------------------------------------------------------------------
    def post(self, kind: str, payload: Any = None) -> None:
        """`kind`: "add" (a list of requests), "abort" (a request id) or "wake" (nothing)."""
        self._queue.put((kind, payload))

    def call(self, fn: Callable[[], object], timeout: float) -> object:
        """fn's result, run by the thread that drains the inbox (or its exception, raised here)."""
        box: dict[str, object] = {}
        done = threading.Event()
        self._queue.put(("call", (fn, box, done)))
        if not done.wait(timeout):
            raise TimeoutError("scheduler did not answer in time")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box.get("value")

    # ---- the scheduler thread ---------------------------------------------------------------
    def drain(self, *, block: bool, on_add: Callable[[Any], None], on_abort: Callable[[str], None]) -> None:
        """Handle everything posted so far; with `block`, wait up to half a second for the first."""
        first = True
        while True:
            try:
                kind, payload = self._queue.get(timeout=0.5) if (block and first) else self._queue.get_nowait()
            except queue.Empty:
                return
            first = False
            if kind == "add":
                for req in payload:
                    on_add(req)
            elif kind == "abort":
                on_abort(payload)
            elif kind == "call":
                fn, box, done = payload
                try:
                    box["value"] = fn()
                except Exception as exc:
                    box["error"] = exc
                done.set()
