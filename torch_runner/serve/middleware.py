"""ASGI middleware: API key check, request body size limit and per-endpoint request metrics.

Both are plain ASGI (not `BaseHTTPMiddleware`), so streaming bodies and client disconnects pass
through untouched. The body limit checks `Content-Length` up front and also counts chunked bodies
as they arrive, so a client cannot bypass it by omitting the header.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from torch_runner.serve.errors import APIError, PayloadTooLargeError, error_response
from torch_runner.serve.offload import request_bytes


class _BodyTooLarge(HTTPException):
    """An HTTPException, so FastAPI's body parsing re-raises it instead of turning it into a 400."""

    def __init__(self, max_bytes: int):
        super().__init__(413, f"request body exceeds the limit of {max_bytes} bytes")


class BodySizeLimit:
    """Reject request bodies above `max_bytes` with a 413 in OpenAI's error format."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> PayloadTooLargeError:
        return PayloadTooLargeError(
            f"request body exceeds the limit of {self.max_bytes} bytes", code="body_too_large"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await error_response(self._error())(scope, receive, send)
                return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                request_bytes.set(received)  # the worker pool sends large bodies' work aside
                if received > self.max_bytes:
                    raise _BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await error_response(self._error())(scope, receive, send)


class RequestMetrics:
    """Count finished HTTP requests by route path and status code."""

    def __init__(self, app: ASGIApp, observe: Callable[[str, int], None], paths: tuple[str, ...]):
        self.app = app
        self.observe = observe
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path not in self.paths:
            await self.app(scope, receive, send)
            return
        status = 499  # nothing sent: the client went away first

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            self.observe(path, status)


class ApiKeyGuard:
    """401 for `/v1/*` (or the given path prefixes) without the right key, before the body is read."""

    def __init__(
        self,
        app: ASGIApp,
        check: Callable[[str | None], None],
        prefix: str | tuple[str, ...] = "/v1",
    ):
        self.app = app
        self.check = check
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith(self.prefix):
            authorization = None
            for name, value in scope.get("headers", []):
                if name == b"authorization":
                    authorization = value.decode("latin-1")
            try:
                self.check(authorization)
            except APIError as exc:
                await error_response(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)
