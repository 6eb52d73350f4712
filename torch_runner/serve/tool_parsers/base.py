"""The base of the text tool parsers: call numbering and ids, content whitespace, and `parse`.

`StreamingToolParser.parse` runs the same machinery as the stream over the whole text at once,
so a streamed answer accumulates to the non-streamed one by construction; the tests feed every
split position (and seeded random marker soups) to hold each parser to that: a chunk boundary
must never change the result.
"""

from __future__ import annotations

import uuid

from torch_runner.serve.parsing import DeltaMessage, ParsedMessage, ToolCallDelta, accumulate
from torch_runner.serve.tool_parsers.json_calls import CallEvent


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class StreamingToolParser:
    """Base of the text tool parsers: subclasses implement `_feed_text` and `_finish_text`.

    It numbers calls, gives each an id, holds back whitespace-only content so a message that is
    only calls has `content` None, and implements `parse` as one feed plus finish (see the
    module docstring for why).
    """

    skip_special_tokens = True  # parsers that read special-token markers set False

    def __init__(self) -> None:
        self._num_calls = 0
        self._held_space = ""
        self._held_at = 0  # offset of the held whitespace in the parser's input
        # [start, end) offsets in the input of the text sent as content, for parsers that pass
        # `at` to emit_content (serve/logprob_fields.py labels content tokens with them)
        self.content_spans: list[tuple[int, int]] = []

    # subclasses: text in, a DeltaMessage out (through the helpers below)
    def _feed_text(self, text: str, out: DeltaMessage) -> None:
        raise NotImplementedError

    def _finish_text(self, out: DeltaMessage) -> None:
        raise NotImplementedError

    def feed(self, delta_text: str, delta_token_ids: list[int]) -> DeltaMessage:
        out = DeltaMessage()
        if delta_text:
            self._feed_text(delta_text, out)
        return out

    def finish(self) -> DeltaMessage:
        out = DeltaMessage()
        self._finish_text(out)
        if self._held_space and self._num_calls == 0:
            out.content = (out.content or "") + self._held_space
            self._add_span(self._held_at, self._held_at + len(self._held_space))
        self._held_space = ""
        return out

    def parse(self, text: str, token_ids: list[int]) -> ParsedMessage:
        return accumulate([self.feed(text, token_ids), self.finish()])

    # helpers for subclasses
    def emit_content(self, text: str, out: DeltaMessage, at: int | None = None) -> None:
        """Content, holding back trailing whitespace: it is sent once more text follows, and
        dropped when a call follows (so a message that is only calls has no content). `at`:
        where `text` starts in the parser's input (None: not tracked)."""
        if not text:
            return
        body = text.rstrip()
        if not body:
            if not self._held_space and at is not None:
                self._held_at = at
            self._held_space += text
            return
        if at is not None:  # the held blank need not touch `text` (a marker may lie between)
            if self._held_space:
                self._add_span(self._held_at, self._held_at + len(self._held_space))
            self._add_span(at, at + len(body))
            self._held_at = at + len(body)
        out.content = (out.content or "") + self._held_space + body
        self._held_space = text[len(body) :]

    def _add_span(self, start: int, end: int) -> None:
        if self.content_spans and self.content_spans[-1][1] == start:
            start = self.content_spans.pop()[0]
        self.content_spans.append((start, end))

    @property
    def decided_upto(self) -> int | None:
        """Input offset before which every character's field is final (None: not tracked)."""
        return None

    def drop_held_space(self) -> None:
        self._held_space = ""

    def emit_call_events(self, events: list[CallEvent], out: DeltaMessage) -> list[str]:
        """Turn scanner events into tool-call deltas; returns the "text" events' texts."""
        texts = []
        for event in events:
            if event.kind == "name":
                self.drop_held_space()
                out.tool_calls.append(
                    ToolCallDelta(index=self._num_calls, id=self.make_id(), name=event.text)
                )
                self._num_calls += 1
            elif event.kind == "args":
                index = self._num_calls - 1
                if out.tool_calls and out.tool_calls[-1].index == index:
                    out.tool_calls[-1].arguments += event.text
                else:
                    out.tool_calls.append(ToolCallDelta(index=index, arguments=event.text))
            elif event.kind == "text":
                texts.append(event.text)
        return texts

    @staticmethod
    def make_id() -> str:
        """A call id in the family's shape (the history sends it back through its template)."""
        return new_call_id()


def longest_prefix_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (held back)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
