"""OpenAI `response_format` (plus two documented extensions) -> the engine's StructuredOutputSpec.

Accepted shapes (docs/structured-output.md):
  {"type": "text"}                                         free text (no grammar)
  {"type": "json_object"}                                  any JSON object
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
  {"type": "regex", "regex": "<pattern>"}                  extension: the whole output matches
  {"type": "grammar", "grammar": "<EBNF>"}                 extension: xgrammar EBNF, rule `root`

Why here and not in the server: the mapping is a grammar concern (which kinds exist, how a spec is
checked), and the server keeps one seam (`serve/params.structured_spec`) that calls this. Every
spec is parsed by xgrammar before the request is queued, so a bad one is a 400 carrying
xgrammar's message even on a streaming request.
"""

from __future__ import annotations

from typing import Any

from ops.sampling.params import StructuredOutputSpec
from torch_runner.grammar.compiler import validate_grammar

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
# response_format type -> (engine kind, the key holding the spec)
_SHAPES: dict[str, tuple[str | None, str | None]] = {
    "text": (None, None),
    "json_object": ("json_object", None),
    "json_schema": ("json_schema", "json_schema"),
    "regex": ("regex", "regex"),
    "grammar": ("ebnf", "grammar"),
}
_JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")


class ResponseFormatError(ValueError):
    """A malformed `response_format`; `param` names the offending field."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(message)
        self.param = param


def spec_from_response_format(response_format: Any) -> StructuredOutputSpec | None:
    """Validate `response_format` and return the spec to enforce (None = free text)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ResponseFormatError(
            f"response_format must be an object, got {type(response_format).__name__}"
        )
    kind_name = response_format.get("type")
    if kind_name not in _SHAPES:
        raise ResponseFormatError(
            f"response_format type {kind_name!r} is not supported; allowed values: "
            + ", ".join(repr(t) for t in RESPONSE_FORMAT_TYPES),
            param="response_format.type",
        )
    kind, spec_key = _SHAPES[kind_name]
    allowed = {"type"} | ({spec_key} if spec_key else set())
    extra = sorted(set(response_format) - allowed)
    if extra:
        raise ResponseFormatError(
            f"response_format of type {kind_name!r} does not take {', '.join(extra)}; "
            f"allowed keys: {', '.join(sorted(allowed))}",
            param=f"response_format.{extra[0]}",
        )
    if kind is None:
        return None
    if kind == "json_object":
        return StructuredOutputSpec("json_object")
    if spec_key not in response_format:
        raise ResponseFormatError(
            f"response_format of type {kind_name!r} needs the {spec_key!r} field",
            param=f"response_format.{spec_key}",
        )
    spec = response_format[spec_key]
    if kind == "json_schema":
        spec = _schema_of(spec)
    return StructuredOutputSpec(kind, validate_grammar(kind, spec))


def _schema_of(json_schema: Any) -> Any:
    """OpenAI nests the schema: json_schema = {"name", "description", "schema", "strict"}."""
    if not isinstance(json_schema, dict):
        raise ResponseFormatError(
            "response_format.json_schema must be an object with a 'schema' field",
            param="response_format.json_schema",
        )
    extra = sorted(set(json_schema) - set(_JSON_SCHEMA_KEYS))
    if extra:
        raise ResponseFormatError(
            f"response_format.json_schema does not take {', '.join(extra)}; allowed keys: "
            + ", ".join(_JSON_SCHEMA_KEYS),
            param=f"response_format.json_schema.{extra[0]}",
        )
    if "schema" not in json_schema:
        raise ResponseFormatError(
            "response_format.json_schema needs the 'schema' field (the JSON schema itself)",
            param="response_format.json_schema.schema",
        )
    return json_schema["schema"]
