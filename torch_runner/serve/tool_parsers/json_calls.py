"""An incremental scanner for JSON call objects, `{"name": "f", "arguments": {...}}`.

Hermes, Llama-3 JSON, Mistral and the forced (`tool_choice` required) output all write calls as
JSON objects with a `name` and an `arguments` (or `parameters`) value. `CallScanner` reads such
objects a character at a time, so a stream announces a call (id and name) as soon as its name is
complete and then sends the arguments' raw text in pieces as it arrives. The arguments string is
the model's own text of that value (valid JSON whenever the model wrote valid JSON; OpenAI makes
the same promise, no more).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class CallEvent:
    """`kind`: "name" (a call's name is complete), "args" (an argument fragment), "end" (the
    object closed or was cut off), "text" (characters outside any object, or an object that
    never named a function: its raw text)."""

    kind: str
    text: str = ""


class CallScanner:
    """Reads a run of JSON objects; separators between objects (whitespace `[ ] , ;`) are dropped.

    Inside an object only the top level matters: the `name` string and the `arguments` /
    `parameters` value (the first of them). Argument text seen before the name is held and sent
    right after it; a string-valued `arguments` (JSON inside a string) is decoded when complete.
    """

    SEPARATORS = " \t\r\n[],;"

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self._reset_object()

    def _reset_object(self) -> None:
        self.raw = ""  # the whole current object, for one that turns out not to be a call
        self.name: str | None = None
        self.phase = "key"  # key -> colon -> value_start -> value -> after_value -> key ...
        self.key_raw = ""
        self.key: str | None = None
        self.value_raw = ""  # the current value's text, when it is the name or string arguments
        self.args_pending = ""  # argument text held until the name is known
        self.has_args = False
        self.args_done = False
        self.args_is_string = False

    @property
    def is_open(self) -> bool:
        return self.depth > 0

    def feed(self, text: str) -> list[CallEvent]:
        events: list[CallEvent] = []
        for char in text:
            if self.depth == 0:
                if char == "{":
                    self.depth = 1
                    self.raw = char
                elif char not in self.SEPARATORS:
                    events.append(CallEvent("text", char))
                continue
            self.raw += char
            self._step(char, events)
        return _merged(events)

    def finish(self) -> list[CallEvent]:
        """End of input: an object cut off is still a call if it named a function."""
        events: list[CallEvent] = []
        if self.depth > 0:
            if self.phase == "value":
                self._end_value(events)
            self._close_object(events)
        return _merged(events)

    def _step(self, char: str, events: list[CallEvent]) -> None:
        phase = self.phase
        if phase == "key":
            if self.in_string:
                self.key_raw += char
                if self._string_char(char):
                    self.key = _json_string(self.key_raw)
                    self.phase = "colon"
            elif char == '"':
                self.in_string, self.key_raw = True, char
            elif char == "}":
                self._close_object(events)
        elif phase == "colon":
            if char == ":":
                self.phase = "value_start"
            elif char == "}":
                self._close_object(events)
        elif phase == "value_start":
            if char.isspace():
                return
            if char == "}":
                self._close_object(events)
                return
            self.phase = "value"
            self.value_raw = ""
            self.args_is_string = char == '"'
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            self._record(char, events)
        elif phase == "value":
            self._value_step(char, events)
        elif char == ",":  # after_value
            self.phase = "key"
        elif char == "}":
            self._close_object(events)

    def _value_step(self, char: str, events: list[CallEvent]) -> None:
        if self.in_string:
            self._record(char, events)
            if self._string_char(char) and self.depth == 1:
                self._end_value(events)
            return
        if char in "}]" and self.depth == 1:  # the object closes right after a primitive value
            self._end_value(events)
            self._close_object(events)
            return
        if char == "," and self.depth == 1:
            self._end_value(events)
            self.phase = "key"
            return
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
        self._record(char, events)
        if char in "}]" and self.depth == 1:
            self._end_value(events)

    def _string_char(self, char: str) -> bool:
        """Advance the string state by one character; True when it closed the string."""
        if self.escape:
            self.escape = False
        elif char == "\\":
            self.escape = True
        elif char == '"':
            self.in_string = False
            return True
        return False

    def _record(self, char: str, events: list[CallEvent]) -> None:
        if self.key == "name":
            self.value_raw += char
        elif self.key in ARGUMENT_KEYS and not self.args_done:
            if self.args_is_string:
                self.value_raw += char
            else:
                self._send_args(char, events)

    def _send_args(self, text: str, events: list[CallEvent]) -> None:
        self.has_args = True
        if self.name is not None:
            events.append(CallEvent("args", text))
        else:
            self.args_pending += text

    def _end_value(self, events: list[CallEvent]) -> None:
        if self.key == "name" and self.name is None:
            name = _json_string(self.value_raw.strip())
            if name:
                self.name = name
                events.append(CallEvent("name", name))
                if self.args_pending:
                    events.append(CallEvent("args", self.args_pending))
                    self.args_pending = ""
        elif self.key in ARGUMENT_KEYS and not self.args_done:
            if self.args_is_string:
                decoded = _json_string(self.value_raw)
                self._send_args(self.value_raw if decoded is None else decoded, events)
            self.args_done = True
        self.phase = "after_value"
        self.key = None
        self.value_raw = ""

    def _close_object(self, events: list[CallEvent]) -> None:
        self.depth = 0
        self.in_string = self.escape = False
        if self.name is None:
            events.append(CallEvent("text", self.raw))
        else:
            if not self.has_args:
                events.append(CallEvent("args", "{}"))
            events.append(CallEvent("end"))
        self._reset_object()


def _json_string(raw: str) -> str | None:
    """A JSON string literal's value; None if `raw` is not one."""
    if len(raw) < 2 or raw[0] != '"' or raw[-1] != '"':
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def _merged(events: list[CallEvent]) -> list[CallEvent]:
    """Join runs of "args" / "text" events (one per character) into one event each."""
    merged: list[CallEvent] = []
    for event in events:
        if merged and event.kind in ("args", "text") and merged[-1].kind == event.kind:
            merged[-1].text += event.text
        else:
            merged.append(CallEvent(event.kind, event.text))
    return merged
