"""Constant prefixes of DSL programs: the text every run starts with before its first
argument-dependent or generated piece, found by tracing. `run_batch(cache_prefix=True)` and
`compile()` put it in the radix cache first, so the items start from a cache hit instead of
racing to compute the same prefix."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from radix_backend.sampling_params import SamplingParams

from .async_bridge import call
from .chat_template import ChatTemplate
from .errors import ProgramError
from .interpreter import ProgramRun, ProgramState
from .ir import BACKEND_NODES, TRACE_ONLY_NODES, Program
from .tracer import TracerProgramState, trace_program

if TYPE_CHECKING:
    from .backends.base import BaseBackend

MIN_CACHED_PREFIX_CHARS = 32  # shorter shared prefixes are not worth a request of their own


class _NoBackend:
    def get_chat_template(self) -> ChatTemplate:  # pragma: no cover - the template is always passed
        raise AssertionError


def constant_prefix(tracer: TracerProgramState, chat_template: ChatTemplate) -> str:
    """Text a run of the traced program produces before its first non-constant node."""
    run = ProgramRun(_NoBackend(), SamplingParams(), chat_template)  # type: ignore[arg-type]
    state = ProgramState(run)
    for node in tracer.nodes:
        if isinstance(node, BACKEND_NODES + TRACE_ONLY_NODES):
            break
        try:
            state._execute_local(node)
        except ProgramError:
            break
    return state._text


def batch_common_prefix(program: Program, backend: BaseBackend, batch_arguments: list[dict[str, Any]]) -> str:
    """Longest text every item of the batch starts with (each item traced with its real arguments)."""
    tmpl = backend.get_chat_template()
    prefixes = [
        constant_prefix(trace_program(program, {**program.bind_arguments, **args}, only_trace_prefix=True), tmpl)
        for args in batch_arguments
    ]
    return os.path.commonprefix(prefixes)


def cache_common_prefix(program: Program, backend: BaseBackend, batch_arguments: list[dict[str, Any]]) -> None:
    """Put the batch's common constant prefix in the backend's cache, when it is worth it."""
    if len(batch_arguments) < 2:
        return
    prefix = batch_common_prefix(program, backend, batch_arguments)
    if len(prefix) >= MIN_CACHED_PREFIX_CHARS:
        call(backend, "cache_prefix", prefix)
