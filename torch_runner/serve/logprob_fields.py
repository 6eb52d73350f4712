"""Which message field each generated token belongs to, so chat logprobs cover only `content`.

OpenAI's `logprobs.content` lists the tokens of the message's `content`: not harmony's header and
channel tokens (`<|start|>assistant<|channel|>final<|message|>`), not reasoning (harmony's
analysis channel, `<think>...</think>` and its tags), not tool-call text, never the end-of-turn
token. Forced calls (`required`, a named function) have no content tokens. Harmony parses by
token, so its parser labels each token as it goes. The rest parse text: `<think>` content is the
text from the offset where the parser's content began; a text tool parser (hermes, llama3_json,
mistral) records the input spans it sent as content and how far its decisions are final (a
held-back `<tool_` may still become a call, a Llama-3 answer that opened with `{` may still turn
out to be text). Behind a `<think>` parser the tool parser's input is the content, so its
offsets are shifted by where the content began. A token is labelled once both have decided its
characters; each token's share of an increment's text comes from its own decoded length.
"""

from __future__ import annotations

from typing import Any

from torch_runner.serve.parsing import ChainedParser, FirstCallOnly
from torch_runner.serve.reasoning.harmony import HarmonyParser
from torch_runner.serve.reasoning.think import ThinkParser
from torch_runner.serve.tool_parsers.base import StreamingToolParser
from torch_runner.serve.tool_parsers.forced import NamedCallParser, RequiredCallsParser

CONTENT = "content"


def _unwrapped(parser: Any) -> Any:
    while isinstance(parser, FirstCallOnly):
        parser = parser.inner
    return parser


class TokenLabeler:
    """One per choice, beside its `OutputParser`: call `feed` right after the parser was fed the
    same increment (and `finish` after the parser's finish); `labels` holds one label per token
    decided so far ("content", or another field), in token order."""

    def __init__(self, parser: Any, token_table: Any, skipped_ids: frozenset[int]):
        parser = _unwrapped(parser)
        self.reasoning: ThinkParser | None = None
        if isinstance(parser, ChainedParser):
            self.reasoning, parser = parser.reasoning, _unwrapped(parser.tools)
        elif isinstance(parser, ThinkParser):
            self.reasoning, parser = parser, None
        self.parser = parser  # the tool (or harmony, or plain) parser; None behind think alone
        self.table = token_table
        self.skipped_ids = skipped_ids  # special tokens the text leaves out (no characters)
        self.labels: list[str | None] = []
        self.spans: list[tuple[int, int]] = []  # each fed token's [start, end) in the text
        self.num_chars = 0  # characters of the choice's text fed so far

    def feed(self, delta_text: str, delta_ids: list[int]) -> None:
        start = len(self.spans)
        self._add_spans(delta_text, delta_ids)
        if isinstance(self.parser, HarmonyParser):
            self.labels += self.parser.token_fields[start : len(self.spans)]
        else:
            self._decide(is_final=False)

    def finish(self) -> None:
        self._decide(is_final=True)

    def _decide(self, is_final: bool) -> None:
        """Label the tokens, in order, as far as the parsers have decided their characters."""
        while len(self.labels) < len(self.spans):
            label = self._label(*self.spans[len(self.labels)], is_final)
            if label is None:
                return
            self.labels.append(label)

    def _label(self, start: int, end: int, is_final: bool) -> str | None:
        """The field of the text [start, end); None while undecided."""
        offset, reasoning, tools = 0, self.reasoning, self.parser
        if reasoning is not None:
            if reasoning.state == "start" and not is_final:
                return None  # `<thi...` at the very start: reasoning or content, not known yet
            content_from = reasoning.content_from
            if content_from is None or end <= content_from:
                return "reasoning"
            offset, start = content_from, max(start, content_from)
        if isinstance(tools, NamedCallParser | RequiredCallsParser):
            return "tool"  # forced calls: all call, no content
        if not isinstance(tools, StreamingToolParser):
            return CONTENT  # plain text (or `<think>` content)
        start, end = start - offset, end - offset
        upto = None if is_final else tools.decided_upto
        if upto is not None and end > upto:
            return None
        is_content = any(a < end and start < b for a, b in tools.content_spans)
        return CONTENT if is_content else "tool"

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
