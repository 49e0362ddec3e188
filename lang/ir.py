"""IR of DSL programs: the expression nodes that `s += ...` appends (mirrors sglang.lang.ir).

Expressions are plain records; `+` between expressions (or an expression and a str) builds an
`SglExprList`, so `s += "Q: " + gen("a")` works as in SGLang. The interpreter executes the
nodes, the tracer records them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import ProgramError, StopTracing


# SGLang's dtype regexes, to the letter (programs import them from sglang.lang.ir). `gen(dtype=...)`
# constrains to these; int and float also stop at a space or newline.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""  # a double-quoted string, so it drops into JSON
DTYPE_REGEXES: dict[type, str] = {int: REGEX_INT, float: REGEX_FLOAT, str: REGEX_STR, bool: REGEX_BOOL}


@dataclass
class GenOptions:
    """Per-gen options beyond SamplingParams (SGLang's): samples per call and input-logprob reporting.
    On a gen node, None means "the run's value"."""

    n: int | None = None
    logprob_start_len: int | None = None
    return_text_in_logprobs: bool | None = None

    def over(self, defaults: "GenOptions") -> "GenOptions":
        """These options with unset ones taken from `defaults`."""
        return GenOptions(*(v if v is not None else d for v, d in
                            zip((self.n, self.logprob_start_len, self.return_text_in_logprobs),
                                (defaults.n, defaults.logprob_start_len, defaults.return_text_in_logprobs))))


class Program(Protocol):
    """What the interpreter and the tracer need of a DSL program (`api.SglFunction` is one):
    the user's function and its name, argument names and bound arguments."""

    name: str
    func: Callable[..., Any]
    arg_names: list[str]
    bind_arguments: dict[str, Any]


class SglExpr:
    """Base of every IR node."""

    def __add__(self, other: Any) -> "SglExprList":
        return concat(self, other)

    def __radd__(self, other: Any) -> "SglExprList":
        return concat(other, self)


def to_expr(value: Any) -> SglExpr:
    """Coerce what a program appends to an expression; only str and expressions are allowed."""
    if isinstance(value, SglExpr):
        return value
    if isinstance(value, str):
        return SglConstantText(value)
    raise ProgramError(
        f"can only append str or DSL expressions (gen, select, user, ...) to a program state, "
        f"got {type(value).__name__}: convert it with str() first"
    )


def concat(a: Any, b: Any) -> "SglExprList":
    return SglExprList(flatten([to_expr(a), to_expr(b)]))


def flatten(exprs: list[SglExpr]) -> list[SglExpr]:
    out: list[SglExpr] = []
    for e in exprs:
        if isinstance(e, SglExprList):
            out.extend(flatten(e.exprs))
        else:
            out.append(e)
    return out


@dataclass(eq=False)
class SglExprList(SglExpr):
    exprs: list[SglExpr]


@dataclass(eq=False)
class SglConstantText(SglExpr):
    value: str


@dataclass(eq=False)
class SglGen(SglExpr):
    """Generate text into variable `name`; `overrides` are SamplingParams fields set on this call."""

    name: str | None
    overrides: dict[str, Any] = field(default_factory=dict)
    dtype: type | None = None  # int | float | str | bool | None: constrains to DTYPE_REGEXES[dtype]
    options: GenOptions = field(default_factory=GenOptions)


@dataclass(eq=False)
class SglSelect(SglExpr):
    """Pick one of `choices` by likelihood (computed with Engine.score, prefix once)."""

    name: str | None
    choices: list[str]
    temperature: float
    choices_method: Any  # choices.ChoicesSamplingMethod


@dataclass(eq=False)
class SglRoleBegin(SglExpr):
    role: str


@dataclass(eq=False)
class SglRoleEnd(SglExpr):
    role: str


@dataclass(eq=False)
class SglVarScopeBegin(SglExpr):
    name: str


@dataclass(eq=False)
class SglVarScopeEnd(SglExpr):
    name: str


@dataclass(eq=False)
class SglConcateAndAppend(SglExpr):
    """Append what each forked state added after its fork point (join mode "concate_and_append")."""

    states: list[Any]


# ---- tracing-only nodes -------------------------------------------------------------------


@dataclass(eq=False)
class SglArgument(SglExpr):
    """Placeholder for a program argument whose value is unknown while tracing."""

    name: str

    def __str__(self) -> str:
        raise StopTracing(f"argument {self.name!r} converted to str")

    def __format__(self, spec: str) -> str:
        raise StopTracing(f"argument {self.name!r} formatted into a string")


@dataclass(eq=False)
class SglVariable(SglExpr):
    """Placeholder for `s["name"]` read while tracing (its value is only known at run time)."""

    name: str
    source: Any = field(default=None, repr=False)

    def __str__(self) -> str:
        raise StopTracing(f"variable {self.name!r} converted to str")

    def __format__(self, spec: str) -> str:
        raise StopTracing(f"variable {self.name!r} formatted into a string")

    def __bool__(self) -> bool:
        raise StopTracing(f"control flow on variable {self.name!r}")

    def __eq__(self, other: object) -> bool:  # type: ignore[override]
        raise StopTracing(f"comparison on variable {self.name!r}")

    __hash__ = object.__hash__


@dataclass(eq=False)
class SglFork(SglExpr):
    size: int


@dataclass(eq=False)
class SglGetForkItem(SglExpr):
    index: int


@dataclass(eq=False)
class SglJoin(SglExpr):
    mode: str


BACKEND_NODES = (SglGen, SglSelect)
TRACE_ONLY_NODES = (SglArgument, SglVariable, SglFork, SglGetForkItem, SglJoin)
