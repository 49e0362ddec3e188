"""Tracing: run a program on a recording state to get its IR graph without calling a model
(cf. sglang.lang.tracer).

Unknown arguments become `SglArgument` placeholders and `s["x"]` becomes an `SglVariable`; when
the program does something that needs a real value (formats a placeholder, branches on a
variable) tracing stops there. `prefix.py` reads a trace's constant prefix off it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .errors import ProgramError, StopTracing
from .ir import (
    BACKEND_NODES,
    TRACE_ONLY_NODES,
    SglArgument,
    SglExpr,
    SglFork,
    SglGetForkItem,
    SglJoin,
    Program,
    SglVariable,
    flatten,
    to_expr,
)
from .roles import RoleMethods


class TracerProgramState(RoleMethods):
    """Records what a program appends. `nodes` is this state's IR; `children` are its forks."""

    def __init__(self, arguments: dict[str, Any], *, only_trace_prefix: bool = False) -> None:
        self.arguments = arguments
        self.only_trace_prefix = only_trace_prefix
        self.nodes: list[SglExpr] = []
        self.children: list[TracerProgramState] = []
        self.stopped: str | None = None  # why tracing stopped early, if it did
        self.ret_value: Any = None

    def _submit(self, expr: SglExpr) -> None:
        for node in flatten([expr]):
            self.nodes.append(node)
            if self.only_trace_prefix and isinstance(node, BACKEND_NODES + TRACE_ONLY_NODES):
                raise StopTracing(f"prefix ends at {type(node).__name__}")

    def __iadd__(self, other: Any) -> "TracerProgramState":
        self._submit(to_expr(other))
        return self

    def get_var(self, name: str) -> SglVariable:
        return SglVariable(name, self)

    __getitem__ = get_var

    def fork(self, size: int = 1) -> "TracerStateGroup":
        self._submit(SglFork(size))
        kids = []
        for i in range(size):
            kid = TracerProgramState(self.arguments, only_trace_prefix=self.only_trace_prefix)
            kid.nodes.append(SglGetForkItem(i))
            kids.append(kid)
        self.children.extend(kids)
        return TracerStateGroup(kids, self)

    def _needs_value(self, what: str) -> Any:
        raise StopTracing(f"{what} needs run-time values")

    def text(self) -> str:
        return self._needs_value("text()")

    def messages(self) -> list[dict[str, str]]:
        return self._needs_value("messages()")

    def get_meta_info(self, name: str) -> dict[str, Any]:
        return self._needs_value(f"get_meta_info({name!r})")

    def set_var(self, name: str, value: Any) -> None:
        self._needs_value(f"set_var({name!r})")

    def sync(self) -> None:
        """Nothing runs while tracing."""

    def flatten_nodes(self) -> list[SglExpr]:
        """This state's nodes followed by each fork child's (depth first)."""
        out = list(self.nodes)
        for c in self.children:
            out.extend(c.flatten_nodes())
        return out

    def graph_str(self, indent: int = 0) -> str:
        """Readable dump of the IR graph (forks indented under their parent)."""
        pad = "  " * indent
        lines = [pad + _node_str(n) for n in self.nodes]
        for i, c in enumerate(self.children):
            lines.append(f"{pad}fork child {i}:")
            lines.append(c.graph_str(indent + 1))
        if self.stopped and indent == 0:
            lines.append(f"{pad}(trace stopped: {self.stopped})")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"TracerProgramState({len(self.nodes)} nodes, {len(self.children)} forks)"


def _node_str(node: SglExpr) -> str:
    text = repr(node)
    return text if len(text) <= 160 else text[:157] + "..."


class TracerStateGroup:
    """Forks of a traced state; mirrors ProgramStateGroup."""

    def __init__(self, states: list[TracerProgramState], src: TracerProgramState) -> None:
        self.states, self.src = states, src

    def __iadd__(self, other: Any) -> "TracerStateGroup":
        for i, s in enumerate(self.states):
            s += other(i) if callable(other) and not isinstance(other, (str, SglExpr)) else other
        return self

    def __getitem__(self, i: int) -> TracerProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[TracerProgramState]:
        return iter(self.states)

    def join(self, mode: str = "gather_variable") -> None:
        self.src._submit(SglJoin(mode))


def placeholder_arguments(program: Program, given: dict[str, Any] | None = None) -> dict[str, Any]:
    """Bound arguments plus `given`; every other parameter becomes an SglArgument placeholder."""
    args: dict[str, Any] = {name: SglArgument(name) for name in program.arg_names}
    args.update(program.bind_arguments)
    args.update(given or {})
    return args


def trace_program(program: Program, arguments: dict[str, Any], *, only_trace_prefix: bool = False) -> TracerProgramState:
    tracer = TracerProgramState(arguments, only_trace_prefix=only_trace_prefix)
    try:
        tracer.ret_value = program.func(tracer, **arguments)
    except StopTracing as exc:
        tracer.stopped = str(exc)
    except ProgramError:
        raise  # a malformed program is an error in tracing too
    except Exception as exc:  # noqa: BLE001 - user code touching a placeholder: the trace ends here
        tracer.stopped = f"{type(exc).__name__}: {exc}"
    return tracer
