"""response_format (OpenAI shapes + regex / grammar extensions) -> StructuredOutputSpec."""

from __future__ import annotations

import json

import pytest

from ops.sampling.params import StructuredOutputSpec
from torch_runner.grammar.compiler import GrammarError
from torch_runner.grammar.formats import (
    RESPONSE_FORMAT_TYPES,
    ResponseFormatError,
    spec_from_response_format,
)

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def test_text_and_none_are_free_generation():
    assert spec_from_response_format(None) is None
    assert spec_from_response_format({"type": "text"}) is None


def test_json_object_and_json_schema_map_to_their_kinds():
    assert spec_from_response_format({"type": "json_object"}) == StructuredOutputSpec("json_object")
    spec = spec_from_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    )
    assert spec.kind == "json_schema" and json.loads(spec.spec) == SCHEMA


def test_regex_and_grammar_extensions_map_to_their_kinds():
    assert spec_from_response_format({"type": "regex", "regex": "[0-9]+"}) == StructuredOutputSpec(
        "regex", "[0-9]+"
    )
    ebnf = 'root ::= "a" | "b"'
    assert spec_from_response_format({"type": "grammar", "grammar": ebnf}) == StructuredOutputSpec(
        "ebnf", ebnf
    )


@pytest.mark.parametrize(
    ("response_format", "param", "says"),
    [
        (
            {"type": "yaml"},
            "response_format.type",
            "allowed values: " + repr(RESPONSE_FORMAT_TYPES[0]),
        ),
        ({"type": "regex"}, "response_format.regex", "needs the 'regex' field"),
        ({"type": "json_schema"}, "response_format.json_schema", "needs the 'json_schema' field"),
        (
            {"type": "json_schema", "json_schema": {"name": "x"}},
            "response_format.json_schema.schema",
            "'schema'",
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": {}, "oops": 1}},
            "response_format.json_schema.oops",
            "allowed keys",
        ),
        ({"type": "json_object", "regex": "a"}, "response_format.regex", "does not take regex"),
        ("json", "response_format", "must be an object"),
    ],
)
def test_malformed_response_format_names_the_field(response_format, param, says):
    with pytest.raises(ResponseFormatError) as info:
        spec_from_response_format(response_format)
    assert isinstance(info.value, ValueError) and info.value.param == param
    assert says in str(info.value)


@pytest.mark.parametrize(
    ("response_format", "xgrammar_says"),
    [
        (
            {"type": "json_schema", "json_schema": {"schema": {"type": "objec"}}},
            'Unsupported type "objec"',
        ),
        ({"type": "regex", "regex": "[a-"}, "Regex parsing error"),
        ({"type": "grammar", "grammar": "root ::= missing"}, 'Rule "missing" is not defined'),
    ],
)
def test_invalid_grammar_is_rejected_before_queueing_with_xgrammars_message(
    response_format, xgrammar_says
):
    with pytest.raises(GrammarError) as info:
        spec_from_response_format(response_format)
    assert xgrammar_says in str(info.value) and info.value.param == "response_format"
