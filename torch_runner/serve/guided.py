"""vLLM's guided decoding fields -> the one `response_format` the grammar machinery enforces.

`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (vLLM < 0.11) and
`structured_outputs` {json, regex, choice, grammar, json_object} (vLLM >= 0.11) become the
equivalent `response_format` (torch_runner/grammar/formats.py), so they share its validation and
its xgrammar compilation. A choice list is an EBNF alternation of JSON-escaped string literals
(exactly one of the strings, nothing around it). More than one constraint in a request is a 400
naming both fields; a bad spec is a 400 naming the field the client used.
"""

from __future__ import annotations

import json
from typing import Any

from torch_runner.serve.errors import InvalidRequestError

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def choice_grammar(choices: list[str], param: str) -> str:
    """EBNF whose only sentences are the given strings."""
    if any(not isinstance(c, str) or not c for c in choices):
        raise InvalidRequestError(f"{param} entries must be non-empty strings", param=param)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _format_for(kind: str, value: Any, param: str) -> dict[str, Any]:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(
                    f"{param} is not valid JSON ({exc})", param=param
                ) from None
        return {"type": "json_schema", "json_schema": {"name": param, "schema": value}}
    if kind == "regex":
        return {"type": "regex", "regex": value}
    if kind == "choice":
        return {"type": "grammar", "grammar": choice_grammar(list(value), param)}
    if kind == "grammar":
        return {"type": "grammar", "grammar": value}
    return {"type": "json_object"}  # json_object


def _requested(request: Any) -> list[tuple[str, str, Any]]:
    """(field name as sent, kind, value) for every guided constraint in the request."""
    found = [
        (name, name.removeprefix("guided_"), getattr(request, name))
        for name in GUIDED_FIELDS
        if getattr(request, name) is not None
    ]
    outputs = request.structured_outputs
    if outputs is not None:
        unknown = sorted(set(outputs) - set(STRUCTURED_OUTPUT_KEYS))
        if unknown:
            raise InvalidRequestError(
                f"structured_outputs does not take {', '.join(unknown)}; allowed keys: "
                + ", ".join(STRUCTURED_OUTPUT_KEYS),
                param=f"structured_outputs.{unknown[0]}",
            )
        for key in STRUCTURED_OUTPUT_KEYS:
            value = outputs.get(key)
            if value is None or (key == "json_object" and value is False):
                continue
            found.append((f"structured_outputs.{key}", key, value))
    return found


def guided_response_format(request: Any) -> tuple[dict[str, Any] | None, str]:
    """The `response_format` to enforce and the field that asked for it (for 400s)."""
    found = _requested(request)
    response_format = request.response_format
    if response_format is not None and response_format.get("type") != "text":
        found.insert(0, ("response_format", "response_format", response_format))
    if len(found) > 1:
        names = ", ".join(name for name, _, _ in found)
        raise InvalidRequestError(
            f"only one structured-output constraint per request; got {names}",
            param=found[1][0],
        )
    if not found:
        return response_format, "response_format"
    name, kind, value = found[0]
    if kind == "response_format":
        return value, name
    return _format_for(kind, value, name), name
