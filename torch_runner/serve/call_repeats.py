"""`tool_choice: "required"` with parallel calls: a call that repeats an earlier one ends the list.

The grammar makes every call well formed but cannot bound how many the model writes (vLLM's and
SGLang's `required` schemas have no `maxItems` either); a small model can loop, writing the same
calls again until `max_tokens`. `RepeatGuard` reads the generated text (the JSON list of calls)
as it arrives: when a call closes that is the same as an earlier call of the answer (same name,
same arguments), generation stops there (the caller aborts the engine request) and the repeat
is dropped: the answer ends with the calls before it, finish_reason "tool_calls".

Calls are compared by their text outside strings' whitespace: the grammar fixes the JSON layout
(no free whitespace, keys in the schema's order), so two calls are equal JSON exactly when their
texts are equal, except for a string escaped differently or a number spelled differently
(`"\\u0050aris"`, `1.0`), which counts as a different call. So a repeat is seen while it is
written: the text of an open call that is still a prefix of an earlier call is held back, and a
repeat is never streamed. Every other character is released as soon as it arrives.
"""

from __future__ import annotations

WHITESPACE = " \t\r\n"


class RepeatGuard:
    """One per choice. `visible(text, is_final)` takes the choice's whole text so far and says how
    much of it may be shown; once `is_cut`, the text ends there and generation must stop."""

    def __init__(self) -> None:
        self.num_seen = 0  # characters of the text consumed
        self.stack: list[str] = []  # open brackets, outermost first
        self.in_string = False
        self.escape = False
        self.calls: set[str] = (
            set()
        )  # every complete call's text (whitespace outside strings dropped)
        self.call: str | None = None  # the open call's text so far
        self.call_start = 0  # where the open call's `{` is in the text
        self.matches: list[str] = []  # earlier calls the open call is still a prefix of
        self.released = 0
        self.is_cut = False

    def visible(self, text: str, is_final: bool = False) -> str:
        if not self.is_cut:
            for position in range(self.num_seen, len(text)):
                self._step(text[position], position)
                if self.is_cut:
                    break
            else:
                self.num_seen = len(text)
                held = self.call is not None and self.matches and not is_final
                self.released = self.call_start if held else len(text)
        return text[: self.released]

    def _opens_call(self) -> bool:
        """A call is an object at the top level or directly inside the top-level list."""
        return self.stack in (["{"], ["[", "{"])

    def _step(self, char: str, position: int) -> None:
        if self.in_string:
            self._add(char)
            if self.escape:
                self.escape = False
            elif char == "\\":
                self.escape = True
            elif char == '"':
                self.in_string = False
            return
        if char in WHITESPACE:
            return
        if char in "[{":
            self.stack.append(char)
            if char == "{" and self._opens_call() and self.call is None:
                self.call, self.call_start = "", position
                self.matches = sorted(self.calls)
        elif char in "]}":
            closes_call = char == "}" and self._opens_call() and self.call is not None
            if self.stack:
                self.stack.pop()
            if closes_call:
                self._add(char)
                self._close_call(position)
                return
        elif char == '"':
            self.in_string = True
        self._add(char)

    def _add(self, char: str) -> None:
        if self.call is None:
            return
        size = len(self.call)
        self.call += char
        self.matches = [m for m in self.matches if len(m) > size and m[size] == char]

    def _close_call(self, position: int) -> None:
        call, self.call = self.call or "", None
        if call in self.calls:  # held back all along: nothing of it was shown
            self.is_cut = True
            self.released = self.call_start
            return
        self.calls.add(call)
        self.matches = []
