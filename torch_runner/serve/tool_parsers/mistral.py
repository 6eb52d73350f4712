"""Mistral calls: `[TOOL_CALLS]` then a JSON list `[{"name": ..., "arguments": {...}}, ...]`
(v3 tokenizers), or `[TOOL_CALLS]name[ARGS]{...}` (v11+ tokenizers). vLLM's name: `mistral`.

`[TOOL_CALLS]` is a control token, so requests using this parser keep special tokens in the text
(`skip_special_tokens = False`). Text before the marker is content. Call ids are nine
alphanumerics, the only shape Mistral's chat templates accept back in the history.
"""

from __future__ import annotations

import json
import secrets
import string

from torch_runner.serve.parsing import DeltaMessage
from torch_runner.serve.tool_parsers import register_tool_parser
from torch_runner.serve.tool_parsers.json_calls import (
    CallScanner,
    StreamingToolParser,
    longest_prefix_suffix,
)

MARKER = "[TOOL_CALLS]"
ARGS_MARKER = "[ARGS]"
_ID_ALPHABET = string.ascii_letters + string.digits


@register_tool_parser("mistral")
class MistralToolParser(StreamingToolParser):
    skip_special_tokens = False

    def __init__(self, tokenizer=None) -> None:
        super().__init__()
        self._buffer = ""
        self._in_calls = False
        self._scanner = CallScanner()
        self._name_buf: str | None = None  # v11: the text between [TOOL_CALLS] and [ARGS]
        self._v11_open = False  # a v11 call's arguments are being read

    @staticmethod
    def make_id() -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def _feed_text(self, text: str, out: DeltaMessage) -> None:
        self._buffer += text
        while self._buffer:
            if not self._in_calls:
                found = self._buffer.find(MARKER)
                if found < 0:
                    keep = longest_prefix_suffix(self._buffer, MARKER)
                    cut = len(self._buffer) - keep
                    self.emit_content(self._buffer[:cut], out)
                    self._buffer = self._buffer[cut:]
                    return
                self.emit_content(self._buffer[:found], out)
                self._buffer = self._buffer[found + len(MARKER) :]
                self._in_calls, self._name_buf = True, ""
                continue
            if self._name_buf is not None and not self._scanner.is_open:
                if not self._name_step(out):
                    return
                continue
            if self._v11_open:  # character by character: the call may end mid-chunk
                char, self._buffer = self._buffer[0], self._buffer[1:]
                self._scan(self._scanner.feed(char), out)
                continue
            rest, self._buffer = self._buffer, ""
            self._scan(self._scanner.feed(rest), out)

    def _name_step(self, out: DeltaMessage) -> bool:
        """Before a call's JSON: `[` / `{` start v3 JSON; `name[ARGS]` is a v11 call. False: wait."""
        head = (self._name_buf or "") + self._buffer
        stripped = head.lstrip()
        if stripped[:1] in ("[", "{"):
            self._name_buf, self._buffer = None, stripped
            return True
        found = head.find(ARGS_MARKER)
        if found < 0:
            if not stripped or longest_prefix_suffix(head, ARGS_MARKER) or "{" not in head:
                self._name_buf, self._buffer = head, ""
                return False
            found = head.index("{")  # `name{...}`: no [ARGS] marker
            self._start_named_call(head[:found], out)
            self._buffer = head[found:]
            return True
        self._start_named_call(head[:found], out)
        self._buffer = head[found + len(ARGS_MARKER) :]
        return True

    def _start_named_call(self, name: str, out: DeltaMessage) -> None:
        # v11 writes the name outside the JSON: hand the scanner an equivalent object opening.
        self._name_buf = None
        self._scan(
            self._scanner.feed('{"name": ' + json.dumps(name.strip()) + ', "arguments": '), out
        )
        self._v11_open = True

    def _scan(self, events, out: DeltaMessage) -> None:
        for text in self.emit_call_events(events, out):
            self.emit_content(text, out)
        if self._v11_open and self._scanner.phase == "after_value":
            # the arguments ended: close the synthetic object; the next call has its own marker
            self.emit_call_events(self._scanner.feed("}"), out)
            self._v11_open = False
            self._in_calls = False

    def _finish_text(self, out: DeltaMessage) -> None:
        rest, self._buffer = self._buffer, ""
        if not self._in_calls:
            self.emit_content(rest, out)
            return
        if self._name_buf is not None:
            rest = self._name_buf + rest
            self._name_buf = None
            if rest.strip() and "{" not in rest and "[" not in rest:
                self.emit_content(rest, out)
                rest = ""
        if rest:
            self._scan(self._scanner.feed(rest), out)
        self._scan(self._scanner.finish(), out)
