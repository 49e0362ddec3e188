"""The OpenAI SDK in process: `openai_client()` is an `openai.OpenAI` whose requests never leave the process.

The client's HTTP transport calls the app of `radix-backend serve` directly (no socket, no server
process), so every program written against the OpenAI SDK, and every library that takes an OpenAI
client (instructor, for one), runs on the process-shared engine and its radix cache with the
server's full surface: chat and text completions, tools and `tool_choice`, `response_format`
JSON schemas, streaming, logprobs, usage with cached tokens. `async_openai_client()` is the
`openai.AsyncOpenAI` twin.

    import instructor
    client = instructor.from_openai(openai_client())
    model = client.client.models.list().data[0].id   # the name requests must use
"""

from __future__ import annotations

import weakref
from typing import Any

import httpx
import openai
from starlette.testclient import TestClient

from ..engine_like import EngineLike
from .app import create_app

__all__ = ["openai_client", "async_openai_client"]

BASE_URL = "http://localhost"  # loopback: what the server's access guard answers without a key


def _app(engine: EngineLike | None, model: str | None) -> Any:
    if engine is None:
        from ..engine import get_engine

        engine = get_engine(model)
    return create_app(engine)


def openai_client(engine: EngineLike | None = None, *, model: str | None = None, **client_kwargs: Any) -> openai.OpenAI:
    """An `openai.OpenAI` on the engine (the process-shared one unless given). Requests name the
    served model, as the server checks: `client.models.list().data[0].id`."""
    app = _app(engine, model)
    transport = TestClient(app, base_url=BASE_URL, raise_server_exceptions=False)
    # one event-loop thread for the client's life: without it every request starts its own
    # (measured ~1 ms of a 10-11 ms one-token chat call); the app has no lifespan to run
    transport.__enter__()
    client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="in-process", http_client=transport, **client_kwargs)
    weakref.finalize(client, transport.__exit__, None, None, None)
    return client


def async_openai_client(engine: EngineLike | None = None, *, model: str | None = None,
                        **client_kwargs: Any) -> openai.AsyncOpenAI:
    """The `openai.AsyncOpenAI` twin of `openai_client` (the app runs on the caller's event loop)."""
    app = _app(engine, model)
    transport = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE_URL)
    return openai.AsyncOpenAI(base_url=f"{BASE_URL}/v1", api_key="in-process", http_client=transport,
                              **client_kwargs)

