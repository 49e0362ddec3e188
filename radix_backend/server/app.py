"""OpenAI-compatible and SGLang-native HTTP server over one Engine (or a data-parallel router).

`create_app(engine)` builds a FastAPI app; `serve(...)` runs it with uvicorn; `ServerThread` runs
it in a background thread (tests, notebooks, the load benchmark). Every handler is async and
talks to the engine through `agenerate` / `astream`, so requests from all HTTP clients land in
the engine's one scheduler loop and share its radix cache.

A client that goes away aborts its requests: streams close the engine's async generator, and
non-streaming calls are cancelled when the connection drops (`_cancel_on_disconnect`).

This module assembles the app (info endpoints, error handlers, metrics) and runs it; the routes
live in `openai_api` (/v1/completions, /v1/chat/completions) and `native_api` (/generate),
what they share in `common`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from typing import Any

from ..config import add_cli_args, from_cli_args
from ..engine_like import EngineLike
from ..errors import InvalidRequestError, MissingDependencyError, RadixBackendError
from ..sampling_params import SamplingParams

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as exc:  # pragma: no cover - the server extra installs them
    raise MissingDependencyError.for_extra("fastapi and uvicorn", "server") from exc

from .http_errors import ClientDisconnected, error_json, error_response, ModelNotFoundError
from .state import ServerState
from .guard import API_KEY_ENV, AccessGuard, ServerLimits, is_loopback, resolve_api_key
from .metrics import ServerMetrics
from .native_api import add_native_routes
from .openai_api import add_openai_routes
from .protocol import ErrorResponse, ModelCard, ModelList
from .launcher import GATEWAY_POLICIES
from .router import POLICIES as ROUTER_POLICIES

__all__ = ["ClientDisconnected", "ModelNotFoundError", "ServerThread", "add_serve_args",
           "ServerLimits", "build_engine", "create_app", "error_response", "main", "run_serve", "serve"]


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        if err.get("type") == "json_invalid":
            return f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


# ============================================================================ metrics middleware


class _MetricsMiddleware:
    """Pure ASGI middleware (unlike BaseHTTPMiddleware it leaves streaming and disconnects alone)."""

    def __init__(self, app: Any, metrics: ServerMetrics, endpoints: set[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in self.endpoints else "other"
        status = {"code": 500}

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.count_request(endpoint, status["code"])


# ============================================================================ the app


def create_app(engine: EngineLike, *, served_model_name: str | None = None, model_path: str | None = None,
               incremental_streaming_output: bool = False, api_key: str | None = None,
               limits: ServerLimits | None = None, any_host: bool = False) -> FastAPI:
    """The FastAPI app serving `engine` (an Engine, or anything with its API such as the
    data-parallel `Router`). The engine is not shut down by the app; `serve()` does that.
    `model_path` is the name clients see (default: the model as the engine was given it).
    `api_key` (else $RADIX_BACKEND_API_KEY) guards every route but /health; `limits` bound sizes;
    without a key only loopback Host/Origin headers are answered unless `any_host` (a server bound
    beyond loopback on purpose)."""
    state = ServerState(engine, served_model_name, model_path, incremental_streaming_output, limits)
    app = FastAPI(title="radix-backend", version="0.1.0")
    app.state.server = state
    endpoints = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/generate", "/health", "/metrics",
                 "/get_model_info", "/model_info", "/get_server_info", "/server_info", "/health_generate",
                 "/flush_cache"}
    app.add_middleware(AccessGuard, api_key=resolve_api_key(api_key), limits=state.limits, any_host=any_host)
    app.add_middleware(_MetricsMiddleware, metrics=state.metrics, endpoints=endpoints)  # outermost: counts 401/413

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_json(400, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_json(exc.status_code, str(exc.detail), code=str(exc.status_code))

    @app.exception_handler(RadixBackendError)
    async def _on_error(_: Request, exc: RadixBackendError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _on_bug(_: Request, exc: Exception) -> JSONResponse:  # logged and re-raised by Starlette
        return error_response(exc)

    # ------------------------------------------------------------------ info endpoints

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.is_shutdown:
            return error_json(503, "engine is shut down", err_type="service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.model_name, root=state.model_path,
                                         max_model_len=engine.context_length)])

    @app.get("/health_generate")
    async def health_generate() -> JSONResponse:
        """SGLang's deep health check: one real one-token generation through the scheduler."""
        if engine.is_shutdown:
            return error_json(503, "engine is shut down", err_type="service_unavailable")
        await engine.agenerate(input_ids=[0], params=SamplingParams(max_new_tokens=1, temperature=0))
        return JSONResponse({"status": "ok"})

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
                "served_model_name": state.model_name, "max_context_length": engine.context_length,
                **state.chat_template_info()}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        stats = engine.cache_stats()
        return {"model_path": state.model_path, "served_model_name": state.model_name,
                "context_length": engine.context_length, "dp_size": engine.dp_size,
                "max_total_tokens": stats.slots_total,
                "cache_stats": {k: v for k, v in vars(stats).items()}, **state.metrics.snapshot()}

    @app.post("/flush_cache", response_class=PlainTextResponse,  # SGLang answers in plain text
              responses={400: {"description": "requests are running", "content": {"text/plain": {}}}})
    # changes state: POST only (a GET must be safe to prefetch or crawl)
    async def flush_cache() -> PlainTextResponse:
        ok = await asyncio.to_thread(engine.flush_cache)
        if ok:
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are running; retry when idle.\n", status_code=400)

    @app.post("/concate_and_append_request")
    async def concate_and_append() -> JSONResponse:
        """Old SGLang clients call this for fork join(mode="concate_and_append"); fail fast, not 404."""
        return error_json(400, "/concate_and_append_request is not supported: KV concatenation across requests "
                          "does not exist here; join(mode='concate_and_append') works client-side by resending "
                          "the text (the radix cache reuses its prefix)", code="unsupported")

    @app.get("/metrics", response_class=PlainTextResponse)  # Prometheus text exposition
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    # ------------------------------------------------------------------ generation endpoints

    add_openai_routes(app, state)
    add_native_routes(app, state)
    _document_errors(app)
    return app


