"""The engine seam: Engine and the data-parallel Router offer every call of the protocols the DSL
backend, the adapters and the server are typed against, with the same parameter names."""

from __future__ import annotations

import inspect

import pytest

from radix_backend import Engine
from radix_backend.engine_like import EngineLike, LogitsEngine


def _members(protocol: type) -> list[str]:
    return [name for name in vars(protocol) if not name.startswith("_")]


@pytest.mark.parametrize("protocol", [EngineLike, LogitsEngine])
def test_engine_implements_the_protocols_with_their_parameters(protocol):
    _check(Engine, protocol)


def test_router_implements_engine_like():
    from radix_backend.server.router import Router

    _check(Router, EngineLike)


def _check(cls: type, protocol: type) -> None:
    for name in _members(protocol):
        assert hasattr(cls, name), f"{cls.__name__} lacks {protocol.__name__}.{name}"
        want = getattr(protocol, name)
        if isinstance(want, property):
            continue
        have_params = list(inspect.signature(getattr(cls, name)).parameters)
        want_params = list(inspect.signature(want).parameters)
        assert have_params[:len(want_params)] == want_params, f"{cls.__name__}.{name}{have_params} vs {want_params}"


def test_a_live_engine_is_an_engine_like(tiny_llama_dir):
    with Engine(str(tiny_llama_dir), kv_cache_tokens=256) as engine:
        assert isinstance(engine, EngineLike) and isinstance(engine, LogitsEngine)
        from radix_backend.adapters._common import resolve_engine

        assert resolve_engine(engine, None) is engine
