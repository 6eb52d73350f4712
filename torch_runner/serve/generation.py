"""Driving engine requests for one HTTP request: fan-out over choices, merge, abort, disconnects.

One HTTP request becomes (prompts x n) engine requests ("choices"). `merge_choices` runs them
concurrently and yields their increments in arrival order; whatever way it ends (finished,
error, client gone, task cancelled) its `finally` aborts every unfinished engine request, which is
what frees their KV. `until_disconnect` races a coroutine against the client hanging up, for
non-streaming responses (Starlette already cancels streaming bodies on disconnect).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from torch_runner.serve.errors import (
    APIError,
    EngineStoppedError,
    ModelOutputError,
    OverCapacityError,
    param_error,
)
from torch_runner.serve.metrics import ChoiceTracker
from torch_runner.serve.protocol import PromptTokensDetails, Usage

T = TypeVar("T")

LogprobEntry = tuple[float, list[tuple[int, float]]]
MIN_LOGPROB = -9999.0  # what a non-finite logprob is sent as (vLLM's convention)


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


@dataclass
class Choice:
    """One engine request: cumulative state plus the increment from the latest output."""

    index: int
    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    params: Any
    tracker: ChoiceTracker
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    is_finished: bool = False
    has_output: bool = False
    error: str | None = None  # set with finish_reason "error"
    guard: Any = None  # a RepeatGuard (serve/call_repeats.py): `required` calls end at a repeat


@dataclass
class Increment:
    """What one engine output added. Rendering may lag behind (the next outputs are already
    folded into the choice), so what an increment needs is snapshotted here, not read back."""

    choice: Choice
    delta_text: str
    delta_token_ids: list[int]
    delta_logprobs: list[LogprobEntry]
    logprob_start: int = 0  # position of delta_logprobs[0] among the choice's tokens
    is_final: bool = False  # this output finished the choice

    @property
    def is_empty(self) -> bool:
        """Nothing to stream: no new text, tokens or logprobs, and the choice is still running."""
        return not (self.delta_text or self.delta_token_ids or self.delta_logprobs or self.is_final)

    @property
    def finish_reason(self) -> str | None:
        """The choice's finish reason on its final increment; None before that."""
        return self.choice.finish_reason if self.is_final else None


def json_logprob(value: Any) -> float:
    """A logprob JSON can carry: -inf (a token a grammar or bias masked out) and NaN become
    MIN_LOGPROB, as vLLM sends them, so no response serialisation can fail on a float."""
    value = float(value)
    return max(value, MIN_LOGPROB) if math.isfinite(value) else MIN_LOGPROB


def normalize_logprobs(raw: Any, token_ids: list[int]) -> list[LogprobEntry]:
    """Engine logprobs -> [(chosen logprob, [(token id, logprob), ...]), ...] aligned with token_ids."""
    if not raw:
        return []
    entries: list[LogprobEntry] = []
    for token_id, entry in zip(token_ids, raw):
        if isinstance(entry, dict):  # {token_id: logprob} including the chosen token
            chosen = json_logprob(entry[token_id])
            top = sorted(
                ((int(i), json_logprob(lp)) for i, lp in entry.items()), key=lambda item: -item[1]
            )
        else:
            chosen = json_logprob(entry.logprob)
            top = [(int(i), json_logprob(lp)) for i, lp in (entry.top_logprobs or [])]
        entries.append((chosen, top))
    return entries


def apply_output(choice: Choice, output: Any, now: float) -> Increment:
    """Fold one engine output (cumulative text/token_ids/logprobs) into the choice; return what is new.

    Only the new logprob entries are converted, so a long generation stays linear here.
    """
    token_ids = list(output.token_ids)
    delta_ids = token_ids[len(choice.token_ids) :]
    text = output.text or ""
    finished, is_cut = bool(output.finished), False
    if choice.guard is not None:  # only the text it releases; a repeated call ends the choice
        text = choice.guard.visible(text, finished)
        is_cut = choice.guard.is_cut
        finished = finished or is_cut
    delta_text = text[len(choice.text) :]
    num_done = len(choice.logprobs)
    delta_entries = normalize_logprobs((output.logprobs or [])[num_done:], token_ids[num_done:])
    choice.has_output = True
    choice.tracker.on_tokens(now, len(delta_ids))
    choice.text, choice.token_ids = text, token_ids
    choice.logprobs.extend(delta_entries)
    choice.num_cached_tokens = int(getattr(output, "num_cached_tokens", 0) or 0)
    if finished:
        choice.is_finished = True
        choice.finish_reason = "stop" if is_cut else (output.finish_reason or "stop")
        choice.tracker.finish_reason = choice.finish_reason
        choice.error = getattr(output, "error", None)
    return Increment(
        choice,
        delta_text,
        delta_ids,
        delta_entries,
        logprob_start=num_done,
        is_final=finished,
    )


