"""The contract between generated chat output and the OpenAI message: content, reasoning, tool calls.

One `OutputParser` per choice turns what the model generated into the message fields. Streaming
feeds it each increment (text and token ids) and sends the `DeltaMessage` it returns; the
non-streamed response calls `parse` once on the whole output. The two must agree: accumulating
every delta of `feed` + `finish` (contents concatenated, tool-call arguments concatenated per
index) equals `parse` of the whole. Reasoning parsers (serve/reasoning/) and tool-call parsers
(serve/tool_parsers/) implement it; `chain` runs a reasoning parser first and hands its content
to a tool-call parser.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class ToolCall:
    """One complete call: OpenAI's `{"id", "type": "function", "function": {name, arguments}}`."""

    id: str
    name: str
    arguments: str  # a JSON object as a string, as OpenAI sends it


@dataclass
class ToolCallDelta:
    """A piece of call `index`: id and name on its first delta, then argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class DeltaMessage:
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.content or self.reasoning_content or self.tool_calls)


@dataclass
class ParsedMessage:
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


class OutputParser(Protocol):
    """Stateful, one per choice. `token_ids` are the generated ids (special tokens included)."""

    def feed(self, delta_text: str, delta_token_ids: list[int]) -> DeltaMessage: ...

    def finish(self) -> DeltaMessage:
        """The end of generation: flush anything held back (a partial marker, an open call)."""
        ...

    def parse(self, text: str, token_ids: list[int]) -> ParsedMessage: ...


class PlainParser:
    """No reasoning, no tools: everything is content."""

    def feed(self, delta_text: str, delta_token_ids: list[int]) -> DeltaMessage:
        return DeltaMessage(content=delta_text or None)

    def finish(self) -> DeltaMessage:
        return DeltaMessage()

    def parse(self, text: str, token_ids: list[int]) -> ParsedMessage:
        return ParsedMessage(content=text)


def accumulate(deltas: list[DeltaMessage]) -> ParsedMessage:
    """What a client's stream helper builds from the deltas (the oracle for stream == non-stream)."""
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join(d.reasoning_content or "" for d in deltas)
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            call = calls.setdefault(piece.index, ToolCall(id="", name="", arguments=""))
            call.id = piece.id or call.id
            call.name = piece.name or call.name
            call.arguments += piece.arguments
    return ParsedMessage(
        content=content or None,
        reasoning_content=reasoning or None,
        tool_calls=[calls[i] for i in sorted(calls)],
    )


def _merge(first: DeltaMessage, second: DeltaMessage) -> DeltaMessage:
    return DeltaMessage(
        content=(first.content or "") + (second.content or "") or None,
        reasoning_content=(first.reasoning_content or "") + (second.reasoning_content or "")
        or None,
        tool_calls=first.tool_calls + second.tool_calls,
    )


class ChainedParser:
    """A reasoning parser first; the content it passes on goes through a tool-call parser.

    The tool parser sees the reasoning parser's content deltas and the same token ids (a text
    tool parser ignores them).
    """

    def __init__(self, reasoning: OutputParser, tools: OutputParser):
        self.reasoning = reasoning
        self.tools = tools

    def feed(self, delta_text: str, delta_token_ids: list[int]) -> DeltaMessage:
        first = self.reasoning.feed(delta_text, delta_token_ids)
        second = self.tools.feed(first.content or "", delta_token_ids)
        return _merge(
            DeltaMessage(reasoning_content=first.reasoning_content, tool_calls=first.tool_calls),
            second,
        )

    def finish(self) -> DeltaMessage:
        first = self.reasoning.finish()
        second = _merge(self.tools.feed(first.content or "", []), self.tools.finish())
        return _merge(
            DeltaMessage(reasoning_content=first.reasoning_content, tool_calls=first.tool_calls),
            second,
        )

    def parse(self, text: str, token_ids: list[int]) -> ParsedMessage:
        first = self.reasoning.parse(text, token_ids)
        second = self.tools.parse(first.content or "", token_ids)
        return ParsedMessage(
            content=second.content,
            reasoning_content=first.reasoning_content,
            tool_calls=first.tool_calls + second.tool_calls,
        )


class FirstCallOnly:
    """`parallel_tool_calls: false`: only the first call (index 0) is kept."""

    def __init__(self, inner: OutputParser):
        self.inner = inner

    @staticmethod
    def _first(delta: DeltaMessage) -> DeltaMessage:
        delta.tool_calls = [piece for piece in delta.tool_calls if piece.index == 0]
        return delta

    def feed(self, delta_text: str, delta_token_ids: list[int]) -> DeltaMessage:
        return self._first(self.inner.feed(delta_text, delta_token_ids))

    def finish(self) -> DeltaMessage:
        return self._first(self.inner.finish())

    def parse(self, text: str, token_ids: list[int]) -> ParsedMessage:
        parsed = self.inner.parse(text, token_ids)
        parsed.tool_calls = parsed.tool_calls[:1]
        return parsed
