"""What the engine hands back: one `RequestOutput` per request per step it progressed in."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(slots=True)
class Logprob:
    """One generated token's logprob and the `top_logprobs` most likely alternatives."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)  # one per request per step: slots make it cheaper to build
class RequestOutput:
    """Cumulative state of one request plus the increment of the latest step.

        text / token_ids / logprobs are cumulative; delta_text / delta_token_ids are what this
        output adds. finish_reason is "stop", "length", "abort", "error" (the model produced
    non-finite logits for it; `error` says so) or None while running; stop_reason
        is the stop string or stop token id that ended it (None for EOS and length).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    delta_token_ids: list[int]
    logprobs: list[Logprob] | None
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    stop_reason: int | str | None = None
    error: str | None = None  # why a request with finish_reason "error" ended


def coalesce(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: the newer cumulative state, with both
    steps' deltas (what a consumer that fell behind receives, as if one step made both)."""
    return replace(
        newer,
        delta_text=older.delta_text + newer.delta_text,
        delta_token_ids=older.delta_token_ids + newer.delta_token_ids,
    )
