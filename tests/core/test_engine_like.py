"""The engine seam: Engine and the data-parallel Router offer every call of the protocols the DSL
backend, the adapters and the server are typed against, with the same parameter names."""

from __future__ import annotations

import pytest

from radix_backend import Engine
from radix_backend.engine_like import EngineLike, LogitsEngine

from fakes import CharEngine, ScriptedEngine, TransformersLogitsEngine, assert_implements


@pytest.mark.parametrize("protocol", [EngineLike, LogitsEngine])
def test_engine_implements_the_protocols_with_their_parameters(protocol):
    assert_implements(Engine, protocol)


def test_router_implements_engine_like():
    from radix_backend.server.router import Router

    assert_implements(Router, EngineLike)


@pytest.mark.parametrize("fake", [ScriptedEngine, CharEngine])
def test_the_test_doubles_implement_the_seam(fake):
    assert_implements(fake, EngineLike)
    assert isinstance(fake(), EngineLike)


def test_the_logits_double_implements_its_seam():
    assert_implements(TransformersLogitsEngine, LogitsEngine)


def test_a_live_engine_is_an_engine_like(tiny_llama_dir):
    with Engine(str(tiny_llama_dir), kv_cache_tokens=256) as engine:
        assert isinstance(engine, EngineLike) and isinstance(engine, LogitsEngine)
        from radix_backend.adapters._common import resolve_engine

        assert resolve_engine(engine, None) is engine
