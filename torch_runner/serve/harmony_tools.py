"""Grammars that keep gpt-oss in its harmony format: forced and auto tool calls, response_format.

`tool_choice` "required" or a named function is a grammar for one harmony call; `auto` lets
the model write analysis, commentary and final messages freely, but a message addressed to
`functions.NAME` must name an offered function and carry schema-valid JSON (`harmony_auto_grammar`).

The forced JSON of other families would push gpt-oss out of its format, so here the grammar is
harmony's own call message: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`
then arguments valid against that function's schema (at most one blank in a row, as compact
JSON: a sampled model would otherwise pad it without end), then `<|call|>` (a stop token: one
call per turn, as gpt-oss makes them). Special tokens are xgrammar `Token(id)` elements, so the model
writes the real ids the harmony parser reads; `required` is a choice between every offered tool.

`response_format` JSON or regex becomes the body of a `final` message,
`<|channel|>final<|message|>` + the constrained text, so it arrives as `content` and the model
writes the header it was trained to write before an answer. An EBNF `grammar` (our extension) is
left as written: it controls every token, and can spell harmony itself with `Token(id)`.
"""

from __future__ import annotations

import json
from typing import Any


def _token(encoding: Any, name: str):
    """A structural-tag element forcing one harmony special token (by its id in `encoding`)."""
    from xgrammar.structural_tag import TokenFormat

    (token_id,) = encoding.encode(name, allowed_special="all")
    return TokenFormat(token=token_id)


def harmony_call_grammar(encoding: Any, tools: list[dict[str, Any]], names: list[str]) -> str:
    """xgrammar EBNF (rule `root`) for one call to one of `names`, with its JSON-schema arguments."""
    import xgrammar as xgr
    from xgrammar.structural_tag import (
        ConstStringFormat,
        JSONSchemaFormat,
        OrFormat,
        SequenceFormat,
        StructuralTag,
    )

    schemas = {tool["function"]["name"]: tool["function"].get("parameters") for tool in tools}
    calls = [
        SequenceFormat(
            elements=[
                _token(encoding, "<|channel|>"),
                ConstStringFormat(value=f"commentary to=functions.{name} "),
                _token(encoding, "<|constrain|>"),
                ConstStringFormat(value="json"),
                _token(encoding, "<|message|>"),
                JSONSchemaFormat(
                    json_schema=schemas[name] or {"type": "object"}, max_whitespace_cnt=1
                ),
                _token(encoding, "<|call|>"),
            ]
        )
        for name in names
    ]
    call = calls[0] if len(calls) == 1 else OrFormat(elements=calls)
    return str(xgr.Grammar.from_structural_tag(StructuralTag(format=call)))


WRAPPED_KINDS = ("json_object", "json_schema", "regex")  # StructuredOutputSpec kinds


def harmony_final_grammar(encoding: Any, spec: Any) -> str:
    """xgrammar EBNF for a `final` message whose body follows `spec` (a StructuredOutputSpec of
    one of WRAPPED_KINDS)."""
    import xgrammar as xgr
    from xgrammar.structural_tag import (
        ConstStringFormat,
        JSONSchemaFormat,
        RegexFormat,
        SequenceFormat,
        StructuralTag,
    )

    if spec.kind in ("json_object", "json_schema"):
        schema = json.loads(spec.spec) if spec.kind == "json_schema" else {"type": "object"}
        body: Any = JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=1)
    else:
        body = RegexFormat(pattern=spec.spec)
    message = SequenceFormat(
        elements=[
            _token(encoding, "<|channel|>"),
            ConstStringFormat(value="final"),
            _token(encoding, "<|message|>"),
            body,
        ]
    )
    return str(xgr.Grammar.from_structural_tag(StructuralTag(format=message)))


# `tool_choice: "auto"`: the tokens a free message body may not contain (they end or start one)
BODY_EXCLUDES = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
BODY_EXCLUDES += ("<|constrain|>",)
FREE_CHANNELS = ("analysis", "commentary", "final")


def harmony_auto_grammar(encoding: Any, functions: list[dict[str, Any]]) -> str:
    """xgrammar EBNF for an auto answer: any number of `analysis` / `commentary` / `final`
    messages with free bodies, each ended by `<|end|>` and followed by `<|start|>assistant`; the
    turn ends with `<|return|>` after a final message, or with one call: a commentary message
    to `functions.NAME` (NAME offered; the recipient before or after the channel, json with or
    without `<|constrain|>`, the spellings gpt-oss writes) whose body is schema-valid JSON, then
    `<|call|>`."""
    import xgrammar as xgr
    from xgrammar.structural_tag import (
        AnyTokensFormat,
        ConstStringFormat,
        JSONSchemaFormat,
        OrFormat,
        SequenceFormat,
        StarFormat,
        StructuralTag,
    )

    def token(name: str):
        return _token(encoding, name)

    def one_of(elements: list[Any]) -> Any:
        return elements[0] if len(elements) == 1 else OrFormat(elements=elements)

    def text(value: str):
        return ConstStringFormat(value=value)

    def free_message(channel: str) -> Any:
        excluded = [encoding.encode(n, allowed_special="all")[0] for n in BODY_EXCLUDES]
        body = AnyTokensFormat(exclude_tokens=excluded)
        return SequenceFormat(
            elements=[token("<|channel|>"), text(channel), token("<|message|>"), body]
        )

    json_kind = one_of(
        [
            SequenceFormat(elements=[text(" "), token("<|constrain|>"), text("json")]),
            SequenceFormat(elements=[token("<|constrain|>"), text("json")]),
            text(" json"),
        ]
    )

    def call(function: dict[str, Any]) -> Any:
        recipient = f"to=functions.{function['name']}"
        arguments = JSONSchemaFormat(
            json_schema=function.get("parameters") or {"type": "object"}, max_whitespace_cnt=1
        )
        end = [token("<|message|>"), arguments, token("<|call|>")]
        channel_first = [token("<|channel|>"), text(f"commentary {recipient}"), json_kind]
        recipient_first = [
            text(f" {recipient}"),
            token("<|channel|>"),
            text("commentary"),
            json_kind,
        ]
        return one_of(
            [
                SequenceFormat(elements=channel_first + end),
                SequenceFormat(elements=recipient_first + end),
            ]
        )

    free = one_of([free_message(channel) for channel in FREE_CHANNELS])
    next_message = SequenceFormat(
        elements=[free, token("<|end|>"), token("<|start|>"), text("assistant")]
    )
    last = one_of(
        [
            SequenceFormat(elements=[free_message("final"), token("<|return|>")]),
            *[call(f) for f in functions],
        ]
    )
    turn = SequenceFormat(elements=[StarFormat(content=next_message), last])
    return str(xgr.Grammar.from_structural_tag(StructuralTag(format=turn)))
