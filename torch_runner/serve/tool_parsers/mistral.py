"""Mistral calls: `[TOOL_CALLS]` then a JSON list `[{"name": ..., "arguments": {...}}, ...]`
(v3 tokenizers), or `[TOOL_CALLS]name[ARGS]{...}` per call (v11+ tokenizers). vLLM's name:
`mistral`.

`[TOOL_CALLS]` is a control token, so requests using this parser keep special tokens in the text
(`skip_special_tokens = False`). Text before the marker is content, and so is a marker followed
by neither JSON nor a function name. Call ids are nine alphanumerics, the only shape Mistral's
chat templates accept back in the history. After the marker every decision is taken one
character at a time, so where a stream is cut never changes the result.
"""

from __future__ import annotations

import json
import re
import secrets
import string

from torch_runner.serve.parsing import DeltaMessage
from torch_runner.serve.tool_parsers import register_tool_parser
from torch_runner.serve.tool_parsers.base import StreamingToolParser, longest_prefix_suffix
from torch_runner.serve.tool_parsers.json_calls import CallScanner

MARKER = "[TOOL_CALLS]"
ARGS_MARKER = "[ARGS]"
_ID_ALPHABET = string.ascii_letters + string.digits
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_NAME_CHARS = set(_ID_ALPHABET + "_.-")


@register_tool_parser("mistral")
class MistralToolParser(StreamingToolParser):
    skip_special_tokens = False

    def __init__(self, tokenizer=None) -> None:
        super().__init__()
        self._buffer = ""  # content being searched for the marker
        self._mode = "content"  # content | head (after a marker) | json (v3) | args (v11)
        self._head = ""
        self._scanner = CallScanner()

    @staticmethod
    def make_id() -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def _feed_text(self, text: str, out: DeltaMessage) -> None:
        for index, char in enumerate(text):
            if self._mode == "content":
                self._content_text(text[index:], out)
                return
            if self._mode == "head":
                self._head_char(char, out)
            elif self._mode == "json":
                self._scan(self._scanner.feed(char), out)
            else:
                self._args_char(char, out)

    def _content_text(self, text: str, out: DeltaMessage) -> None:
        self._buffer += text
        found = self._buffer.find(MARKER)
        if found < 0:
            cut = len(self._buffer) - longest_prefix_suffix(self._buffer, MARKER)
            self.emit_content(self._buffer[:cut], out)
            self._buffer = self._buffer[cut:]
            return
        self.emit_content(self._buffer[:found], out)
        rest = self._buffer[found + len(MARKER) :]
        self._buffer, self._mode, self._head = "", "head", ""
        self._feed_text(rest, out)

    def _head_char(self, char: str, out: DeltaMessage) -> None:
        """After the marker: JSON (v3), a name then [ARGS] (v11), or content."""
        self._head += char
        head = self._head.lstrip()
        if not head:
            return
        if len(head) == 1 and head in "[{":
            self._mode = "json"
            self._scan(self._scanner.feed(head), out)
        elif head.endswith(ARGS_MARKER) or char == "{":
            name = head[: -len(ARGS_MARKER)] if char != "{" else head[:-1]
            if not _NAME.match(name):
                self._to_content(out)
                return
            self._mode = "args"
            opening = '{"name": ' + json.dumps(name) + ', "arguments": '
            self._scan(self._scanner.feed(opening + ("{" if char == "{" else "")), out)
        else:
            pending = longest_prefix_suffix(head, ARGS_MARKER)
            if not set(head[: len(head) - pending]) <= _NAME_CHARS:
                self._to_content(out)

    def _to_content(self, out: DeltaMessage) -> None:
        head, self._head, self._mode = self._head, "", "content"
        self._content_text(head, out)

    def _args_char(self, char: str, out: DeltaMessage) -> None:
        self._scan(self._scanner.feed(char), out)
        if self._scanner.phase == "after_value":  # the arguments ended: close the object
            self._scan(self._scanner.feed("}"), out)
            self._mode = "content"

    def _scan(self, events, out: DeltaMessage) -> None:
        for text in self.emit_call_events(events, out):
            self.emit_content(text, out)

    def _finish_text(self, out: DeltaMessage) -> None:
        if self._mode == "head":
            self._to_content(out)
        if self._mode == "content":
            self.emit_content(self._buffer, out)
            self._buffer = ""
            return
        self._scan(self._scanner.finish(), out)