def _document_errors(app: FastAPI) -> None:
    """Make /openapi.json say what the server answers: validation errors are 400 (OpenAI's status,
    not FastAPI's 422) and every other error status has OpenAI's error body (`default`)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = build()
        error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(error.pop("$defs", {}))
        components["ErrorResponse"] = error
        body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        for path_item in schema.get("paths", {}).values():
            for operation in path_item.values():
                responses = operation.setdefault("responses", {})
                if responses.pop("422", None) is not None or operation.get("requestBody"):
                    responses.setdefault("400", {"description": "Invalid request", "content": body})
                responses.setdefault("default", {"description": "Error (OpenAI's error body)", "content": body})
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


# ============================================================================ running it


class ServerThread:
    """Runs an app with uvicorn in a daemon thread on 127.0.0.1 (port 0 picks a free port).

    Usage: `with ServerThread(create_app(engine)) as srv: OpenAI(base_url=srv.url + "/v1")`.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self.host = host
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, loop="asyncio", lifespan="off",
                                timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="radix-backend-server", daemon=True)
        self.port = port

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def warn_unprotected(host: str) -> None:
    print(f"WARNING: serving on {host}, reachable from other machines, without an API key: anyone who can reach "
          f"the port can run the model and flush its cache. Set --api-key or ${API_KEY_ENV}.", file=sys.stderr,
          flush=True)


def build_engine(model: str | None = None, *, dp_size: int = 1, router_policy: str = "cache_aware",
                 **engine_kwargs: Any) -> EngineLike:
    """One Engine, or `dp_size` Engines behind a cache-aware data-parallel router."""
    if dp_size < 1:
        raise InvalidRequestError(f"dp_size must be >= 1, got {dp_size}")
    if dp_size == 1:
        from ..engine import Engine

        return Engine(model, **engine_kwargs)
    from .router import Router

    return Router.from_model(model, dp_size=dp_size, policy=router_policy, **engine_kwargs)


