"""Graceful shutdown: on SIGTERM/SIGINT stop admitting, let in-flight requests finish, then end.

The listener stays open while draining, so a new generation request gets a 503 with
Retry-After (a load balancer moves it elsewhere) instead of a refused connection, and `/health`
answers 503 `{"status": "draining"}`. In-flight requests run on for `shutdown_timeout` seconds;
whatever is still running then is failed by the engine loop with `EngineShutdownError`, which
aborts it (its KV is freed) and reaches the client as a final error event and `[DONE]` (a JSON
503 error when not streaming). Only then is uvicorn told to exit, and the process exits 0. A
second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import uvicorn
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from torch_runner.serve.errors import OverCapacityError, error_response

logger = logging.getLogger("torch_runner.serve")

DEFAULT_SHUTDOWN_TIMEOUT = 30.0
POLL_SECONDS = 0.05
FAILED_GRACE_SECONDS = 10.0  # after failing the rest: time for their final events to go out


class Drain:
    """Whether the server is draining, and how many generation requests are in flight."""

    def __init__(self) -> None:
        self.is_draining = False
        self.num_in_flight = 0

    def health(self) -> JSONResponse:
        body = {"status": "draining", "num_in_flight": self.num_in_flight}
        return JSONResponse(body, status_code=503)

    async def run(self, engine: Any, timeout: float) -> None:
        """Stop admitting, wait up to `timeout` s for in-flight requests, then fail the rest."""
        self.is_draining = True
        logger.warning(
            "shutting down: draining %d in-flight request(s) for up to %.1f s",
            self.num_in_flight,
            timeout,
        )
        await self._wait_idle(timeout)
        if self.num_in_flight:
            from torch_runner.async_engine import EngineShutdownError

            logger.warning("ending %d request(s) still running", self.num_in_flight)
            engine.fail_all(
                EngineShutdownError(
                    f"the server is shutting down; this request did not finish within the "
                    f"{timeout:g} s shutdown timeout"
                )
            )
            await self._wait_idle(FAILED_GRACE_SECONDS)
        stats = engine.stats()
        logger.warning(
            "drained: %d request(s) left, KV used %s tokens",
            self.num_in_flight,
            stats.get("kv_used_tokens"),
        )

    async def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(POLL_SECONDS)


class DrainGuard:
    """ASGI middleware: counts generation requests in flight; 503 for new ones while draining."""

    def __init__(self, app: ASGIApp, drain: Drain, paths: tuple[str, ...]):
        self.app = app
        self.drain = drain
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "") not in self.paths:
            await self.app(scope, receive, send)
            return
        if self.drain.is_draining:
            error = OverCapacityError(
                "the server is shutting down and admits no new requests; retry on another replica",
                code="server_draining",
            )
            await error_response(error)(scope, receive, send)
            return
        self.drain.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.num_in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains (see module docstring); the second exits."""

    def __init__(self, config: uvicorn.Config, drain: Drain, engine: Any, timeout: float):
        super().__init__(config)
        self.drain = drain
        self.engine = engine
        self.timeout = timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        # not recorded in _captured_signals: uvicorn would re-raise it after shutdown (exit != 0)
        if self.drain.is_draining or self._loop is None:
            self.should_exit = True
            self.force_exit = self.drain.is_draining
            return
        self.drain.is_draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        async def drain_then_exit() -> None:
            try:
                await self.drain.run(self.engine, self.timeout)
            finally:
                self.should_exit = True

        self._task = asyncio.ensure_future(drain_then_exit())
