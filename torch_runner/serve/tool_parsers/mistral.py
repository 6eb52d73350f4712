"""Mistral calls: `[TOOL_CALLS]` then a JSON list `[{"name": ..., "arguments": {...}}, ...]`
(v3 tokenizers), or `[TOOL_CALLS]name[ARGS]{...}` per call (v11+ tokenizers). vLLM's name:
`mistral`.

`[TOOL_CALLS]` is a control token, so requests using this parser keep special tokens in the text
(`skip_special_tokens = False`). Text before the marker is content, and so is a marker followed
by neither JSON nor a function name. Call ids are nine alphanumerics, the only shape Mistral's
chat templates accept back in the history. After the marker every decision is taken one
character at a time, so where a stream is cut never changes the result. Content offsets in the
input are tracked (`at`) for content logprobs (serve/logprob_fields.py).
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
        self._buffer_at = 0  # offset of _buffer[0] in the input
        self._mode = "content"  # content | head (after a marker) | json (v3) | args (v11)
        self._head = ""
        self._head_at = 0  # offset of _head[0] in the input (just past the marker)
        self._scanner = CallScanner()
        self._num_fed = 0

    @staticmethod
    def make_id() -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    @property
    def decided_upto(self) -> int:
        """Undecided: a held tail that may grow into the marker, the text after a marker (it
        may become content), an open JSON object that names no function yet."""
        if self._mode == "content":
            upto = self._buffer_at if self._buffer else self._num_fed
        elif self._mode == "head":
            upto = self._head_at
        elif self._mode == "json" and self._scanner.is_open and self._scanner.name is None:
            upto = self._num_fed - len(self._scanner.raw)
        else:
            upto = self._num_fed
        return min(upto, self._held_at) if self._held_space else upto

    def _feed_text(self, text: str, out: DeltaMessage) -> None:
        at, self._num_fed = self._num_fed, self._num_fed + len(text)
        self._walk(text, at, out)

    def _walk(self, text: str, at: int, out: DeltaMessage) -> None:
        """`text` starts at offset `at` of the input."""
        for index, char in enumerate(text):
            if self._mode == "content":
                self._content_text(text[index:], at + index, out)
                return
            if self._mode == "head":
                self._head_char(char, out)
            elif self._mode == "json":
                self._scan(self._scanner.feed(char), at + index + 1, out)
            else:
                self._args_char(char, at + index + 1, out)

    def _content_text(self, text: str, at: int, out: DeltaMessage) -> None:
        if not self._buffer:
            self._buffer_at = at
        self._buffer += text
        found = self._buffer.find(MARKER)
        if found < 0:
            cut = len(self._buffer) - longest_prefix_suffix(self._buffer, MARKER)
            self.emit_content(self._buffer[:cut], out, self._buffer_at)
            self._buffer, self._buffer_at = self._buffer[cut:], self._buffer_at + cut
            return
        self.emit_content(self._buffer[:found], out, self._buffer_at)
        rest_at = self._buffer_at + found + len(MARKER)
        rest = self._buffer[found + len(MARKER) :]
        self._buffer, self._mode, self._head, self._head_at = "", "head", "", rest_at
        self._walk(rest, rest_at, out)

    def _head_char(self, char: str, out: DeltaMessage) -> None:
        """After the marker: JSON (v3), a name then [ARGS] (v11), or content."""
        self._head += char
        head = self._head.lstrip()
        if not head:
            return
        if len(head) == 1 and head in "[{":
            self._mode = "json"
            self._scan(self._scanner.feed(head), self._head_at + len(self._head), out)
        elif head.endswith(ARGS_MARKER) or char == "{":
            name = head[: -len(ARGS_MARKER)] if char != "{" else head[:-1]
            if not _NAME.match(name):
                self._to_content(out)
                return
            self._mode = "args"
            opening = '{"name": ' + json.dumps(name) + ', "arguments": '
            opening += "{" if char == "{" else ""
            self._scan(self._scanner.feed(opening), self._head_at + len(self._head), out)
        else:
            pending = longest_prefix_suffix(head, ARGS_MARKER)
            if not set(head[: len(head) - pending]) <= _NAME_CHARS:
                self._to_content(out)

    def _to_content(self, out: DeltaMessage) -> None:
        head, self._head, self._mode = self._head, "", "content"
        self._content_text(head, self._head_at, out)

    def _args_char(self, char: str, end: int, out: DeltaMessage) -> None:
        self._scan(self._scanner.feed(char), end, out)
        if self._scanner.phase == "after_value":  # the arguments ended: close the object
            self._scan(self._scanner.feed("}"), end, out)
            self._mode = "content"

    def _scan(self, events, end: int, out: DeltaMessage) -> None:
        """`end`: where the text just scanned ends in the input (a stray text ends there)."""
        for text in self.emit_call_events(events, out):
            self.emit_content(text, out, end - len(text))

    def _finish_text(self, out: DeltaMessage) -> None:
        if self._mode == "head":
            self._to_content(out)
        if self._mode == "content":
            self.emit_content(self._buffer, out, self._buffer_at)
            self._buffer = ""
            return
        self._scan(self._scanner.finish(), self._num_fed, out)
