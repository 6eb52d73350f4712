"""`tool_choice: "auto"`: text stays free, but a call the model starts is a well-formed call.

Each family's grammar is an xgrammar structural tag in the layout its parser reads, so a call
names an offered function and carries JSON valid against that function's schema:
  hermes       `TriggeredTagsFormat` on the text `<tool_call>` (as SGLang's parsers build for
               tools): free text around `{"name": ..., "arguments": ...}` blocks.
  mistral      `TriggeredTagsFormat` on `[TOOL_CALLS]`: free text, then the calls: a JSON list
               of `{"name", "arguments"}` that ends the message (v3 tokenizers), or
               `NAME[ARGS]{...}` per call (tokenizers that have the `[ARGS]` token).
  llama3_json  no start marker: the parser decides at the start of the message (a first
               non-blank `{`, or `<|python_tag|>`, means calls), so the grammar does too: either
               text whose first non-blank character is not `{`, or only calls,
               `{"name": ..., "parameters": ...}` separated by `; ` (a text answer may not hold
               `<|python_tag|>`, Llama's marker for built-in tools). xgrammar's own Llama
               template triggers on `{"name": ` anywhere instead; that would constrain JSON the
               parser reads as content, so the start rule here is the parser's.
  openai       gpt-oss harmony, by token id (serve/harmony_tools.py, `harmony_auto_grammar`).
With `parallel_tool_calls: false` at most one call is written. Other parser names (and
llama3_json behind a reasoning parser, whose message starts after `</think>`) return None:
parsed, not constrained. xgrammar matches a marker token (`[TOOL_CALLS]`, `<|python_tag|>`,
`<tool_call>`) as its text, which is also how these parsers read it, so spelling a marker out
character by character starts a constrained call too.
"""

from __future__ import annotations

import json
import re
from typing import Any

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
PYTHON_TAG = "<|python_tag|>"
BLANKS = r"[ \t\r\n]"  # what llama3_json strips before deciding (serve/tool_parsers/llama3_json.py)


def _arguments(function: dict[str, Any]) -> Any:
    from xgrammar.structural_tag import JSONSchemaFormat

    return JSONSchemaFormat(
        json_schema=function.get("parameters") or {"type": "object"}, max_whitespace_cnt=1
    )


def _one_of(elements: list[Any]) -> Any:
    from xgrammar.structural_tag import OrFormat

    return elements[0] if len(elements) == 1 else OrFormat(elements=elements)


def _hermes(functions: list[dict[str, Any]], is_parallel: bool, vocab: dict[str, int]) -> Any:
    """The Qwen/Hermes template's own layout: `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`."""
    from xgrammar.structural_tag import TagFormat, TriggeredTagsFormat

    tags = [
        TagFormat(
            begin=f'{HERMES_START}\n{{"name": {json.dumps(f["name"])}, "arguments": ',
            content=_arguments(f),
            end=f"}}\n{HERMES_END}",
        )
        for f in functions
    ]
    return TriggeredTagsFormat(triggers=[HERMES_START], tags=tags, stop_after_first=not is_parallel)


def _mistral(functions: list[dict[str, Any]], is_parallel: bool, vocab: dict[str, int]) -> Any:
    """By text, as the parser reads it: xgrammar sees a marker token as its text, so the token
    and the same characters spelled out both trigger the call grammar."""
    from xgrammar.structural_tag import (
        ConstStringFormat,
        JSONSchemaFormat,
        SequenceFormat,
        TagFormat,
        TriggeredTagsFormat,
    )

    if MISTRAL_ARGS in vocab:  # v11+: [TOOL_CALLS]NAME[ARGS]{...}, once per call
        tags = [
            TagFormat(
                begin=MISTRAL_CALLS,
                content=SequenceFormat(
                    elements=[ConstStringFormat(value=f["name"] + MISTRAL_ARGS), _arguments(f)]
                ),
                end="",
            )
            for f in functions
        ]
        return TriggeredTagsFormat(
            triggers=[MISTRAL_CALLS],
            tags=tags,
            excludes=[MISTRAL_ARGS],
            stop_after_first=not is_parallel,
        )
    calls = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": f["name"]},
                        "arguments": f.get("parameters") or {"type": "object"},
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for f in functions
            ]
        },
    }
    if not is_parallel:
        calls["maxItems"] = 1
    listing = JSONSchemaFormat(json_schema=calls, max_whitespace_cnt=1)
    return TriggeredTagsFormat(
        triggers=[MISTRAL_CALLS],
        tags=[TagFormat(begin=MISTRAL_CALLS, content=listing, end="")],
        stop_after_first=True,  # the list holds every call of the message
    )


