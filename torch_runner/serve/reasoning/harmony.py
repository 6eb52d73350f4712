"""gpt-oss harmony output -> reasoning_content, content and tool_calls, by token id.

openai-harmony's `StreamableParser` reads the generated ids (the prompt ends in
`<|start|>assistant`, so output begins with the header). Each message's channel picks the field:
`analysis` -> reasoning_content; `final`, or `commentary` with no recipient (a preamble) ->
content; `commentary` addressed `to=functions.NAME` -> a tool call whose arguments are the
message body; any other recipient (built-in tools this server does not run) -> reasoning_content.
Output that is not harmony (a random or badly tuned model, a grammar's JSON) is never dropped:
output that does not open with a header, a header that is not harmony's (plain text that began
like a ` to=` recipient), and everything from a token the parser rejects on, becomes content
(special tokens left out). A harmony header cut short (max_tokens ending the output between
`<|start|>` or `<|channel|>` and `<|message|>`) is protocol, not text: it is dropped, as vLLM
does, so no `assistant` / `final` / `analysis` word ever reaches content.

`stop` strings: the engine finds them in its detokenized text but the fields come from tokens,
so the parser cuts each message body (and the plain-text fallback) at the first stop string
itself and holds back a tail that could still become one, as the engine does for plain text.
"""

from __future__ import annotations

import uuid
from typing import Any

from torch_runner.detokenizer import find_stop, holdback_length
from torch_runner.serve.parsing import DeltaMessage, ParsedMessage, ToolCallDelta, accumulate
from torch_runner.serve.reasoning.harmony_encoding import load_harmony_encoding
from torch_runner.serve.tool_parsers import register_tool_parser

