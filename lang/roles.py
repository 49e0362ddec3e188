"""Role and variable-scope methods (`s.user(...)`, `with s.assistant():`, `with s.var_scope(name):`)
shared by the running program state and the tracer's recording state."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .ir import SglExpr, SglExprList, SglRoleBegin, SglRoleEnd, SglVarScopeBegin, SglVarScopeEnd, to_expr


class RoleMethods:
    """`s.user(...)`, `with s.user():`, `with s.var_scope(name):` shared by real and traced states."""

    def _submit(self, expr: SglExpr) -> None:
        raise NotImplementedError

    def _role_common(self, role: str, expr: Any = None) -> Any:
        if expr is not None:
            node = SglExprList([SglRoleBegin(role), to_expr(expr), SglRoleEnd(role)])
            self._submit(node)
            return node

        @contextmanager
        def scope() -> Iterator[None]:
            self._submit(SglRoleBegin(role))
            yield
            self._submit(SglRoleEnd(role))

        return scope()

    def system(self, expr: Any = None) -> Any:
        return self._role_common("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role_common("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role_common("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Everything appended inside the block becomes variable `name`."""
        self._submit(SglVarScopeBegin(name))
        yield
        self._submit(SglVarScopeEnd(name))
