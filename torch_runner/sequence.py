"""One request's state, in plain Python (no torch), so scheduling is testable in milliseconds.

A `Sequence` owns its token ids, how many of them already have KV in the cache
(`num_computed_tokens`), and its block table into the shared paged pool. Preemption by
recompute simply resets `num_computed_tokens` to 0 and gives the blocks back: the tokens
generated so far stay, and are recomputed as part of the next prefill.
"""

from __future__ import annotations

import enum
import itertools
from typing import Any

_arrival = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids, progress and KV blocks of one generation request."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: Any = None) -> None:
        if not prompt_token_ids:
            raise ValueError(
                f"request {request_id!r}: prompt_token_ids is empty; expected at least one token"
            )
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.arrival = next(_arrival)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        # tokens sampled by launched steps but not read back yet (overlapped steps, 0 or 1):
        # the scheduler counts them, so the next step can be launched before they are known
        self.num_output_placeholders = 0
        self.block_table: list[int] = []
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache (first admission)
        self.is_admitted_before = False
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens the scheduler plans with: the known ones plus the output placeholders."""
        return (
            len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders
        )

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is still to be computed (1 for a sequence in decode)."""
        return self.num_scheduled_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:  # a decode step's token: no copy of the whole sequence
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(int(token_id))

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
