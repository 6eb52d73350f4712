"""Which message field each generated token belongs to, so chat logprobs cover only `content`.

OpenAI's `logprobs.content` lists the tokens of the message's `content`: not harmony's header and
channel tokens (`<|start|>assistant<|channel|>final<|message|>`), not reasoning (harmony's
analysis channel, `<think>...</think>` and its tags), not tool-call text, never the end-of-turn
token. Forced calls (`required`, a named function) have no content tokens. Harmony parses by
token, so its parser labels each token as it goes; `<think>` parsing is by text, so a token is
content when its text ends past the offset where the parser's content began; the hermes parser
records the input spans it sent as content, and a token is labelled once the parser has decided
its characters (a held-back `<tool_` may still become a call). Each token's share of an
increment's text comes from its own decoded length.
"""

from __future__ import annotations

from typing import Any

from torch_runner.serve.parsing import ChainedParser, FirstCallOnly
from torch_runner.serve.reasoning.harmony import HarmonyParser
from torch_runner.serve.reasoning.think import ThinkParser
from torch_runner.serve.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from torch_runner.serve.tool_parsers.hermes import HermesToolParser

CONTENT = "content"


def _inner(parser: Any) -> Any:
    """The parser that decides content vs the rest (under parallel-call and chain wrappers: a
    reasoning parser in a chain decides, its tool parser is not consulted)."""
    while isinstance(parser, FirstCallOnly | ChainedParser):
        parser = parser.inner if isinstance(parser, FirstCallOnly) else parser.reasoning
    return parser


class TokenLabeler:
    """One per choice, beside its `OutputParser`: call `feed` right after the parser was fed the
    same increment (and `finish` after the parser's finish); `labels` holds one label per token
    decided so far ("content", or another field), in token order."""

    def __init__(self, parser: Any, token_table: Any, skipped_ids: frozenset[int]):
        self.parser = _inner(parser)
        self.table = token_table
        self.skipped_ids = skipped_ids  # special tokens the text leaves out (no characters)
        self.labels: list[str | None] = []
        self.spans: list[tuple[int, int]] = []  # each fed token's [start, end) in the text
        self.num_chars = 0  # characters of the choice's text fed so far

    def feed(self, delta_text: str, delta_ids: list[int]) -> None:
        start = len(self.spans)
        self._add_spans(delta_text, delta_ids)
        parser = self.parser
        if isinstance(parser, HarmonyParser):
            self.labels += parser.token_fields[start : len(self.spans)]
        elif isinstance(parser, NamedCallParser | RequiredCallsParser):
            self.labels += ["tool"] * len(delta_ids)  # forced calls: all call, no content
        elif isinstance(parser, ThinkParser):
            content_from = parser.content_from
            self.labels += [
                CONTENT if content_from is not None and end > content_from else "reasoning"
                for _, end in self.spans[start:]
            ]
        elif isinstance(parser, HermesToolParser):
            self._decide(parser.decided_upto)
        else:
            self.labels += [CONTENT] * len(delta_ids)

    def finish(self) -> None:
        if isinstance(self.parser, HermesToolParser):
            self._decide(None)

    def _decide(self, upto: int | None) -> None:
        """Label the tokens whose characters all lie before `upto` (None: every token)."""
        content = self.parser.content_spans
        while len(self.labels) < len(self.spans):
            start, end = self.spans[len(self.labels)]
            if upto is not None and end > upto:
                return
            is_content = any(a < end and start < b for a, b in content)
            self.labels.append(CONTENT if is_content else "tool")

    def _add_spans(self, delta_text: str, delta_ids: list[int]) -> None:
        """Tokens share the increment's text by their own decoded lengths; the last one takes
        what those miss (a character split across tokens, a tokenizer's leading-space rule)."""
        offset, limit = self.num_chars, self.num_chars + len(delta_text)
        for i, token_id in enumerate(delta_ids):
            start = offset
            if token_id not in self.skipped_ids:
                offset = min(limit, offset + len(self.table.text(token_id)))
            if i == len(delta_ids) - 1:
                offset = limit
            self.spans.append((start, offset))
        self.num_chars = limit
