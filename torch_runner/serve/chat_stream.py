"""One streamed chat choice: increments -> chunk choices (content, reasoning, tool-call deltas,
the content tokens' logprobs).

Rendering lags the engine (the next outputs are already folded into the `Choice` while an older
increment is rendered), so everything here reads the increment's own snapshot: the parser is
finished only on the increment that finished the choice. Finishing on the choice's live state
once flushed a held-back `</tool_call` early and sent the `>` that followed as content
("Sure.>", tests/test_serve_chat_stream.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch_runner.serve.generation import Increment
from torch_runner.serve.logprob_fields import CONTENT, TokenLabeler
from torch_runner.serve.parsing import DeltaMessage, OutputParser


def merged(first: DeltaMessage, second: DeltaMessage) -> DeltaMessage:
    return DeltaMessage(
        content=(first.content or "") + (second.content or "") or None,
        reasoning_content=(first.reasoning_content or "") + (second.reasoning_content or "")
        or None,
        tool_calls=first.tool_calls + second.tool_calls,
    )


class ChoiceRenderer:
    """The parser and token labels of one streamed choice. `message_tokens(choice)`: how many of
    a finished choice's tokens are its message (the end-of-turn token is not)."""

    def __init__(
        self,
        parser: OutputParser,
        labeler: TokenLabeler | None,
        message_tokens: Callable[[Any], int],
    ):
        self.parser = parser
        self.labeler = labeler  # None: no logprobs asked for
        self.message_tokens = message_tokens
        self.num_sent = 0  # tokens whose logprobs went out (or were left out)
        self.has_calls = False

    def render(self, increment: Increment) -> tuple[DeltaMessage, list[tuple[int, Any]]] | None:
        """The increment's message delta and the content tokens' (id, logprob entry) decided
        with it; None when there is nothing to send yet (a partial marker held back)."""
        message = self.parser.feed(increment.delta_text, increment.delta_token_ids)
        if self.labeler is not None:
            self.labeler.feed(increment.delta_text, increment.delta_token_ids)
        if increment.is_final:
            message = merged(message, self.parser.finish())
            if self.labeler is not None:
                self.labeler.finish()
        self.has_calls |= bool(message.tool_calls)
        picks = self._content_logprobs(increment)
        if message.is_empty and not picks and not increment.is_final:
            return None
        return message, picks

    def _content_logprobs(self, increment: Increment) -> list[tuple[int, Any]]:
        if self.labeler is None:
            return []
        choice, labels = increment.choice, self.labeler.labels
        # entries can trail the ids by an output: only those this increment carries exist yet
        stop = min(len(labels), increment.logprob_start + len(increment.delta_logprobs))
        if increment.is_final:
            stop = min(stop, self.message_tokens(choice))
        start, self.num_sent = self.num_sent, max(self.num_sent, stop)
        return [
            (choice.token_ids[position], choice.logprobs[position])
            for position in range(start, stop)
            if labels[position] == CONTENT
        ]
