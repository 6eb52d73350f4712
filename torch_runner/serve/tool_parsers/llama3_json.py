"""Llama 3.1 / 3.2 JSON calls: the whole answer is `{"name": ..., "parameters": {...}}`, several
separated by `;`, optionally after `<|python_tag|>`. vLLM's name: `llama3_json`.

The decision is made at the start, as vLLM does: an answer whose first non-blank text is `{` (or
the python tag) is read as calls; anything else is content. An object that names no function, or
text after the calls, turns the rest into content (nothing the model wrote is dropped). Content
is always a suffix of the input (all of it, or from the first stray text after the calls), so
its offsets are tracked for content logprobs (serve/logprob_fields.py).
"""

from __future__ import annotations

from torch_runner.serve.parsing import DeltaMessage
from torch_runner.serve.tool_parsers import register_tool_parser
from torch_runner.serve.tool_parsers.base import StreamingToolParser
from torch_runner.serve.tool_parsers.json_calls import CallScanner

PYTHON_TAG = "<|python_tag|>"
BLANKS = " \t\r\n"  # JSON's whitespace: the auto grammar decides on the same characters


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(StreamingToolParser):
    def __init__(self, tokenizer=None) -> None:
        super().__init__()
        self._mode = "start"  # start -> calls | content
        self._head = ""  # text read while undecided, or as calls before any call was named
        self._scanner = CallScanner()
        self._num_fed = 0  # input characters handled so far

    @property
    def decided_upto(self) -> int:
        """Undecided: everything while no call is named (it may all become content), and an
        open object that names no function yet (its raw text may become content)."""
        if self._mode == "content":
            upto = self._num_fed
        elif self._num_calls == 0:
            upto = 0
        elif self._scanner.is_open and self._scanner.name is None:
            upto = self._num_fed - len(self._scanner.raw)
        else:
            upto = self._num_fed
        return min(upto, self._held_at) if self._held_space else upto

    def _feed_text(self, text: str, out: DeltaMessage) -> None:
        for index, char in enumerate(text):
            if self._mode == "content":
                self.emit_content(text[index:], out, self._num_fed)
                self._num_fed += len(text) - index
                return
            self._num_fed += 1
            if self._mode == "start":
                self._head += char
                self._decide(out)
                continue
            self._call_char(char, out)

    def _decide(self, out: DeltaMessage) -> None:
        head = self._head.lstrip(BLANKS)
        if not head or PYTHON_TAG.startswith(head):
            return
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG) :].lstrip(BLANKS)
            if not head:
                return
        if head[0] == "{":
            self._mode = "calls"
            self._feed_calls(head, out)
        else:
            self._to_content(out)

    def _call_char(self, char: str, out: DeltaMessage) -> None:
        if self._num_calls == 0:
            self._head += char
        self._feed_calls(char, out)

    def _feed_calls(self, text: str, out: DeltaMessage) -> None:
        texts = self.emit_call_events(self._scanner.feed(text), out)
        if texts:
            self._to_content(out, texts)
        elif self._num_calls:
            self._head = ""

    def _to_content(self, out: DeltaMessage, texts: list[str] | None = None) -> None:
        """No call yet: all text read so far is content; after calls: the stray text is."""
        self._mode = "content"
        if self._num_calls == 0:
            self.emit_content(self._head, out, 0)  # the head is the input from its start
        else:  # the stray text ends at the character just read
            stray = "".join(texts or [])
            self.emit_content(stray, out, self._num_fed - len(stray))
        self._head = ""

    def _finish_text(self, out: DeltaMessage) -> None:
        if self._mode == "start":
            self._to_content(out)
        elif self._mode == "calls":
            self._feed_calls_end(out)

    def _feed_calls_end(self, out: DeltaMessage) -> None:
        texts = self.emit_call_events(self._scanner.finish(), out)
        if texts:
            self._to_content(out, texts)
