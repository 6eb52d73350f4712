"""Server-sent events: `data: <json>` chunks, an optional usage chunk, then `data: [DONE]`.

The first increment is awaited before the HTTP status is sent, so admission failures (over
capacity, invalid parameters the engine rejects) are real 4xx/5xx responses rather than errors
buried in a 200 stream. A failure after that point is sent as an OpenAI error event.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from torch_runner.serve.errors import APIError, InternalError
from torch_runner.serve.generation import (
    Choice,
    ClientDisconnected,
    Increment,
    merge_choices,
    until_disconnect,
    usage_of,
)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_EVENT = "data: [DONE]\n\n"


def event(payload: Any) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


async def stream_choices(
    http: Request,
    engine: Any,
    choices: list[Choice],
    *,
    opening: Callable[[], Iterable[Any]],
    render: Callable[[Increment], Iterable[Any]],
    usage_chunk: Callable[[Any], Any] | None,
    on_close: Callable[[], None],
) -> Response:
    """Start the choices, wait for the first increment, then stream the rest as SSE."""
    increments = merge_choices(engine, choices)
    try:
        first = await until_disconnect(http, increments.__anext__())
    except StopAsyncIteration:
        first = None
    except ClientDisconnected:  # gone while its request waited for a first token: nobody to answer
        await increments.aclose()
        on_close()
        return Response(status_code=499)
    except BaseException:
        await increments.aclose()
        on_close()
        raise

    async def body() -> AsyncIterator[str]:
        try:
            async with contextlib.aclosing(increments) as stream:
                for payload in opening():
                    yield event(payload)
                if first is not None:
                    for payload in render(first):
                        yield event(payload)
                    async for increment in stream:
                        for payload in render(increment):
                            yield event(payload)
            if usage_chunk is not None:
                yield event(usage_chunk(usage_of(choices)))
        except APIError as exc:
            yield event(exc.body())
        except Exception as exc:  # the status is already sent: report in-band, never hang
            yield event(InternalError(f"internal error: {type(exc).__name__}: {exc}").body())
        finally:
            on_close()
        yield DONE_EVENT

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)
