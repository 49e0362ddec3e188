"""Typed errors of the DSL; all derive from radix_backend.errors so callers can catch one base."""

from __future__ import annotations

from radix_backend.errors import InvalidRequestError, RadixBackendError


class ProgramError(InvalidRequestError):
    """A DSL program is malformed: bad argument names, a non-string appended, bad gen/select args."""


class UnknownVariableError(ProgramError, KeyError):
    """`s["name"]` / `get_meta_info(name)` for a name no gen/select/var_scope has produced."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class StreamUsageError(ProgramError):
    """Streaming API used on a program that was not run with `stream=True` (or the other way round)."""


class UnsupportedFeatureError(RadixBackendError, NotImplementedError):
    """A frontend feature this backend cannot serve (e.g. `image` without a vision model)."""


class StopTracing(Exception):
    """Raised inside a traced program when the tracer cannot follow it any further."""
