"""Hermes-style calls, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2, Qwen2.5,
Qwen3, Hermes; the default tool prompt asks for it too). vLLM's name: `hermes`.

Text outside the tags is content. A block that never names a function (`<tool_call>hello`) is
given back as content, tags included, so nothing the model wrote is lost.
"""

from __future__ import annotations

from torch_runner.serve.parsing import DeltaMessage
from torch_runner.serve.tool_parsers import register_tool_parser
from torch_runner.serve.tool_parsers.base import StreamingToolParser, longest_prefix_suffix
from torch_runner.serve.tool_parsers.json_calls import CallScanner

START = "<tool_call>"
END = "</tool_call>"


@register_tool_parser("hermes")
class HermesToolParser(StreamingToolParser):
    def __init__(self, tokenizer=None) -> None:
        super().__init__()
        self._buffer = ""  # text not yet handled: at most a partial tag
        self._scanner: CallScanner | None = None  # open block
        self._block = ""  # the open block's raw text
        self._block_named = False
        self._buffer_at = 0  # offset of _buffer[0] in the input
        self._block_at = 0  # offset of the open block's START

    @property
    def decided_upto(self) -> int:
        """A block not yet naming a function may still turn out to be content; held whitespace
        may still be sent or dropped."""
        upto = (
            self._block_at
            if self._scanner is not None and not self._block_named
            else self._buffer_at
        )
        return min(upto, self._held_at) if self._held_space else upto

    def _feed_text(self, text: str, out: DeltaMessage) -> None:
        self._buffer += text
        while True:
            marker = END if self._scanner is not None else START
            found = self._buffer.find(marker)
            if found < 0:
                keep = longest_prefix_suffix(self._buffer, marker)
                ready, self._buffer = (
                    self._buffer[: len(self._buffer) - keep],
                    self._buffer[len(self._buffer) - keep :],
                )
                self._consume(ready, out)
                self._buffer_at += len(ready)
                return
            self._consume(self._buffer[:found], out)
            marker_at = self._buffer_at + found
            self._buffer = self._buffer[found + len(marker) :]
            self._buffer_at = marker_at + len(marker)
            if self._scanner is None:
                self._scanner, self._block, self._block_named = CallScanner(), "", False
                self._block_at = marker_at
            elif self._scanner.in_string:  # `</tool_call>` inside a JSON string is text
                self._buffer_at = marker_at
                self._consume(END, out)
                self._buffer_at += len(END)
            else:
                self._close_block(out, END)

    def _consume(self, text: str, out: DeltaMessage) -> None:
        """`text` starts at `_buffer_at` in the input."""
        if self._scanner is None:
            self.emit_content(text, out, self._buffer_at)
            return
        self._block += text
        self._block_events(self._scanner.feed(text), out)

    def _block_events(self, events, out: DeltaMessage) -> None:
        if any(event.kind == "name" for event in events):
            self._block_named = True
        if self._block_named:
            self.emit_call_events(events, out)

    def _close_block(self, out: DeltaMessage, end_tag: str) -> None:
        assert self._scanner is not None
        self._block_events(self._scanner.finish(), out)
        if not self._block_named:  # given back as written: the input from its START on
            self.emit_content(START + self._block + end_tag, out, self._block_at)
        self._scanner = None

    def _finish_text(self, out: DeltaMessage) -> None:
        rest, self._buffer = self._buffer, ""
        self._consume(rest, out)
        self._buffer_at += len(rest)
        if self._scanner is not None:
            self._close_block(out, "")
