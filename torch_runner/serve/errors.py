"""OpenAI-style errors: every failure leaves the server as `{"error": {message, type, param, code}}`.

Bad input must never surface as a 500, so every path that can reject a request raises `APIError`
(or a `ValueError` carrying `.param`, which `SamplingParams` raises) and the handlers here turn it
into the right status. FastAPI's 422 for schema violations becomes a 400 naming the field.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("torch_runner.serve")

RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """An error that reaches the client with `status` and OpenAI's error body."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def headers(self) -> dict[str, str] | None:
        return None

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequestError(APIError):
    status = 400


class AuthenticationError(APIError):
    status = 401
    type = "authentication_error"


class NotFoundError(APIError):
    status = 404
    type = "not_found_error"


class PayloadTooLargeError(APIError):
    status = 413


class OverCapacityError(APIError):
    """The engine's bounded waiting queue is full: retry later (503 + Retry-After)."""

    status = 503
    type = "server_overloaded"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_SECONDS)}


class EngineStoppedError(APIError):
    status = 503
    type = "service_unavailable"


class InternalError(APIError):
    status = 500
    type = "internal_server_error"


class ModelOutputError(InternalError):
    """The model failed a request (non-finite logits): that request ends, the server goes on."""


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


def param_error(exc: ValueError, param_names: dict[str, str] | None = None) -> InvalidRequestError:
    """Wrap a `ValueError` (e.g. from `SamplingParams`) as a 400, mapping its `.param` to the API name."""
    param = getattr(exc, "param", None)
    if param is not None and param_names:
        param = param_names.get(param, param)
    return InvalidRequestError(str(exc), param=param)


def _validation_param(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages.0.role'; union branch tags (type names such as
    'str' or a model class 'TextContentPart'; API field names are lower snake case) are dropped."""
    parts = [str(p) for p in loc[1:] if not (isinstance(p, str) and _is_union_tag(p))]
    return ".".join(parts) or None


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


def _is_union_tag(part: str) -> bool:
    return "[" in part or part in _UNION_TAGS or part[:1].isupper()


def _most_specific(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """Our own checks (value_error: e.g. a lone surrogate) first, else the deepest location:
    a union reports every branch, and the branch that got furthest is the one the client meant
    (`[[false, true]]` as prompt: 'prompt.0.0 should be an integer', not 'should be a string')."""
    own = [e for e in errors if e.get("type") == "value_error"]
    return own[0] if own else max(errors, key=lambda e: len(e.get("loc", ())))


def validation_error(exc: RequestValidationError) -> InvalidRequestError:
    """The first pydantic error, as OpenAI phrases it, naming the field."""
    errors = exc.errors()
    if not errors:
        return InvalidRequestError("invalid request body")
    first = _most_specific(errors)
    loc = tuple(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "json_invalid":
        return InvalidRequestError(
            f"request body is not valid JSON: {first.get('msg', '')}", code="invalid_json"
        )
    if loc == ("body",) or not loc:
        return InvalidRequestError(f"request body must be a JSON object: {first.get('msg', '')}")
    param = _validation_param(loc)
    if kind == "extra_forbidden":
        return InvalidRequestError(f"Unrecognized request argument supplied: {param}", param=param)
    if kind == "missing":
        return InvalidRequestError(f"'{param}' is a required property", param=param)
    return InvalidRequestError(f"{param}: {first.get('msg', 'invalid value')}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception type to OpenAI's error JSON."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(str(exc.detail))
        error.status = exc.status_code
        error.type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(error)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(InternalError(f"internal error: {type(exc).__name__}: {exc}"))