def _not_starting_with(text: str) -> tuple[str, str]:
    """Regexes for strings that do not begin with `text`: (those that differ from it at some
    character, so any text may follow; those that are a proper prefix of it, ending there)."""
    escaped = [re.escape(char) for char in text]
    differ = ["".join(escaped[:i]) + f"[^{escaped[i]}]" for i in range(len(text))]
    cut_short = ["".join(escaped[:i]) for i in range(len(text))]
    return "(" + "|".join(differ) + ")", "(" + "|".join(cut_short) + ")"


def _llama3_json(functions: list[dict[str, Any]], is_parallel: bool, vocab: dict[str, int]) -> Any:
    from xgrammar.structural_tag import (
        AnyTextFormat,
        ConstStringFormat,
        OptionalFormat,
        RegexFormat,
        SequenceFormat,
        StarFormat,
    )

    call = _one_of(
        [
            SequenceFormat(
                elements=[
                    ConstStringFormat(value=f'{{"name": {json.dumps(f["name"])}, "parameters": '),
                    _arguments(f),
                    ConstStringFormat(value="}"),
                ]
            )
            for f in functions
        ]
    )
    blank = RegexFormat(pattern=BLANKS + "*")  # the parser's blanks (not all of Unicode's)
    head = [blank, OptionalFormat(content=ConstStringFormat(value=PYTHON_TAG)), blank]
    more = [StarFormat(content=SequenceFormat(elements=[ConstStringFormat(value="; "), call]))]
    tail = RegexFormat(pattern=BLANKS + "{0,2}")  # then the end of the turn
    calls = SequenceFormat(elements=[*head, call, *(more if is_parallel else []), tail])
    # text: its first non-blank character is not `{` and it does not open with the python tag
    # (by text: `<|python_tag|>` is one token, but xgrammar matches it as its characters)
    rest = AnyTextFormat(excludes=[PYTHON_TAG])
    differ, cut_short = _not_starting_with(PYTHON_TAG[1:])
    text = _one_of(
        [
            blank,
            SequenceFormat(elements=[RegexFormat(pattern=BLANKS + r"*[^ \t\r\n{<]"), rest]),
            SequenceFormat(elements=[RegexFormat(pattern=BLANKS + "*<" + differ), rest]),
            RegexFormat(pattern=BLANKS + "*<" + cut_short),
        ]
    )
    return _one_of([calls, text])


AUTO_TAGS = {"hermes": _hermes, "mistral": _mistral, "llama3_json": _llama3_json}
UNDER_REASONING = ("hermes", "mistral")  # formats whose start marker may follow `</think>`


def auto_tool_grammar(
    parser_name: str,
    functions: list[dict[str, Any]],
    is_parallel: bool,
    vocab: dict[str, int] | None = None,
    *,
    has_reasoning: bool = False,
) -> str | None:
    """xgrammar EBNF (rule `root`) for an auto answer in `parser_name`'s format; None when that
    family is not constrained (see the module docstring). `vocab`: the tokenizer's added tokens
    (text -> id), where the special-token markers are."""
    build = AUTO_TAGS.get(parser_name)
    if build is None or not functions or (has_reasoning and parser_name not in UNDER_REASONING):
        return None
    import xgrammar as xgr
    from xgrammar.structural_tag import StructuralTag

    fmt = build(functions, is_parallel, vocab or {})
    if fmt is None:
        return None
    return str(xgr.Grammar.from_structural_tag(StructuralTag(format=fmt)))
