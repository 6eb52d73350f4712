"""Output forced by `tool_choice`, whatever the model family (the same scheme as vLLM's).

`required`: the grammar makes the model write a JSON list of calls,
`[{"name": "f", "parameters": {...}}, ...]` (`required_calls_schema`), read here with the shared
scanner. A named function: the model writes only that function's arguments object, so every
token is an argument fragment of one call. Neither has content.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch_runner.serve.parsing import DeltaMessage, ParsedMessage, ToolCall, ToolCallDelta
from torch_runner.serve.tool_parsers.base import StreamingToolParser, new_call_id
from torch_runner.serve.tool_parsers.json_calls import CallScanner


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's arguments schema; none given means any object (OpenAI's default)."""
    return function.get("parameters") or {"type": "object"}


def required_calls_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of `required` output: one or more (at most one if not parallel) calls."""
    one_call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [f["name"]]},
                    "parameters": parameters_schema(f),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for f in functions
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": one_call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class RequiredCallsParser(StreamingToolParser):
    """`make_id`: the model family's call-id shape (Mistral's templates take only 9 alphanumerics)."""

    def __init__(self, make_id: Callable[[], str] = new_call_id) -> None:
        super().__init__()
        self._scanner = CallScanner()
        self.make_id = make_id  # type: ignore[method-assign]

    def _feed_text(self, text: str, out: DeltaMessage) -> None:
        self.emit_call_events(self._scanner.feed(text), out)  # the grammar leaves no stray text

    def _finish_text(self, out: DeltaMessage) -> None:
        self.emit_call_events(self._scanner.finish(), out)


class NamedCallParser:
    """Everything generated is the arguments of the one named function."""

    def __init__(self, name: str, make_id: Callable[[], str] = new_call_id) -> None:
        self.name = name
        self.call_id = make_id()
        self._started = False

    def feed(self, delta_text: str, delta_token_ids: list[int]) -> DeltaMessage:
        out = DeltaMessage()
        if not self._started:
            out.tool_calls.append(ToolCallDelta(0, self.call_id, self.name, delta_text))
            self._started = True
        elif delta_text:
            out.tool_calls.append(ToolCallDelta(0, arguments=delta_text))
        return out

    def finish(self) -> DeltaMessage:
        out = DeltaMessage()
        if not self._started:
            out.tool_calls.append(ToolCallDelta(0, self.call_id, self.name, ""))
            self._started = True
        return out

    def parse(self, text: str, token_ids: list[int]) -> ParsedMessage:
        return ParsedMessage(tool_calls=[ToolCall(self.call_id, self.name, text)])
