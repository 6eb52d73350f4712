"""AsyncEngine: the Engine's step loop on a background thread, for the asyncio server.

Why a thread and not `run_in_executor` per step: the loop must keep stepping while no request
awaits it, and new requests must join the running batch between steps (continuous batching).
All engine state is touched only by the loop thread; callers hand it work through a locked
inbox (adds, aborts) and receive outputs on per-request asyncio queues fed with
`call_soon_threadsafe`. The waiting queue is bounded: past `max_waiting` a new request is
refused at once with `EngineOverCapacityError` instead of queueing without limit, and `submit`
admits a group of requests (one HTTP request's choices) together or not at all. A step's outputs
reach each event loop in one callback; a consumer that fell behind gets the outputs queued for it
merged into one (`outputs.coalesce`: the latest cumulative state with every delta), as vLLM's
output collector does, so per-output work (an SSE event) does not grow with the lag.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from ops.sampling.params import SamplingParams
from torch_runner.distributed.group import RankFailure
from torch_runner.engine import Engine
from torch_runner.outputs import coalesce

logger = logging.getLogger(__name__)


class EngineOverCapacityError(RuntimeError):
    """The engine's waiting queue is full; retry later (HTTP 503)."""


class EngineShutdownError(RuntimeError):
    """The engine is shutting down and ended this request (HTTP 503 / a final error event)."""


class QueueTooSmallError(ValueError):
    """More requests at once than the waiting queue can ever hold (HTTP 400, never 503)."""

    param = "n"


class _Subscriber:
    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:
        # a closed caller loop raises RuntimeError: nobody is listening any more
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def deliver(targets) -> None:
    """Hand a step's outputs to their subscribers: one `call_soon_threadsafe` per event loop
    (each wakes the loop through its self-pipe and takes the GIL from the engine thread), not
    one per request; the loop then fills the queues in step order."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for subscriber, output in targets:
        if subscriber is not None:
            by_loop.setdefault(subscriber.loop, []).append((subscriber.queue, output))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)


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
        self._stats: dict[str, Any] = {}
        self._refresh_stats()
        self.fatal_error: RankFailure | None = None  # set when a tensor-parallel rank failed
        self.on_fatal: Callable[[RankFailure], None] | None = None  # the server exits on it

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
        (stream,) = self.submit([(request_id, prompt_token_ids, params)])
        async with contextlib.aclosing(stream) as outputs:
            async for item in outputs:
                yield item

    def submit(self, requests: list[tuple[str, list[int], SamplingParams]]) -> list[AsyncIterator]:
        """Queue several requests together, or none of them; one output stream per request.

        One HTTP request's choices go through here at once, so a fan-out is never half
        admitted. Raises QueueTooSmallError (a ValueError: waiting can never help) when there
        are more requests than the queue holds, EngineOverCapacityError (retry later) when
        they do not fit now. Each stream must be iterated or `abort`ed (abort also drops it).
        """
        if not self.is_running:
            raise EngineShutdownError("the engine loop is not running")
        if len(requests) > self.max_waiting:
            raise QueueTooSmallError(
                f"{len(requests)} choices (prompts x n) can never fit in the waiting queue of "
                f"{self.max_waiting} (max_waiting); send fewer prompts or a smaller n"
            )
        loop = asyncio.get_running_loop()
        streams = []
        with self._lock:
            waiting = len(self.engine.scheduler.waiting) + self._num_pending
            if waiting + len(requests) > self.max_waiting:
                raise EngineOverCapacityError(
                    f"over capacity: {waiting} requests are waiting and {len(requests)} more do "
                    f"not fit (max_waiting={self.max_waiting}); retry later"
                )
            ids = [request_id for request_id, _, _ in requests]
            taken = [rid for i, rid in enumerate(ids) if rid in self._subscribers or rid in ids[:i]]
            if taken:
                raise ValueError(f"request_id {taken[0]!r} is already running")
            for request_id, prompt_token_ids, params in requests:
                subscriber = _Subscriber(loop)
                self._subscribers[request_id] = subscriber
                self._inbox.append(("add", (request_id, list(prompt_token_ids), params)))
                self._num_pending += 1
                streams.append(self._outputs(request_id, subscriber))
        self._wakeup.set()
        return streams

    async def _outputs(self, request_id: str, subscriber: _Subscriber) -> AsyncIterator:
        finished = False
        try:
            while not finished:
                item = await subscriber.queue.get()
                if isinstance(item, BaseException):
                    raise item
                # behind the engine (outputs of several steps queued): one merged output, so a
                # slow consumer does per-output work (SSE events) once, not once per step
                error = None
                while not item.finished and not subscriber.queue.empty():
                    later = subscriber.queue.get_nowait()
                    if isinstance(later, BaseException):
                        error = later
                        break
                    item = coalesce(item, later)
                finished = item.finished
                yield item
                if error is not None:
                    raise error
        finally:
            if not finished:
                self.abort(request_id)
            with self._lock:
                if self._subscribers.get(request_id) is subscriber:
                    del self._subscribers[request_id]

    def abort(self, request_id: str) -> None:
        """End a request (queued or running) and drop its stream; its KV is freed by the loop."""
        with self._lock:
            self._inbox.append(("abort", request_id))
            self._subscribers.pop(request_id, None)  # a stream never iterated leaks nothing
        self._wakeup.set()

    def fail_all(self, exc: BaseException) -> None:
        """End every queued and running request with `exc` (on the loop thread: frees their KV)."""
        with self._lock:
            self._inbox.append(("fail", exc))
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
            elif kind == "fail":
                self._fail_all(payload)
            else:
                self.engine.abort(payload)  # its stream was dropped by abort(): nobody listens

    def _loop(self) -> None:
        while not self._is_stopping:
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._refresh_stats()
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except RankFailure as exc:  # a dead or hung rank: no later step can succeed
                logger.critical("tensor parallel failure; stopping the engine: %s", exc)
                self.fatal_error = exc
                self._fail_all(exc)
                if self.on_fatal is not None:
                    self.on_fatal(exc)
                return
            except Exception as exc:
                logger.exception("engine step failed; failing every running request")
                self._fail_all(exc)
                continue
            self._refresh_stats()
            with self._lock:
                targets = [(self._subscribers.get(o.request_id), o) for o in outputs]
            deliver(targets)
        self._fail_all(EngineShutdownError("AsyncEngine shut down"))

    def _refresh_stats(self) -> None:
        """Engine stats for scrapers (the prefix cache keeps its evictable count: O(1))."""
        stats = self.engine.stats()
        cached = min(self.engine.kv_cached_tokens(), stats["kv_used_tokens"])
        stats["kv_cached_tokens"] = cached
        stats["kv_used_tokens"] -= cached  # held by requests; evictable cache blocks apart
        stats["kv_usage"] = stats["kv_used_tokens"] / max(1, stats["kv_total_tokens"])
        self._stats = stats

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        self._refresh_stats()
        with self._lock:
            subscribers = list(self._subscribers.values())
        for subscriber in subscribers:
            subscriber.put(exc)
