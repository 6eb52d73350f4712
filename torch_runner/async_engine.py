"""AsyncEngine: the Engine's step loop on a background thread, for the asyncio server.

Why a thread and not `run_in_executor` per step: the loop must keep stepping while no request
awaits it, and new requests must join the running batch between steps (continuous batching).
All engine state is touched only by the loop thread; callers hand it work through a locked
inbox (adds, aborts) and receive outputs on per-request asyncio queues fed with
`call_soon_threadsafe`. The waiting queue is bounded: past `max_waiting` a new request is
refused at once with `EngineOverCapacityError` instead of queueing without limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from ops.sampling.params import SamplingParams
from torch_runner.engine import Engine

logger = logging.getLogger(__name__)


class EngineOverCapacityError(RuntimeError):
    """The engine's waiting queue is full; retry later (HTTP 503)."""


class _Subscriber:
    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:
        # a closed caller loop raises RuntimeError: nobody is listening any more
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """Runs `engine.step()` in a background thread; `generate` streams a request's outputs."""

    def __init__(self, engine: Engine, max_waiting: int | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting or engine.config.max_waiting
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._inbox: list[tuple[str, Any]] = []
        self._subscribers: dict[str, _Subscriber] = {}
        self._num_pending = 0
        self._thread: threading.Thread | None = None
        self._is_stopping = False
        self._stats: dict[str, Any] = engine.stats()

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._is_stopping = False
        self._thread = threading.Thread(target=self._loop, name="torch_runner-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._is_stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- requests ---------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator:
        """Queue a request and yield its RequestOutputs until it finishes.

        Raises ValueError for a bad request, EngineOverCapacityError when the queue is full.
        Leaving the iterator early (client gone) aborts the request.
        """
        if not self.is_running:
            raise RuntimeError("AsyncEngine is not started; call start() first")
        subscriber = _Subscriber(asyncio.get_running_loop())
        with self._lock:
            waiting = len(self.engine.scheduler.waiting) + self._num_pending
            if waiting >= self.max_waiting:
                raise EngineOverCapacityError(
                    f"over capacity: {waiting} requests are waiting (max_waiting={self.max_waiting}); retry later"
                )
            if request_id in self._subscribers:
                raise ValueError(f"request_id {request_id!r} is already running")
            self._subscribers[request_id] = subscriber
            self._inbox.append(("add", (request_id, list(prompt_token_ids), params)))
            self._num_pending += 1
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                item = await subscriber.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)
            with self._lock:
                if self._subscribers.get(request_id) is subscriber:
                    del self._subscribers[request_id]

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wakeup.set()

    def stats(self) -> dict[str, Any]:
        """Latest engine stats (refreshed by the loop after every step)."""
        return dict(self._stats)

    # ---- the loop thread --------------------------------------------------------------
    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for kind, payload in inbox:
            if kind == "add":
                request_id, prompt, params = payload
                with self._lock:
                    self._num_pending -= 1
                    subscriber = self._subscribers.get(request_id)
                try:
                    self.engine.add_request(request_id, prompt, params)
                except Exception as exc:  # a bad request fails only itself
                    if subscriber is not None:
                        subscriber.put(exc)
            else:
                output = self.engine.abort(payload)
                with self._lock:
                    subscriber = self._subscribers.get(payload)
                if output is not None and subscriber is not None:
                    subscriber.put(output)

    def _loop(self) -> None:
        while not self._is_stopping:
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._stats = self.engine.stats()
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                logger.exception("engine step failed; failing every running request")
                self._fail_all(exc)
                continue
            self._stats = self.engine.stats()
            with self._lock:
                targets = [(self._subscribers.get(o.request_id), o) for o in outputs]
            for subscriber, output in targets:
                if subscriber is not None:
                    subscriber.put(output)
        self._fail_all(RuntimeError("AsyncEngine shut down"))

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        with self._lock:
            subscribers = list(self._subscribers.values())
        for subscriber in subscribers:
            subscriber.put(exc)
