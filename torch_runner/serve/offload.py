"""The worker pool: everything heavy a request needs runs here, never on the event loop.

Tokenizing a 7 MB prompt takes seconds, and on the loop it would stall every stream and
`/health` for that long. So a large body's JSON is decoded in the pool (OffloadedJsonRoute), and
each handler awaits `state.offload(fn, ...)` for tokenization, chat templating, building
prompts x n choices (grammar compilation included: it walks the whole vocabulary for a new
schema) and building large final responses (logprob tables, JSON). The loop only validates the
decoded body, awaits, and forwards stream increments. Measured: tools/bench_health.py.

Threads, not processes: the tokenizers library releases the GIL while it encodes (measured: a
5.5 s encode of 7 MB stalled a 1 ms ticker by 45 ms at most), jinja templates are milliseconds,
and the tokenizer object need not be pickled. The tokenizer is shared by these threads and the
engine thread; that is safe because nothing changes its truncation/padding settings after load.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.routing import APIRoute

T = TypeVar("T")

NUM_LIGHT_WORKERS = 4
NUM_HEAVY_WORKERS = max(1, min(4, (os.cpu_count() or 2) // 2))  # leave cores to loop and engine
HEAVY_BODY_BYTES = 64 * 1024  # a body this large may tokenize for 50+ ms on a slow core
# bytes of the current request's body, set by the BodySizeLimit middleware as it reads it
request_bytes: ContextVar[int] = ContextVar("request_bytes", default=0)


class WorkerPool:
    """Two small thread pools the handlers await; `close()` at server shutdown.

    Work for a large body goes to the heavy pool, the rest to the light one, so a few 7 MB
    bodies being tokenized never queue a small request's tokenization behind them.
    """

    def __init__(self) -> None:
        self._light = ThreadPoolExecutor(NUM_LIGHT_WORKERS, thread_name_prefix="serve-light")
        # not niced: measured, a niced worker kept /health p99 at 78 ms but took 6x longer on
        # a shared box (docs/performance-log.md)
        self._heavy = ThreadPoolExecutor(NUM_HEAVY_WORKERS, thread_name_prefix="serve-heavy")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        executor = self._heavy if request_bytes.get() > HEAVY_BODY_BYTES else self._light
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        for executor in (self._light, self._heavy):
            executor.shutdown(wait=False, cancel_futures=True)


class OffloadedJsonRequest(Request):
    """A Request whose JSON body is decoded in the heavy pool when it is large (json.loads of
    7 MB holds the loop for ~100 ms); same result and same exceptions as Starlette's."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > HEAVY_BODY_BYTES:
                self._json = await self.app.state.serving.pool.run(json.loads, body)
            else:
                self._json = json.loads(body)
        return self._json


class OffloadedJsonRoute(APIRoute):
    """The app's route class (`app.router.route_class`): hands handlers OffloadedJsonRequest."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(OffloadedJsonRequest(request.scope, request.receive))

        return route


def warm_grammar(tokenizer: Any, vocab_size: int, structured: Any) -> None:
    """Compile a request's grammar into the shared LRU now (in the pool), so the engine thread's
    `new_request_grammar` is a cache hit and never stalls the running batch on a compile."""
    if structured is None:
        return
    from torch_runner.grammar.compiler import compiler_for  # imports xgrammar

    # a spec xgrammar rejects fails again in the engine's add_request, which maps it to a 400
    with contextlib.suppress(ValueError):
        compiler_for(tokenizer, vocab_size).compile(structured.kind, structured.spec)


def json_response(payload: Any) -> Response:
    """A pydantic response as a JSONResponse (dump + encode: the costly part of a big answer)."""
    from fastapi.responses import JSONResponse

    return JSONResponse(payload.model_dump())
