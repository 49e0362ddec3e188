"""The HTTP server: OpenAI-compatible and SGLang-native routes over an Engine (or a data-parallel Router).

- `app`: the FastAPI app, `serve`, the `serve` CLI flags
- `openai_api`, `native_api`: the two route families
- `common`: what both share (server state, jobs, streaming, error mapping)
- `protocol`: request/response models; `metrics`: Prometheus metrics
- `guard`: API key and request-size limits (ASGI middleware)
- `router`: data-parallel engine replicas behind a cache-aware router
"""

from .app import (ClientDisconnected, ModelNotFoundError, ServerLimits, ServerThread, add_serve_args,
                  build_engine, create_app, error_response, main, run_serve, serve)

__all__ = ["ClientDisconnected", "ModelNotFoundError", "ServerLimits", "ServerThread", "add_serve_args",
           "build_engine", "create_app", "error_response", "main", "run_serve", "serve"]