FUNCTIONS_PREFIX = "functions."
# The special tokens harmony is written with; any other special token (<|endoftext|>, a
# grammar's end) carries no text and is skipped.
STRUCTURE = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
STRUCTURE += ("<|constrain|>",)
REPLACEMENT = "\ufffd"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@register_tool_parser("openai")  # vLLM's tool-call parser name for gpt-oss; one parser does both
class HarmonyParser:
    """One per choice, over openai-harmony's gpt-oss encoding: given, or loaded (once) from the
        model's `tokenizer` (see harmony_encoding.py). `stop`: the request's stop strings, cut off
    unless `include_stop_str`."""

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        encoding: Any = None,
        stop: list[str] | None = None,
        include_stop_str: bool = False,
    ):
        import openai_harmony as harmony

        self.encoding = encoding if encoding is not None else load_harmony_encoding(tokenizer)
        self.stops = list(stop or [])
        self.include_stop_str = include_stop_str  # vLLM's include_stop_str_in_output
        self.structure_ids = {
            t for name in STRUCTURE for t in self.encoding.encode(name, allowed_special="all")
        }
        self.parser = harmony.StreamableParser(self.encoding, harmony.Role.ASSISTANT)
        self.header_ids: list[int] = []  # ids of a header not yet closed by <|message|>
        self.raw_ids: list[int] | None = None  # set once output stops being harmony
        self.raw_sent = 0  # characters of decode(raw_ids) already sent
        self.body = ""  # the open message's text so far ...
        self.body_sent = 0  # ... and how much of it has been routed
        self.route: tuple[str | None, str] = (None, "")  # its (channel, recipient)
        self.is_stopped = False  # a stop string was reached: nothing more is sent
        self.is_first_token = True
        self.num_calls = 0
        self.call_message: int | None = None  # index in parser.messages of the open tool call
        # one label per token fed: the field its text went to ("content", "reasoning", "tool")
        # or None (header, channel and end tokens, hidden special tokens, text past a stop)
        self.token_fields: list[str | None] = []
        self.fed_ids: list[int] = []

    def feed(self, delta_text: str, delta_token_ids: list[int]) -> DeltaMessage:
        delta = DeltaMessage()
        for token_id in delta_token_ids:
            self.fed_ids.append(token_id)
            self.token_fields.append(self._process(token_id, delta))
        self._send_raw(delta, is_final=False)
        return delta

    def finish(self) -> DeltaMessage:
        delta = DeltaMessage()
        self._release(delta, is_final=True)  # a message cut off by max_tokens
        if self.raw_ids is None and self.header_ids and not self._is_cut_header():
            self.raw_ids = self.header_ids  # a header that was never harmony's: show it
            self._relabel_header(len(self.header_ids))
        self._send_raw(delta, is_final=True)
        return delta

    def parse(self, text: str, token_ids: list[int]) -> ParsedMessage:
        parser = HarmonyParser(
            encoding=self.encoding, stop=self.stops, include_stop_str=self.include_stop_str
        )
        return accumulate([parser.feed(text, token_ids), parser.finish()])

    def _process(self, token_id: int, delta: DeltaMessage) -> str | None:
        """Parse one token; returns its label (see `token_fields`)."""
        if self.is_stopped:
            return None
        is_hidden = token_id not in self.structure_ids and self.encoding.is_special_token(token_id)
        if self.raw_ids is not None:
            self.raw_ids.append(token_id)
            return None if is_hidden else "content"
        import openai_harmony as harmony

        if is_hidden:
            return None
        if self.is_first_token and not self._can_open_output(token_id):
            self.raw_ids = [token_id]  # e.g. a grammar's JSON from the first token: stream it
            return "content"
        self.is_first_token = False
        num_messages = len(self.parser.messages)
        try:
            self.parser.process(token_id)
        except Exception:  # HarmonyError (or any other refusal): not harmony any more, plain text
            self._release(delta, is_final=True)
            self.raw_ids = [*self.header_ids, token_id]
            self._relabel_header(len(self.header_ids))
            return "content"
        if len(self.parser.messages) > num_messages:  # the open message just ended
            self._release(delta, is_final=True)
            self.body, self.body_sent = "", 0
        state = self.parser.state
        if state == harmony.StreamState.HEADER:
            self.header_ids.append(token_id)
            return None
        self.header_ids = []
        if state != harmony.StreamState.CONTENT:
            return None
        recipient = self.parser.current_recipient or ""
        self.route = (self.parser.current_channel, recipient)
        if recipient.startswith(FUNCTIONS_PREFIX):
            self._open_call(recipient, delta)
        piece = self.parser.last_content_delta
        if token_id in self.structure_ids:  # the <|message|> that opened this body
            return None
        if piece:
            self.body += piece
            self._release(delta, is_final=False)
        return None if self.is_stopped and not piece else self._route_field()

    def _route_field(self) -> str:
        channel, recipient = self.route
        if recipient.startswith(FUNCTIONS_PREFIX):
            return "tool"
        return "reasoning" if channel == "analysis" or recipient else "content"

    def _relabel_header(self, num_ids: int) -> None:
        """A header that turned out not to be harmony is shown as content: so are its tokens."""
        for i in range(len(self.token_fields) - num_ids, len(self.token_fields)):
            if not self.encoding.is_special_token(self.fed_ids[i]):
                self.token_fields[i] = "content"

    def _is_cut_header(self) -> bool:
        """The open header is harmony's, cut short: a message came before it, or it opens with
        a structure token (`<|channel|>`) or a ` to=` recipient (not plain text like "tomorrow")."""
        if self.parser.messages or self.header_ids[0] in self.structure_ids:
            return True
        head = self.encoding.decode(self.header_ids).lstrip()
        return head.startswith("to=") or "to=".startswith(head)

    def _can_open_output(self, token_id: int) -> bool:
        """After `<|start|>assistant` comes `<|channel|>`, or a ` to=` recipient before it."""
        if token_id in self.structure_ids:
            return True
        head = self.encoding.decode([token_id]).lstrip()  # " to", " t", " " (a grammar's split)
        return head.startswith("to") or "to=".startswith(head)

    def _open_call(self, recipient: str, delta: DeltaMessage) -> None:
        """At the call's `<|message|>`: its index, id and name, before any argument."""
        message_index = len(self.parser.messages)
        if self.call_message == message_index:
            return
        self.call_message = message_index
        self.num_calls += 1
        name = recipient[len(FUNCTIONS_PREFIX) :]
        delta.tool_calls.append(
            ToolCallDelta(index=self.num_calls - 1, id=new_call_id(), name=name)
        )

    def _cut(self, text: str, sent: int, is_final: bool) -> int:
        """How far `text` may be sent: up to a stop string (then stop), or all but a tail that
        could still grow into one; nothing more once stopped."""
        if self.is_stopped:
            return sent
        if not self.stops:
            return len(text)
        found = find_stop(text, self.stops, sent - max(map(len, self.stops)) + 1)
        if found is not None:
            self.is_stopped = True
            return found[0] + (len(found[1]) if self.include_stop_str else 0)
        return len(text) if is_final else len(text) - holdback_length(text, self.stops)

    def _release(self, delta: DeltaMessage, is_final: bool) -> None:
        """Route the open message's text that may go out now."""
        end = self._cut(self.body, self.body_sent, is_final)
        piece, self.body_sent = self.body[self.body_sent : end], max(end, self.body_sent)
        if not piece:
            return
        field = self._route_field()
        if field == "tool":
            delta.tool_calls.append(ToolCallDelta(index=self.num_calls - 1, arguments=piece))
        elif field == "reasoning":
            delta.reasoning_content = (delta.reasoning_content or "") + piece
        else:
            delta.content = (delta.content or "") + piece

    def _send_raw(self, delta: DeltaMessage, is_final: bool) -> None:
        """Plain-text fallback, decoded incrementally (a split UTF-8 character waits)."""
        if not self.raw_ids:
            return
        text = self.encoding.decode(
            [t for t in self.raw_ids if not self.encoding.is_special_token(t)]
        )  # special tokens stay hidden, as skip_special_tokens hides them from plain text
        end = len(text) if is_final else len(text) - (text.endswith(REPLACEMENT))
        end = min(end, self._cut(text, self.raw_sent, is_final))
        if end > self.raw_sent:
            delta.content = (delta.content or "") + text[self.raw_sent : end]
            self.raw_sent = end