def serve(model: str | None = None, *, host: str = "127.0.0.1", port: int = 30000, dp_size: int = 1,
          router_policy: str = "cache_aware", served_model_name: str | None = None, log_level: str = "info",
          incremental_streaming_output: bool = False, api_key: str | None = None,
          limits: ServerLimits | None = None, **engine_kwargs: Any) -> None:
    """Load the model (dp_size replicas), serve it until interrupted, then shut the engines down."""
    if resolve_api_key(api_key) is None and not is_loopback(host):
        warn_unprotected(host)
    engine = build_engine(model, dp_size=dp_size, router_policy=router_policy, **engine_kwargs)
    try:
        app = create_app(engine, served_model_name=served_model_name, model_path=model,
                         incremental_streaming_output=incremental_streaming_output, api_key=api_key, limits=limits,
                         any_host=not is_loopback(host))
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30,
                    limit_concurrency=(limits or ServerLimits()).max_connections)
    finally:
        engine.shutdown()


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of `radix-backend serve` (the CLI wires `run_serve` to them); the engine's come
    from EngineConfig's fields."""
    parser.add_argument("--model", default=None, help="HF checkpoint dir or .gguf file (default: embedded SmolLM2-135M)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dp-size", type=int, default=1,
                        help="data-parallel replicas, each with its own engine and radix cache, behind a cache-aware router")
    parser.add_argument("--dp-mode", choices=("process", "inprocess"), default="process",
                        help="process: one worker process per replica behind SGLang's model gateway (extra [scale]); "
                             "inprocess: replicas in this process behind radix-backend's own router")
    parser.add_argument("--router-policy", choices=sorted(set(ROUTER_POLICIES) | set(GATEWAY_POLICIES)),
                        default="cache_aware", help="routing policy (inprocess: " + ", ".join(ROUTER_POLICIES) + ")")
    parser.add_argument("--gateway-arg", action="append", default=[],
                        help="with --dp-mode process: one more argument for the gateway, as is (repeatable)")
    parser.add_argument("--served-model-name", default=None, help="model id reported by /v1/models")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--incremental-streaming-output", action="store_true",
                        help="stream only new text/ids/logprobs per /generate event (SGLang's flag; default cumulative)")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV})")
    defaults = ServerLimits()
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes,
                        help="larger request bodies are answered 413")
    parser.add_argument("--max-n", type=int, default=defaults.max_n, help="most samples per prompt (n)")
    parser.add_argument("--max-n-tokens", type=int, default=defaults.max_n_tokens,
                        help="most new tokens one request may ask for (n x max_tokens over its prompts)")
    parser.add_argument("--body-timeout", type=float, default=defaults.body_timeout_s,
                        help="seconds a request body may take to arrive (slower senders get a 408)")
    parser.add_argument("--max-connections", type=int, default=defaults.max_connections,
                        help="open connections and requests at once (more are answered 503)")
    add_cli_args(parser.add_argument_group("engine"))
    return parser


def run_serve(args: argparse.Namespace) -> None:
    if args.dp_size > 1 and args.dp_mode == "process":
        from .launcher import local_fleet, run_fleet

        if resolve_api_key(args.api_key) is None and not is_loopback(args.host):
            warn_unprotected(args.host)  # the gateway is what listens on --host

        raise SystemExit(run_fleet(local_fleet(args, add_serve_args(argparse.ArgumentParser()))))
    if args.router_policy not in ROUTER_POLICIES:
        raise SystemExit(f"--router-policy {args.router_policy} needs --dp-mode process (in-process router: "
                         f"{', '.join(ROUTER_POLICIES)})")
    serve(args.model, host=args.host, port=args.port, dp_size=args.dp_size, router_policy=args.router_policy,
          served_model_name=args.served_model_name, log_level=args.log_level,
          incremental_streaming_output=args.incremental_streaming_output, api_key=args.api_key,
          limits=ServerLimits(args.max_body_bytes, args.max_n, args.max_n_tokens, args.body_timeout,
                              args.max_connections), config=from_cli_args(args))


def main(argv: list[str] | None = None) -> None:
    """`python -m radix_backend.server --model ...` (same flags as `radix-backend serve`)."""
    run_serve(add_serve_args(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv))
