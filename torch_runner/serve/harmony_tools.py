"""`tool_choice` "required" or a named function for gpt-oss: a grammar for one harmony call.

The forced JSON of other families would push gpt-oss out of its format, so here the grammar is
harmony's own call message: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`
then arguments valid against that function's schema (at most one blank in a row, as compact
JSON: a sampled model would otherwise pad it without end), then `<|call|>` (a stop token: one
call per turn, as gpt-oss makes them). Special tokens are xgrammar `Token(id)` elements, so the model
writes the real ids the harmony parser reads; `required` is a choice between every offered tool.
"""

from __future__ import annotations

from typing import Any


def harmony_call_grammar(encoding: Any, tools: list[dict[str, Any]], names: list[str]) -> str:
    """xgrammar EBNF (rule `root`) for one call to one of `names`, with its JSON-schema arguments."""
    import xgrammar as xgr
    from xgrammar.structural_tag import (
        ConstStringFormat,
        JSONSchemaFormat,
        OrFormat,
        SequenceFormat,
        StructuralTag,
        TokenFormat,
    )

    def token(name: str) -> TokenFormat:
        (token_id,) = encoding.encode(name, allowed_special="all")
        return TokenFormat(token=token_id)

    schemas = {tool["function"]["name"]: tool["function"].get("parameters") for tool in tools}
    calls = [
        SequenceFormat(
            elements=[
                token("<|channel|>"),
                ConstStringFormat(value=f"commentary to=functions.{name} "),
                token("<|constrain|>"),
                ConstStringFormat(value="json"),
                token("<|message|>"),
                JSONSchemaFormat(
                    json_schema=schemas[name] or {"type": "object"}, max_whitespace_cnt=1
                ),
                token("<|call|>"),
            ]
        )
        for name in names
    ]
    call = calls[0] if len(calls) == 1 else OrFormat(elements=calls)
    return str(xgr.Grammar.from_structural_tag(StructuralTag(format=call)))
