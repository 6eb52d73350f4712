"""One greedy request the server sends itself before it accepts connections, as SGLang's
start-up warm-up does (`--skip-server-warmup` turns it off).

Why: the first request otherwise pays the first use of everything on the request path: the
chat template's Jinja compile (~20 ms on the 2-core dev box), the route and response models,
the SSE writer, the incremental detokenizer and the engine step's Python paths. On an H200 the
first streamed request's time to first token was 84-115 ms against ~40 ms for the next ones
(tools/bench_serving.py at concurrency 1, 2026-12-03). The request goes through the app in
process (httpx's ASGITransport, no socket), greedy (temperature 0 draws nothing from the
engine's generator, so unseeded requests later sample what they would have), two tokens, on
the chat route and on the completions route. It is counted in /metrics like any request. A
warm-up that fails is logged and serving goes on: it changes no result.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

PROMPT = "Hello"
MAX_TOKENS = 2


def warm_up_routes(app: Any, model_name: str, api_key: str | None = None) -> dict[str, int]:
    """Send the warm-up requests to `app`; returns each route's HTTP status (200 when it ran;
    a model without a chat template answers the chat route 400, which is fine)."""
    return asyncio.run(_send(app, model_name, api_key))


async def _send(app: Any, model_name: str, api_key: str | None) -> dict[str, int]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    common = {"model": model_name, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    bodies = {
        "/v1/chat/completions": {**common, "messages": [{"role": "user", "content": PROMPT}]},
        "/v1/completions": {**common, "prompt": PROMPT},
    }
    statuses = {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://warmup") as client:
        for path, body in bodies.items():
            t0 = time.perf_counter()
            response = await client.post(path, json=body, headers=headers, timeout=600)
            statuses[path] = response.status_code
            logger.info("start-up warm-up %s: %d in %.0f ms", path, response.status_code,
                        (time.perf_counter() - t0) * 1e3)  # fmt: skip
    return statuses


def warm_up_server(app: Any, model_name: str, api_key: str | None = None) -> None:
    """warm_up_routes for run_server: a failure is logged (serving goes on), never raised."""
    try:
        statuses = warm_up_routes(app, model_name, api_key)
    except Exception as exc:  # noqa: BLE001 - the warm-up must not stop a server that works
        logger.warning("start-up warm-up request failed (serving anyway): %r", exc)
        return
    if statuses.get("/v1/completions") != 200:
        logger.warning("start-up warm-up: the completions route answered %s", statuses)
