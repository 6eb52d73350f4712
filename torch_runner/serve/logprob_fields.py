"""Which message field each generated token belongs to, so chat logprobs cover only `content`.

OpenAI's `logprobs.content` lists the tokens of the message's `content`: not harmony's header and
channel tokens (`<|start|>assistant<|channel|>final<|message|>`), not reasoning (harmony's
analysis channel, `<think>...</think>` and its tags), not tool-call text, never the end-of-turn
token. Forced calls (`required`, a named function) have no content tokens. Harmony parses by token, so its parser labels each token as it goes; `<think>` parsing is
by text, so a token is content when its text ends past the offset where the parser's content
began (each token's share of an increment's text comes from its own decoded length).
"""

from __future__ import annotations

from typing import Any

from torch_runner.serve.parsing import ChainedParser, FirstCallOnly
from torch_runner.serve.reasoning.harmony import HarmonyParser
from torch_runner.serve.reasoning.think import ThinkParser
from torch_runner.serve.tool_parsers.forced import NamedCallParser, RequiredCallsParser

CONTENT = "content"


def _inner(parser: Any) -> Any:
    """The parser that decides content vs reasoning (under parallel-call and chain wrappers)."""
    while isinstance(parser, FirstCallOnly | ChainedParser):
        parser = parser.inner if isinstance(parser, FirstCallOnly) else parser.reasoning
    return parser


class TokenLabeler:
    """One per choice, beside its `OutputParser`: `labels(delta_text, delta_ids)` right after the
    parser was fed the same increment gives one label per id ("content", or another field)."""

    def __init__(self, parser: Any, token_table: Any, skipped_ids: frozenset[int]):
        self.parser = _inner(parser)
        self.table = token_table
        self.skipped_ids = skipped_ids  # special tokens the text leaves out (no characters)
        self.num_tokens = 0  # ids labelled so far
        self.num_chars = 0  # characters of the choice's text they span

    def labels(self, delta_text: str, delta_ids: list[int]) -> list[str | None]:
        start, self.num_tokens = self.num_tokens, self.num_tokens + len(delta_ids)
        if isinstance(self.parser, HarmonyParser):
            return list(self.parser.token_fields[start : self.num_tokens])
        ends = self._char_ends(delta_text, delta_ids)
        if isinstance(self.parser, NamedCallParser | RequiredCallsParser):
            return ["tool"] * len(delta_ids)  # forced calls: the output is all call, no content
        if not isinstance(self.parser, ThinkParser):
            return [CONTENT] * len(delta_ids)
        content_from = self.parser.content_from
        return [
            CONTENT if content_from is not None and end > content_from else "reasoning"
            for end in ends
        ]

    def _char_ends(self, delta_text: str, delta_ids: list[int]) -> list[int]:
        """Where each token's text ends in the choice's text. Tokens share the increment's text
        by their own decoded lengths; the last one takes what those miss (a character split
        across tokens, a tokenizer's leading-space rule)."""
        ends, offset, limit = [], self.num_chars, self.num_chars + len(delta_text)
        for token_id in delta_ids:
            if token_id not in self.skipped_ids:
                offset = min(limit, offset + len(self.table.text(token_id)))
            ends.append(offset)
        if ends:
            ends[-1] = limit
        self.num_chars = limit
        return ends


def content_positions(labels: list[str | None], start: int, stop: int) -> list[int]:
    """Positions (into the choice's tokens) in [start, stop) whose label is content."""
    return [start + i for i, label in enumerate(labels[: stop - start]) if label == CONTENT]
