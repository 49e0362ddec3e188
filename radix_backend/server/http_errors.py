"""The server's typed errors and their OpenAI-style bodies (status, type, code; 500s logged with an id)."""

from __future__ import annotations

import logging
import uuid

from fastapi.responses import JSONResponse

from ..errors import (ConstraintError, EngineShutdownError, InvalidRequestError, KVCacheTooSmallError,
                     PromptTooLongError, RequestAbortedError)
from .protocol import ErrorInfo, ErrorResponse


logger = logging.getLogger("radix_backend.server")  # the server's logger (the errors it logs are its own)

CLIENT_CLOSED_REQUEST = 499


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this server does not serve."""


class ClientDisconnected(RequestAbortedError):
    """The HTTP client went away before its response was ready (its requests were aborted)."""


def error_json(status: int, message: str, err_type: str = "invalid_request_error", code: str | None = None,
           param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=code or status))
    return JSONResponse(body.model_dump(), status_code=status)


def error_response(exc: BaseException) -> JSONResponse:
    """Map a typed error to an OpenAI-style error body and HTTP status."""
    if isinstance(exc, ModelNotFoundError):
        return error_json(404, str(exc), code="model_not_found", param="model")
    if isinstance(exc, PromptTooLongError):
        return error_json(400, str(exc), code="context_length_exceeded", param="messages")
    if isinstance(exc, KVCacheTooSmallError):
        return error_json(400, str(exc), code="kv_cache_too_small")
    if isinstance(exc, ConstraintError):
        return error_json(400, str(exc), code="invalid_constraint", param="response_format")
    if isinstance(exc, InvalidRequestError):
        return error_json(400, str(exc))
    if isinstance(exc, EngineShutdownError):
        return error_json(503, str(exc), err_type="service_unavailable")
    if isinstance(exc, ClientDisconnected):  # nobody reads it; 499 (nginx's "client closed") counts it apart
        return error_json(CLIENT_CLOSED_REQUEST, str(exc), err_type="request_aborted", code="client_disconnected")
    if isinstance(exc, RequestAbortedError):
        return error_json(503, str(exc), err_type="request_aborted")
    error_id = uuid.uuid4().hex[:12]  # the details go to the log only: exception text can hold paths or data
    logger.error("internal error %s", error_id, exc_info=exc)
    return error_json(500, f"internal error (id {error_id}; the server log has the details)", err_type="internal_error")
