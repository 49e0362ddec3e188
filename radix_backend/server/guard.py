"""What stands between the network and the handlers: the API key, the host check, the body rules.

Follows vLLM's and SGLang's conventions: with an API key set (`--api-key` or the environment
variable RADIX_BACKEND_API_KEY), every route except `/health` needs `Authorization: Bearer KEY`;
a wrong or missing key is a 401 in OpenAI's error shape. Without a key a loopback server answers
only requests whose Host (and Origin, when a browser sends one) names a loopback address: a web
page cannot reach it through DNS rebinding or a cross-site form post (403). A body over
`max_body_bytes` is a 413 before any handler parses it, and a POST body must be JSON (415): a
browser cannot send that cross-site without a CORS preflight, which the server never grants.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

API_KEY_ENV = "RADIX_BACKEND_API_KEY"
OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without credentials


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits of the HTTP server (flags of `radix-backend serve`)."""

    max_body_bytes: int = 4 << 20  # a request body larger than this is a 413
    max_n: int = 64  # samples per prompt (OpenAI's n, SGLang's sampling_params.n)
    max_n_tokens: int = 262_144  # n * max_tokens over all prompts of one request
    body_timeout_s: float = 30.0  # a request body must arrive whole within this (slow senders: 408)
    max_connections: int = 1024  # open connections and in-flight requests at once; more are a 503

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_n", "max_n_tokens", "max_connections"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not isinstance(self.body_timeout_s, (int, float)) or not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be a positive number, got {self.body_timeout_s!r}")


def resolve_api_key(api_key: str | None) -> str | None:
    """The key given, else the environment's; empty means none."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    return key or None


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The host of a Host header or an Origin URL, without port or IPv6 brackets, lower case."""
    netloc = urlsplit(value).netloc if "://" in value else value
    host = netloc.rsplit("@", 1)[-1]
    if host.startswith("["):
        return host[1:host.find("]")].lower() if "]" in host else host.lower()
    return host.split(":", 1)[0].lower()


def _error_body(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()


async def _send_error(send: Any, status: int, message: str, code: str, headers: list | None = None) -> None:
    body = _error_body(message, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class AccessGuard:
    """Pure ASGI middleware: checks the API key, then reads the body up to the size limit (by its
    Content-Length when sent, else while receiving) and replays it to the app."""

    def __init__(self, app: Any, api_key: str | None, limits: ServerLimits, any_host: bool = False) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.limits = limits
        self.check_host = self.api_key is None and not any_host  # any_host: bound beyond loopback on purpose

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope.get("path") not in OPEN_PATHS and not self._authorized(headers):
            await _send_error(send, 401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                              "invalid_api_key", [(b"www-authenticate", b"Bearer")])
            return
        if self.check_host and not self._local(headers):
            await _send_error(send, 403, "this server answers loopback hosts only (set an API key to serve others)",
                              "host_not_allowed")
            return
        limit = self.limits.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _send_error(send, 413, f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes",
                              "request_too_large")
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.limits.body_timeout_s
        while True:
            try:  # a client trickling its body (slowloris) must not hold a connection for ever
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                await _send_error(send, 408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                                  "request_timeout")
                return
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await _send_error(send, 413, f"request body exceeds the limit of {limit} bytes", "request_too_large")
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        content_type = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if body and content_type != b"application/json":
            await _send_error(send, 415, "a request body must be JSON (Content-Type: application/json)",
                              "unsupported_media_type")
            return
        await self.app(scope, _replay(body, receive), send)

    @staticmethod
    def _local(headers: dict[bytes, bytes]) -> bool:
        """Host names a loopback address, and so does Origin when present."""
        def loopback(value: bytes) -> bool:
            return is_loopback(host_name(value.decode("latin-1")))

        host, origin = headers.get(b"host"), headers.get(b"origin")
        return host is not None and loopback(host) and (origin is None or loopback(origin))

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        given = headers.get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)


def _replay(body: bytes, receive: Any) -> Any:
    """A receive() that hands the app the buffered body once, then waits on the real channel
    (so the app still hears a client's disconnect)."""
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