def engine_error(exc: Exception) -> APIError:
    """Map what `AsyncEngine.generate` raises to the client's error; re-raise anything else."""
    from torch_runner.async_engine import (  # lazy: keeps `import` light
        EngineOverCapacityError,
        EngineShutdownError,
    )

    if isinstance(exc, APIError):
        return exc
    from torch_runner.distributed.group import RankFailure

    if isinstance(exc, EngineShutdownError):
        return EngineStoppedError(str(exc), code="server_shutdown")
    if isinstance(exc, RankFailure):  # the server exits next (serve/server.py): a 503, not a 500
        return EngineStoppedError(f"the engine stopped: {exc}", code="engine_failed")
    if isinstance(exc, EngineOverCapacityError):
        return OverCapacityError(
            str(exc) or "server is over capacity; retry later", code="over_capacity"
        )
    if isinstance(exc, ValueError):  # QueueTooSmallError included: waiting would not help
        return param_error(exc)
    raise exc


async def merge_choices(engine: Any, choices: list[Choice]) -> AsyncIterator[Increment]:
    """Run every choice concurrently; yield increments as they arrive; abort leftovers on exit."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(choice: Choice, outputs: AsyncIterator) -> None:
        try:
            async for output in outputs:
                await queue.put(apply_output(choice, output, time.perf_counter()))
                if choice.is_finished and not output.finished:  # ended here: no more tokens
                    engine.abort(choice.request_id)
                    if hasattr(outputs, "aclose"):
                        await outputs.aclose()
                    break
        except Exception as exc:
            await queue.put(exc)
        finally:
            await queue.put(done)

    try:  # every choice admitted at once, or none: a fan-out is never half queued
        streams = engine.submit([(c.request_id, c.prompt_ids, c.params) for c in choices])
    except Exception as exc:
        raise engine_error(exc) from None
    tasks = [asyncio.create_task(pump(c, s)) for c, s in zip(choices, streams)]
    abort_reason = "client_disconnected"  # unless an error below ends the merge
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                error = engine_error(item)
                abort_reason = error.code or "error"
                raise error
            else:
                yield item
                if item.choice.finish_reason == "error":  # the model failed this choice
                    abort_reason = "non_finite_logits"
                    item.choice.tracker.abort_reason = abort_reason
                    raise ModelOutputError(
                        f"choice {item.choice.index}: {item.choice.error}", code=abort_reason
                    )
    finally:
        for task in tasks:
            task.cancel()
        for choice in choices:
            if not choice.is_finished:
                engine.abort(choice.request_id)
                choice.tracker.finish_reason = "abort"
                choice.tracker.abort_reason = abort_reason


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        finished, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in finished:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnected()


async def collect(increments: AsyncIterator[Increment]) -> None:
    """Drain a merge (choices accumulate their own state), closing it whatever happens."""
    async with contextlib.aclosing(increments) as stream:
        async for _ in stream:
            pass


async def run_choices(
    http: Request, engine: Any, choices: list[Choice], on_close: Callable[[], None]
) -> bool:
    """Run every choice to the end for a non-streaming answer; False if the client left first.

    `on_close` runs whatever happens (finished, disconnect, error), like a streaming `on_close`.
    """
    try:
        await until_disconnect(http, collect(merge_choices(engine, choices)))
    except ClientDisconnected:
        return False
    finally:
        on_close()
    return True


def usage_of(choices: list[Choice]) -> Usage:
    """Prompt tokens count once per prompt (not per choice); cached tokens: the least any choice got."""
    prompts: dict[int, tuple[int, int]] = {}
    for choice in choices:
        num_prompt, cached = prompts.get(
            choice.prompt_index, (len(choice.prompt_ids), choice.num_cached_tokens)
        )
        prompts[choice.prompt_index] = (num_prompt, min(cached, choice.num_cached_tokens))
    prompt_tokens = sum(n for n, _ in prompts.values())
    completion_tokens = sum(len(choice.token_ids) for choice in choices)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(c for _, c in prompts.values())
        ),
    )
